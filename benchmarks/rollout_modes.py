"""Rollouts per second: the subprocess mode (a process under opentelemetry-instrument per rollout) against the
in-process mode (the agent as a function, every rollout a call in one worker process), side by side.

Same agent (examples/openai_sql, as `python agent.py ...` and as `agent.py:run`), same engine, gateway and
collector, same tasks, temperature 0 so both modes do the same model work; the modes alternate over rounds
(the order flips each round) so that a change in the machine's load hits both.

    .venv/bin/python benchmarks/rollout_modes.py --rollouts 16 --rounds 2 --max-tokens 16
    .venv/bin/python benchmarks/rollout_modes.py --engine-url http://127.0.0.1:8000   # a vLLM already running

Modes: subprocess; in-process with a worker started by each run_rollouts call (its start counted); kept, one
worker for every call, started before the rounds, as the trainer keeps one for a whole run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "openai_sql" / "agent.py"
MODES = {
    "subprocess": f"{sys.executable} {EXAMPLE} --question {{question}} --db {{db_path}} --model {{model}}",
    "in-process": f"{EXAMPLE}:run",  # a worker started by each run_rollouts call, counted in its time
    "kept": f"{EXAMPLE}:run",  # one worker for every call, as the trainer keeps it (started before the clock)
}


def start_engine(url: str | None):
    from lightning_otel.serve.engine import EngineConfig, VLLMEngine, default_engine_python
    from lightning_otel.serve.model import bundled_model_dir

    python = default_engine_python(ROOT)
    engine = VLLMEngine(EngineConfig(model_dir=bundled_model_dir(python=python), python=python))
    if url:
        engine.attach(url)
    else:
        engine.start()
    return engine


def write_tasks(folder: Path, count: int) -> Path:
    from lightning_otel.tasks.spider.rewards import bundled_data_dir

    rows = [json.loads(line) for line in (bundled_data_dir() / "dev.jsonl").read_text().splitlines()][:count]
    path = folder / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def one_run(mode: str, tasks: Path, n: int, db: Path, engine, args, worker=None) -> dict:
    from lightning_otel.rollouts.runner import RolloutConfig, run_rollouts

    config = RolloutConfig(tasks=tasks, agent=MODES[mode], n=n, concurrency=args.concurrency, db=db,
                           reward="spider_exec", rollout_timeout_s=600, temperature=0.0, max_tokens=args.max_tokens)
    started = time.perf_counter()
    summary = run_rollouts(config, engine=engine, worker=worker if mode == "kept" else None)
    seconds = time.perf_counter() - started
    durations = [(r.ended_ns - r.started_ns) / 1e9 for r in summary.results]
    return {"mode": mode, "rollouts": len(summary.results), "ok": summary.count("ok"), "seconds": seconds,
            "per_s": len(summary.results) / seconds, "rollout_s": statistics.median(durations),
            "reward": statistics.mean(summary.rewarded) if summary.rewarded else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=16, help="rollouts per mode per round")
    parser.add_argument("--tasks", type=int, default=8, help="distinct tasks (rollouts / tasks samples each)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--engine-url", help="attach to a running vLLM server instead of starting one")
    args = parser.parse_args()
    if args.rollouts % args.tasks:
        parser.error("--rollouts must be a multiple of --tasks")

    from lightning_otel.span_store.collector import Collector, CollectorConfig

    folder = Path(tempfile.mkdtemp(prefix="rollout-modes-"))
    db = folder / "traces.duckdb"
    collector = Collector(CollectorConfig(db=db, port=0))  # one store for both modes; run_rollouts finds it
    collector.start()
    engine = start_engine(args.engine_url)
    tasks = write_tasks(folder, args.tasks)
    from lightning_otel.capture.agent_fn import parse_agent_function
    from lightning_otel.rollouts.runner import start_agent_worker

    worker = start_agent_worker(parse_agent_function(MODES["kept"]), collector.url)
    rows = []
    try:
        for round_ in range(args.rounds):
            order = list(MODES) if round_ % 2 == 0 else list(MODES)[::-1]
            for mode in order:
                row = {"round": round_ + 1, **one_run(mode, tasks, args.rollouts // args.tasks, db, engine, args,
                                                      worker)}
                rows.append(row)
                print(f"round {row['round']} {mode:>10}: {row['rollouts']} rollouts ({row['ok']} ok) in "
                      f"{row['seconds']:.1f} s = {row['per_s']:.2f}/s, median rollout {row['rollout_s']:.2f} s, "
                      f"mean reward {row['reward']:.3f}", flush=True)
    finally:
        worker.close()
        if not args.engine_url:
            engine.stop()
        collector.close()
    report(rows, args)


def report(rows: list[dict], args) -> None:
    print(f"\nconcurrency {args.concurrency}, max_tokens {args.max_tokens}, {args.rollouts} rollouts per mode "
          f"per round over {args.tasks} tasks, {args.rounds} rounds")
    print(f"| {'mode':<10} | rollouts | seconds | rollouts/s | median rollout s |")
    print("|------------|---------:|--------:|-----------:|-----------------:|")
    totals = {}
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        count, seconds = sum(r["rollouts"] for r in mine), sum(r["seconds"] for r in mine)
        totals[mode] = count / seconds
        median = statistics.median(r["rollout_s"] for r in mine)
        print(f"| {mode:<10} | {count:>8} | {seconds:>7.1f} | {totals[mode]:>10.2f} | {median:>16.2f} |")
    for mode in ("in-process", "kept"):
        print(f"{mode} / subprocess: {totals[mode] / totals['subprocess']:.2f}x rollouts per second")


if __name__ == "__main__":
    main()
