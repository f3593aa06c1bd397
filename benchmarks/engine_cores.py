"""Does the CPU engine gain from the core vLLM keeps back for its scheduler? The same requests on an engine
started with vLLM's default (one core kept: VLLM_CPU_NUM_OF_RESERVED_CPU=1) and on one started as the engine
starts on a machine with few cores (none kept: 0; lightning_otel.serve.engine.engine_cpu_env), one engine at a time,
the two alternating.

    .venv/bin/python -m benchmarks.engine_cores [--repeats 2] [--concurrency 16] [--model bundled]

The requests are engine_batching.py's: learning_check.py's pool of 4 bundled dev questions x 4 samples as the
one-call SQL agent asks them, max_tokens 32, temperature 0.7. Each engine is started, warmed up with two
requests, timed, and stopped. Prints seconds, generated tokens and tokens per second per run, the reserved core
count vLLM's log reports for each engine, and none-kept's tokens per second against one-kept's. Writes nothing
outside a temporary folder for the engine logs.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

from benchmarks.engine_batching import comparison_parser, engine_started_with, model_and_requests, timed

SETTINGS = {"one kept (vLLM default)": "1", "none kept": "0"}


def run_once(model_dir: Path, python: str, reserved: str, bodies: list[dict], concurrency: int,
             log_path: Path) -> tuple[float, int, list[str]]:
    """One engine with VLLM_CPU_NUM_OF_RESERVED_CPU=reserved: (seconds, tokens, reserved counts in its log)."""
    engine = engine_started_with(model_dir, python, log_path, VLLM_CPU_NUM_OF_RESERVED_CPU=reserved)
    try:
        timed(engine, bodies[:2], 2)  # warm-up, not counted
        seconds, tokens = timed(engine, bodies, concurrency)
    finally:
        engine.stop()
    return seconds, tokens, sorted(set(re.findall(r"reserve_cpu_num=(\d+)", log_path.read_text())))


def main(argv: list[str] | None = None) -> dict:
    args = comparison_parser(__doc__).parse_args(argv)
    python, model_dir, bodies = model_and_requests(args)
    totals = {name: [0.0, 0] for name in SETTINGS}
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(args.repeats):
            for name, reserved in SETTINGS.items():
                seconds, tokens, logged = run_once(model_dir, python, reserved, bodies, args.concurrency,
                                                   Path(folder) / f"engine-{repeat}-{reserved}.log")
                totals[name][0] += seconds
                totals[name][1] += tokens
                print(f"run {repeat + 1} {name} (vLLM log: reserve_cpu_num={','.join(logged)}): {len(bodies)} "
                      f"requests in {seconds:.1f} s, {tokens} tokens, {tokens / seconds:.1f} tokens/s", flush=True)
    rates = {name: tokens / seconds for name, (seconds, tokens) in totals.items()}
    first = next(iter(rates.values()))
    summary = {name: {"tokens_per_s": rate, "against_one_kept": rate / first} for name, rate in rates.items()}
    print(json.dumps({"cpus": len(os.sched_getaffinity(0)), **summary}))
    return summary


if __name__ == "__main__":
    main()
