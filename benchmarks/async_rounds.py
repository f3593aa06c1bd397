"""Async rounds against synchronous ones: wall time per round with `max_staleness` 0 and 1, the same config,
one engine shared by both runs (started once, so neither run pays its start).

    .venv/bin/python -m benchmarks.async_rounds [--rounds 3] [--tasks-per-round 2] [--n 2] [--max-tokens 16]

The run is tests/test_train.py's: Spider poker_player questions, the plain-OpenAI example agent as an agent
function, a reward that varies within groups, LoRA rank 8 on the bundled SmolLM2-135M. Per round it prints
the wall time (from one round's record to the next; the first round's includes one-time warm-ups and cannot
run ahead, so the mean is over the later rounds) and the phase times from metrics.jsonl: rollouts (how long
they took, and how long the round waited for them), training, and the policy swap (draining included). Then
what hiding one phase behind the other would give where rollouts and training do not compete for the same
cores (a GPU for each, or one GPU with room for both): k=0's wall time less the shorter of the two phases.
Writes the two run folders into a temporary folder.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

from lightning_otel.serve.engine import EngineConfig, VLLMEngine, default_engine_python
from lightning_otel.serve.model import bundled_model_dir
from lightning_otel.train.config import TrainConfig
from lightning_otel.train.trainer import Trainer

REPO = Path(__file__).resolve().parent.parent
SPIDER = REPO / "lightning_otel" / "tasks" / "spider" / "data" / "dev.jsonl"
AGENT = f"{REPO / 'examples' / 'openai_sql' / 'agent.py'}:run"
REWARD = "tests.helpers.train_rewards:concise_sql"


def write_tasks(path: Path, count: int) -> Path:
    rows = [json.loads(line) for line in SPIDER.read_text().splitlines()]
    rows = [r for r in rows if r["db_id"] == "poker_player"][:count]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run(engine: VLLMEngine, folder: Path, k: int, args) -> list[dict]:
    """One run with max_staleness=k: its round records, each with `wall_seconds` (since the previous record)."""
    config = TrainConfig(tasks=str(write_tasks(folder / "tasks.jsonl", 8)), agent=AGENT, reward=REWARD,
                         task_pack="spider", n=args.n, tasks_per_round=args.tasks_per_round, rounds=args.rounds,
                         batch_size=args.tasks_per_round * args.n, micro_batch=4, max_tokens=args.max_tokens,
                         lr=1e-4, lora_rank=8, concurrency=8, seed=7, tis_cap=2.0, max_staleness=k,
                         output_dir=str(folder / f"k{k}"), report_to=[])
    times: list[float] = []
    with Trainer(config, engine=engine) as trainer:
        write = trainer.metrics.write

        def timed_write(record: dict) -> None:
            times.append(time.perf_counter())
            write(record)

        trainer.metrics.write = timed_write
        started = time.perf_counter()
        trainer.run()
    records = [json.loads(line) for line in (Path(config.output_dir) / "metrics.jsonl").read_text().splitlines()]
    for record, previous, now in zip(records, [started, *times], times):
        record["wall_seconds"] = now - previous
    return records


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tasks-per-round", type=int, default=2)
    p.add_argument("--n", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    python = default_engine_python()
    folder = Path(tempfile.mkdtemp(prefix="async-rounds-"))
    engine = VLLMEngine(EngineConfig(model_dir=bundled_model_dir(python=python), python=python,
                                     log_path=folder / "engine.log"))
    engine.start()
    results = {}
    print(f"{'k':>2} {'round':>5} {'wall s':>7} {'rollout s':>9} {'waited s':>8} {'train s':>7} {'swap s':>6} "
          f"{'behind':>12}", flush=True)
    try:
        for k in (0, 1):
            results[k] = run(engine, folder, k, args)
            for r in results[k]:  # as each run ends: a run cut short still shows the first
                print(f"{k:>2} {r['round']:>5} {r['wall_seconds']:7.1f} {r['rollout_seconds']:9.1f} "
                      f"{r['rollout_wait_seconds']:8.1f} {r['train_seconds'] or 0:7.1f} "
                      f"{r['swap_seconds'] or 0:6.1f} {json.dumps(r.get('staleness', {})):>12}", flush=True)
    finally:
        engine.stop()
    summary = {}
    for k, records in results.items():
        later = records[1:] or records
        mean = {key: sum(r[key] or 0 for r in later) / len(later)
                for key in ("wall_seconds", "rollout_seconds", "rollout_wait_seconds", "train_seconds", "swap_seconds")}
        summary[k] = mean
        print(f"k={k}: mean over rounds 2..: wall {mean['wall_seconds']:.1f} s, "
              f"rollouts {mean['rollout_seconds']:.1f} s "
              f"(waited {mean['rollout_wait_seconds']:.1f} s), train {mean['train_seconds']:.1f} s, "
              f"swap {mean['swap_seconds']:.1f} s")
    sync = summary[0]
    # Hidden behind the other: the shorter of the two phases (rollout + train -> max(rollout, train)).
    overlap = sync["wall_seconds"] - min(sync["rollout_seconds"], sync["train_seconds"])
    print(f"k=1 / k=0 wall per round: {summary[1]['wall_seconds'] / sync['wall_seconds']:.2f}; with rollouts and "
          f"training on separate hardware, from k=0's phases: {overlap:.1f} s against "
          f"{sync['wall_seconds']:.1f} s ({overlap / sync['wall_seconds']:.2f})")
    return summary


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
