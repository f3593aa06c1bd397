"""Capture overhead per LLM call in instructions, not seconds: each setup of capture_overhead.py runs
N1 and N2 calls in its own process under valgrind's callgrind, and the per-call cost is the difference of
the two totals over N2 - N1 (start-up cancels out). Instruction counts repeat run to run whatever else the
machine does, which wall time on this 2-core machine does not. The fast server and the collector run
outside valgrind.

    .venv/bin/python -m benchmarks.capture_instructions --calls 20 60
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import capture_overhead

REPO = Path(__file__).resolve().parent.parent


def worker(setup: str, server_url: str, collector_url: str, calls: int) -> None:
    import openai
    from opentelemetry.instrumentation.openai import OpenAIInstrumentor
    make = capture_overhead.setups(collector_url)[setup]
    client = openai.OpenAI(base_url=server_url, api_key="k")
    provider = make() if make else None
    if provider:
        OpenAIInstrumentor().instrument(tracer_provider=provider)
    capture_overhead.calls(client, calls, provider.force_flush if provider else None)
    if provider:
        provider.shutdown()


def instructions(setup: str, server_url: str, collector_url: str, calls: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        result = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/out", sys.executable, "-m", __spec__.name,
             "--worker", setup, "--server", server_url, "--collector", collector_url, "--calls", str(calls), "0"],
            capture_output=True, text=True, timeout=1800, cwd=REPO)  # cwd: where `benchmarks` imports from
    match = re.search(r"Collected : (\d+)", result.stderr)
    if result.returncode != 0 or match is None:
        raise RuntimeError(f"callgrind run failed for {setup}: {result.stderr[-1500:]}")
    return int(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, nargs=2, default=[20, 60], metavar=("N1", "N2"))
    parser.add_argument("--worker")
    parser.add_argument("--server")
    parser.add_argument("--collector")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.server, args.collector, args.calls[0])
        return

    from lightning_otel.span_store.collector import Collector, CollectorConfig
    server = capture_overhead.start_fast_server()
    server_url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    collector = Collector(CollectorConfig(db=Path(tempfile.mkdtemp()) / "bench.duckdb", port=0))
    collector.start()
    n1, n2 = args.calls
    per_call = {}
    for setup in ("none", "traceloop", "ours", "ours+redact"):
        low, high = (instructions(setup, server_url, collector.url, n) for n in (n1, n2))
        per_call[setup] = (high - low) / (n2 - n1)
        print(json.dumps({"setup": setup, "instructions_per_call": round(per_call[setup])}), flush=True)
    collector.close()
    server.shutdown()
    base = per_call["traceloop"]
    print("\n| setup | instructions per call | over none | over Traceloop alone |")
    print("| --- | --- | --- | --- |")
    for setup, count in per_call.items():
        print(f"| {setup} | {count:,.0f} | {count - per_call['none']:+,.0f} | {(count / base - 1) * 100:+.2f}% |")


if __name__ == "__main__":
    sys.exit(main())
