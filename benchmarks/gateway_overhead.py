"""The gateway against calling the vLLM server directly with the same requests, in one run:

  direct    POST /v1/chat/completions to vLLM (asking for token ids and logprobs, as the gateway does)
  gateway   the same requests through the gateway, which also records a lightning.generate span per choice

Reports sequential latency per call and throughput with K concurrent clients, plus the cost of the token
record itself (building and ending the span with its id arrays), measured in-process. With --stream, also
streamed requests (sequential, answers of --stream-tokens tokens): the time to the first text chunk and to
the end of the stream, directly and through the gateway (which streams as vLLM samples).

With --clients 8,64,256, a load sweep instead: at each number of concurrent clients, the same requests sent
(1) to vLLM directly, (2) through the gateway as chat completions, (3) through the gateway as Responses
(`POST /v1/responses`), and (4) streamed through the gateway as chat completions, one path after the other
at that load; throughput for each, and for the streamed path the median time to the first text chunk
against the median time to the end of the stream.

    .venv/bin/python benchmarks/gateway_overhead.py --requests 64 --concurrency 8 [--stream]
    .venv/bin/python benchmarks/gateway_overhead.py --clients 8,64,256 --per-client 2
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def responses_body(i: int) -> dict:
    return {"model": "gpt-4o", "max_output_tokens": 16, "temperature": 0.0,
            "input": f"Write a SQL query number {i} over table singer."}


def body(i: int, direct: bool) -> dict:
    payload = {"model": "policy" if direct else "gpt-4o", "max_tokens": 16, "temperature": 0.0, "seed": i,
               "messages": [{"role": "user", "content": f"Write a SQL query number {i} over table singer."}]}
    if direct:
        payload.update(return_token_ids=True, logprobs=True)
    return payload


def throughput(url: str, n: int, concurrency: int, direct: bool, send=None) -> float:
    """Requests per second of n requests sent by `concurrency` clients; `send(i)` sends one (default: a chat
    completion to url)."""
    counter = iter(range(n))
    lock = threading.Lock()
    send = send or (lambda i: post(url, body(i, direct)))

    def worker() -> None:
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            send(i)

    started = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return n / (time.perf_counter() - started)


def latency(url: str, n: int, direct: bool) -> float:
    times = []
    for i in range(n):
        started = time.perf_counter()
        post(url, body(i, direct))
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def stream_request(url: str, i: int, direct: bool, tokens: int) -> tuple[float, float]:
    """ms to the first chunk with text and to the end of the stream, for one streamed request."""
    payload = {**body(i, direct), "stream": True, "max_tokens": tokens, "ignore_eos": True}
    request = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    started, seen = time.perf_counter(), None
    with urllib.request.urlopen(request, timeout=300) as response:
        for line in response:
            if seen is None and line.startswith(b"data: {"):
                choices = json.loads(line[len(b"data: "):]).get("choices") or [{}]
                if (choices[0].get("delta") or {}).get("content"):
                    seen = time.perf_counter()
    return (seen - started) * 1000, (time.perf_counter() - started) * 1000


def stream_times(urls: dict[str, str], n: int, tokens: int) -> dict[str, tuple[float, float]]:
    """Per path, the median ms to the first text chunk and to the end, over n requests sent in turn to each
    path (so both see the same machine)."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in urls}
    for i in range(n):
        for name, url in urls.items():
            times[name].append(stream_request(url, i, name == "direct", tokens))
    return {name: (statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts))
            for name, ts in times.items()}


