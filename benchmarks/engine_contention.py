"""Does the CPU engine suffer when another process computes beside it, and does the wait policy of its OpenMP
threads change that? The same requests on an engine whose threads spin while they wait (OpenMP's default,
OMP_WAIT_POLICY=ACTIVE: the peer) and on one whose threads sleep (PASSIVE: how lightning_otel.serve.engine
starts it on a machine with few cores, engine_cpu_env), each timed alone and then beside one busy process (a
single-threaded Python loop, as an asynchronous round's learner, an agent or a test suite's other worker would
be). One engine at a time, the two alternating.

    .venv/bin/python -m benchmarks.engine_contention [--repeats 2] [--concurrency 16] [--model bundled]

The requests are engine_batching.py's: the learning-loop check's pool of 4 bundled dev questions x 4 samples
as the one-call SQL agent asks them, max_tokens 32, temperature 0.7. Prints, per engine and run, the seconds
alone and beside the busy process, then each policy's seconds summed over its runs and the passive engine's
speed against the active one's. Writes nothing outside a temporary folder for the engine logs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from benchmarks.engine_batching import comparison_parser, engine_started_with, model_and_requests, timed

POLICIES = ("ACTIVE", "PASSIVE")
BUSY = "while True:\n    sum(i * i for i in range(10_000))\n"


def alone_and_beside_busy(measure: Callable[[], float]) -> dict[str, float]:
    """Seconds `measure()` takes alone, then beside a busy process."""
    alone = measure()
    busy = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        time.sleep(1)
        beside = measure()
    finally:
        busy.kill()
        busy.wait()
    return {"alone": alone, "beside a busy process": beside}


def alternated(policies: tuple[str, str], repeats: int, run: Callable[[str, int], dict[str, float]]) -> dict:
    """`run(policy, repeat)` for each repeat and policy, the two alternating; prints each run's seconds, then the
    summary (each policy's seconds summed over its runs, and the second's speed against the first's)."""
    totals = {policy: {"alone": 0.0, "beside a busy process": 0.0} for policy in policies}
    for repeat in range(repeats):
        for policy in policies:
            seconds = run(policy, repeat)
            for key, value in seconds.items():
                totals[policy][key] += value
            print(f"run {repeat + 1} {policy}: " + ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items()),
                  flush=True)
    first, second = policies
    summary = {"cpus": len(os.sched_getaffinity(0)), "seconds": totals,
               f"{second.lower()}_speedup": {key: totals[first][key] / totals[second][key] for key in totals[first]}}
    print(json.dumps(summary))
    return summary


def run_once(model_dir: Path, python: str, policy: str, bodies: list[dict], concurrency: int,
             log_path: Path) -> dict[str, float]:
    """One engine started with OMP_WAIT_POLICY=policy: seconds for the requests alone, then beside a busy process."""
    engine = engine_started_with(model_dir, python, log_path, OMP_WAIT_POLICY=policy)  # a set one wins
    try:
        timed(engine, bodies[:2], 2)  # warm-up, not counted
        return alone_and_beside_busy(lambda: timed(engine, bodies, concurrency)[0])
    finally:
        engine.stop()


def main(argv: list[str] | None = None) -> dict:
    args = comparison_parser(__doc__).parse_args(argv)
    python, model_dir, bodies = model_and_requests(args)
    with tempfile.TemporaryDirectory() as folder:
        return alternated(POLICIES, args.repeats, lambda policy, repeat: run_once(
            model_dir, python, policy, bodies, args.concurrency, Path(folder) / f"engine-{repeat}-{policy}.log"))


if __name__ == "__main__":
    main()
