"""Options that mean the same in every command that takes them."""
from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_DB = "traces.duckdb"
FORMATS = ("table", "csv", "json", "parquet")


def add_db(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", type=Path, default=Path(DEFAULT_DB),
                        help=f"DuckDB trace store file (default: {DEFAULT_DB})")


def add_task_pack(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument("--reward", required=required,
                        help="reward function: a name a task pack registers (spider_exec, spider_shaped, "
                             "number_match), module:function or path/to/file.py:function")
    parser.add_argument("--task-pack", metavar="NAME",
                        help="task pack (spider, math, an installed one, or module:ATTRIBUTE; default: the pack "
                             "that registers --reward): per-rollout setup such as {db_path}, outcome classes")
    parser.add_argument("--data-dir", type=Path, help="the task pack's data folder, e.g. Spider's layout for "
                                                      "{db_path} (default: the pack's own bundled data)")
