"""Repair demonstrations for the multi-turn SQL agent, written as a task file: a labelled question, a wrong first
query of the kind a small model writes, and the labelled path that repairs it (lightning_otel.tasks.spider.repair
says how they are made; train them with its REPAIR_LABELS and REPAIR_UNTRAINED).

    .venv/bin/python -m benchmarks.learning.spider_repair --tasks /tmp/learning/sft.jsonl --out /tmp/repair.jsonl \
        --count 200
"""
from __future__ import annotations

import argparse
from pathlib import Path

from lightning_otel.tasks.spider.repair import repair_tasks
from lightning_otel.tasks.spider.rewards import bundled_data_dir, database_path
from lightning_otel.tasks.spider.splits import read_rows, write_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=Path, required=True, help="labelled tasks (JSONL with db_id, query)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = read_rows(args.tasks)
    data = bundled_data_dir()
    made = repair_tasks(rows, lambda db_id: database_path(data, db_id), args.count, args.seed)
    write_rows(made, args.out)
    print(f"{args.out}: {len(made)} repair tasks from {len(rows)} labelled ones")


if __name__ == "__main__":
    main()
