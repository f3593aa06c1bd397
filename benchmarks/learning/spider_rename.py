"""Renamed copies of the training databases, and labelled questions asked again on them with their gold query
rewritten to the new names (lightning_otel.tasks.spider.renaming says why and how).

    .venv/bin/python -m benchmarks.learning.spider_rename --tasks /tmp/learning/sft.jsonl --out /tmp/renamed --count 200

Writes a Spider-layout data folder --out (every bundled database, plus one renamed copy `<db_id>_renamed` of each
database the tasks use) and the renamed questions as --out/renamed.jsonl. Train with the folder as the run's
`data_dir`, so the agent and the reward open the copies.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from lightning_otel.tasks.spider.renaming import renamed_tasks
from lightning_otel.tasks.spider.rewards import bundled_data_dir
from lightning_otel.tasks.spider.splits import read_rows, write_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=Path, required=True, help="labelled tasks (JSONL with db_id, query)")
    parser.add_argument("--out", type=Path, required=True, help="the data folder to write (Spider layout)")
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = read_rows(args.tasks)
    made = renamed_tasks(rows, bundled_data_dir(), args.out, args.count, args.seed)
    write_rows(made, args.out / "renamed.jsonl")
    print(f"{args.out / 'renamed.jsonl'}: {len(made)} questions on renamed databases, from {len(rows)} labelled "
          f"ones; give {args.out} as the run's data_dir")


if __name__ == "__main__":
    main()
