"""Client-side capture overhead per LLM call, side by side in one process:

  none       the OpenAI SDK alone
  traceloop  Traceloop's OpenAI instrumentation + the OTel SDK exporting OTLP/HTTP to the collector
  ours       the same through lightning-otel's distro pieces (baggage processor, lightning exporter),
             i.e. what `opentelemetry-instrument` sets up with this package installed
  ours+redact  ours with one redaction pattern (LIGHTNING_OTEL_REDACT) applied to every string attribute

against a fast local OpenAI-compatible server (canned answers, so the model's time does not hide the
overhead). Every round runs each setup once, in a shuffled order, so machine noise spreads evenly; the
overhead is the median over rounds of each round's ratio to Traceloop alone (paired, so a slow round
slows both sides).

    .venv/bin/python benchmarks/capture_overhead.py --calls 300 --rounds 5
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ANSWER = json.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "gpt-4o",
    "choices": [{"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "SELECT count(*) FROM singer WHERE age > 30"}}],
    "usage": {"prompt_tokens": 60, "completion_tokens": 12, "total_tokens": 72}}).encode()


class FastServer(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes; with Nagle on, keep-alive clients wait ~40 ms for the
    # delayed ACK before the body arrives.
    disable_nagle_algorithm = True

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(ANSWER)))
        self.end_headers()
        self.wfile.write(ANSWER)


def calls(client, n: int, flush=None) -> tuple[float, float]:
    """Wall seconds and process CPU seconds per call; CPU includes the span export thread's work (the
    provider is flushed before the clock stops), so it counts all of the capture and little of the noise."""
    messages = [{"role": "system", "content": "You write one SQLite query."},
                {"role": "user", "content": "How many singers are older than 30? Table singer(name, age)."}]
    started, cpu = time.perf_counter(), time.process_time()
    for _ in range(n):
        client.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=64)
    if flush:
        flush()
    return (time.perf_counter() - started) / n, (time.process_time() - cpu) / n


def setups(collector_url: str) -> dict:
    """Setup name -> a function making its TracerProvider (None: no instrumentation)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from lightning_otel.capture import distro

    os.environ["TRACELOOP_TRACE_CONTENT"] = "true"

    def traceloop_provider() -> TracerProvider:
        provider = TracerProvider(resource=Resource.create({"service.name": "bench"}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{collector_url}/v1/traces")))
        return provider

    def our_provider(redact: str = "") -> TracerProvider:
        os.environ[distro.REDACT_ENV] = redact
        provider = TracerProvider(resource=Resource.create({"service.name": "bench"}))
        provider.add_span_processor(distro.BaggageToAttributes())
        provider.add_span_processor(
            distro._export_processor(distro.LightningSpanExporter(endpoint=collector_url)))  # noqa: SLF001
        return provider

    return {"none": None, "traceloop": traceloop_provider, "ours": our_provider,
            "ours+redact": lambda: our_provider(r"sk-[A-Za-z0-9]+")}


def start_fast_server() -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FastServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    import openai
    from opentelemetry.instrumentation.openai import OpenAIInstrumentor

    from lightning_otel.span_store.collector import Collector, CollectorConfig

    server = start_fast_server()
    collector = Collector(CollectorConfig(db=Path(tempfile.mkdtemp()) / "bench.duckdb", port=0))
    collector.start()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="k")
    setups_by_name = setups(collector.url)
    results: dict[str, list[float]] = {name: [] for name in setups_by_name}
    cpu: dict[str, list[float]] = {name: [] for name in setups_by_name}
    calls(client, 30)  # warm up connections and imports
    import random
    order = list(setups_by_name.items())
    for _ in range(args.rounds):
        random.shuffle(order)
        for name, make in order:
            provider = make() if make else None
            instrumentor = OpenAIInstrumentor()
            if provider:
                instrumentor.instrument(tracer_provider=provider)
            wall, used = calls(client, args.calls, provider.force_flush if provider else None)
            results[name].append(wall)
            cpu[name].append(used)
            if provider:
                instrumentor.uninstrument()
                provider.shutdown()
    collector.close()
    server.shutdown()
    median = {name: statistics.median(values) * 1e6 for name, values in results.items()}
    paired = {name: statistics.median(v / t for v, t in zip(values, results["traceloop"]))
              for name, values in results.items()}
    cpu_median = {name: statistics.median(values) * 1e6 for name, values in cpu.items()}
    cpu_paired = {name: statistics.median(v / t for v, t in zip(values, cpu["traceloop"]))
                  for name, values in cpu.items()}
    print(json.dumps({"wall_us": {k: round(v, 1) for k, v in median.items()},
                      "cpu_us": {k: round(v, 1) for k, v in cpu_median.items()}}))
    print("\n| setup | wall µs/call | over traceloop (wall, median paired ratio) | CPU µs/call "
          "| over traceloop (CPU) |")
    print("| --- | --- | --- | --- | --- |")
    for name, us in median.items():
        print(f"| {name} | {us:.0f} | {(paired[name] - 1) * 100:+.1f}% | {cpu_median[name]:.0f} | "
              f"{(cpu_paired[name] - 1) * 100:+.1f}% |")


if __name__ == "__main__":
    sys.exit(main())