def load_sweep(direct_url: str, gateway_url: str, clients: list[int], per_client: int,
               tokens: int) -> list[dict]:
    """One row per load: requests/s on each path and, streamed through the gateway, the median ms to the
    first text chunk and to the end of the stream, all with `k` clients sending `k * per_client` requests."""
    responses_url = gateway_url.replace("/chat/completions", "/responses")
    rows = []
    for k in clients:
        n = k * per_client
        streamed: list[tuple[float, float]] = []
        lock = threading.Lock()

        def send_streamed(i: int) -> None:
            times = stream_request(gateway_url, i, False, tokens)
            with lock:
                streamed.append(times)

        row = {"clients": k, "requests": n,
               "direct": throughput(direct_url, n, k, True),
               "gateway_chat": throughput(gateway_url, n, k, False),
               "gateway_responses": throughput(responses_url, n, k, False,
                                               send=lambda i: post(responses_url, responses_body(i))),
               "gateway_stream": throughput(gateway_url, n, k, False, send=send_streamed)}
        row["stream_first_ms"] = statistics.median(t[0] for t in streamed)
        row["stream_whole_ms"] = statistics.median(t[1] for t in streamed)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def print_sweep(rows: list[dict], tokens: int) -> None:
    print(f"\n| clients | requests/s: direct | gateway, chat | gateway, Responses | Responses / chat "
          f"| streamed ({tokens} tokens): first chunk / whole (ms) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        chat = f"{r['gateway_chat']:.1f} ({r['gateway_chat'] / r['direct']:.2f}x)"
        print(f"| {r['clients']} | {r['direct']:.1f} | {chat} "
              f"| {r['gateway_responses']:.1f} | {r['gateway_responses'] / r['gateway_chat']:.2f} "
              f"| {r['stream_first_ms']:.0f} / {r['stream_whole_ms']:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stream", action="store_true", help="also time streamed requests (first chunk, whole)")
    parser.add_argument("--stream-tokens", type=int, default=64)
    parser.add_argument("--clients", default="", help="a load sweep at these numbers of clients, e.g. 8,64,256")
    parser.add_argument("--per-client", type=int, default=2, help="requests per client in the load sweep")
    args = parser.parse_args()

    from lightning_otel.serve.engine import EngineConfig, VLLMEngine, default_engine_python
    from lightning_otel.serve.gateway import Gateway, GatewayConfig
    from lightning_otel.serve.model import bundled_model_dir
    from lightning_otel.span_store.collector import Collector, CollectorConfig

    python = default_engine_python(Path(__file__).resolve().parent.parent)
    clients = [int(k) for k in args.clients.split(",") if k.strip()]
    # --max-num-seqs: vLLM batches at most this many sequences; the sweep's largest load must fit in one batch.
    engine = VLLMEngine(EngineConfig(model_dir=bundled_model_dir(python), python=python,
                                     extra_args=["--max-num-seqs", str(max([256, *clients]))]))
    engine.start()
    collector = Collector(CollectorConfig(db=Path(tempfile.mkdtemp()) / "bench.duckdb", port=0))
    collector.start()
    gateway = Gateway(engine, GatewayConfig(collector_url=collector.url))
    gateway.start()
    try:
        direct_url, gateway_url = f"{engine.url}/v1/chat/completions", f"{gateway.url}/v1/chat/completions"
        post(direct_url, body(0, True))
        post(gateway_url, body(0, False))
        if clients:
            print_sweep(load_sweep(direct_url, gateway_url, clients, args.per_client, args.stream_tokens),
                        args.stream_tokens)
            return
        rows = {"direct": {"lat": [], "tput": []}, "gateway": {"lat": [], "tput": []}}
        for _ in range(args.rounds):
            for name, url in (("direct", direct_url), ("gateway", gateway_url)):
                rows[name]["lat"].append(latency(url, 16, name == "direct"))
                rows[name]["tput"].append(throughput(url, args.requests, args.concurrency, name == "direct"))
        # The token record alone: one span with ~200 prompt and 64 completion ids and logprobs.
        n = 2000
        started = time.perf_counter()
        for i in range(n):
            gateway._record({}, "ro-bench", "gpt-4o", "id", 0, list(range(200)), list(range(64)),  # noqa: SLF001
                            [-0.5] * 64, 0, 1)
        record_us = (time.perf_counter() - started) / n * 1e6
        streamed = stream_times({"direct": direct_url, "gateway": gateway_url}, 16, args.stream_tokens) \
            if args.stream else {}
    finally:
        gateway.close()
        collector.close()
        engine.stop()
    lat = {k: statistics.median(v["lat"]) for k, v in rows.items()}
    tput = {k: statistics.median(v["tput"]) for k, v in rows.items()}
    print(json.dumps({"latency_ms": lat, "requests_per_s": tput, "record_us": record_us,
                      "stream_first_and_whole_ms": streamed}))
    print("\n| path | median latency, sequential (ms) | requests/s with "
          f"{args.concurrency} clients | ratio to direct |")
    print("| --- | --- | --- | --- |")
    for name in ("direct", "gateway"):
        print(f"| {name} | {lat[name]:.1f} | {tput[name]:.1f} | {tput[name] / tput['direct']:.3f} |")
    print(f"\ntoken record (span with id arrays): {record_us:.0f} µs per call")
    if streamed:
        print(f"\n| streamed, {args.stream_tokens} tokens | median first text chunk (ms) | median whole stream (ms) |")
        print("| --- | --- | --- |")
        for name, (first, whole) in streamed.items():
            print(f"| {name} | {first:.0f} | {whole:.0f} |")


if __name__ == "__main__":
    sys.exit(main())
