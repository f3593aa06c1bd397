"""Templated questions over the training databases, written as a task file: SFT data that teaches reading the
schema, not the gold set (lightning_otel.tasks.spider.synthesis says how they are made and checked).

    .venv/bin/python -m benchmarks.learning.spider_synth --out /tmp/synth.jsonl --per-db 200 [--db world_1 ...]

Nothing here reads a held-out database unless named: keep lightning_otel.tasks.spider.splits.HELD_OUT out of
--db. Rows have the task file's shape (`id`, `db_id`, `question`, `query`, `hardness`).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from lightning_otel.tasks.spider.rewards import bundled_data_dir, database_path
from lightning_otel.tasks.spider.splits import write_rows
from lightning_otel.tasks.spider.synthesis import synthesize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--db", nargs="+", required=True, help="database ids under the bundled data")
    parser.add_argument("--per-db", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = [row for db in args.db
            for row in synthesize(database_path(bundled_data_dir(), db), db, args.per_db, args.seed)]
    write_rows(rows, args.out)
    print(f"{len(rows)} rows -> {args.out}")


if __name__ == "__main__":
    main()
