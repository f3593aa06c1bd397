"""Ingest latency while other clients try to starve it (collector hardening issue, item 4).

    .venv/bin/python -m benchmarks.ingest_under_attack [--seconds 10] [--rounds 3] [--spans 100] [--rate 10]

A real `lightning-otel collect` process with a token per role (default limits). One agent-like client sends
`--spans` fresh spans per request, `--rate` requests a second, on one keep-alive connection, and times each
request from send to its 200 (sent after the commit). Phases, each `--seconds` long, `--rounds` times in turn:
  idle        nothing else
  tricklers   40 clients without a token announce a 10 MB body and send it a byte every 0.1 s
  slow        40 clients run a query of 10^10 rows (stopped by --query-timeout-s), again as soon as answered
  unread      40 clients ask for a ~20 MB answer and never read it
  all         the three attacks at once (120 clients)
The attackers run in a process of their own, so their threads do not take the measuring client's GIL. Every
acknowledged span is counted in the file at the end. Goal: p99 under attack within 2x of idle p99.
"""
from __future__ import annotations

import argparse
import http.client
import json
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks import ingest_throughput, synthetic
from lightning_otel.span_store import client, discovery

TOKENS = {"ingest": "bench-ingest", "query": "bench-query", "admin": "bench-admin"}
SLOW_SQL = b"SELECT sum(a.range * b.range) FROM range(100000) a, range(100000) b"
BIG_SQL = b"SELECT i, repeat('x', 1000) AS s FROM range(20000) t(i)"
PHASES = {"idle": [], "tricklers": ["trickle"], "slow": ["slow"], "unread": ["unread"],
          "all": ["trickle", "slow", "unread"]}


def request_bytes(path: str, body: bytes, headers: dict[str, str], declared: int | None = None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: bench", f"Content-Length: {len(body) if declared is None else declared}",
             *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def read_to_end(sock: socket.socket) -> None:
    try:
        while sock.recv(1 << 16):
            pass
    except OSError:
        pass


def attack_once(kind: str, sock: socket.socket, stop: threading.Event) -> None:
    query = {"Content-Type": "text/plain", "Connection": "close", "Authorization": f"Bearer {TOKENS['query']}"}
    if kind == "trickle":
        sock.sendall(request_bytes("/v1/traces", b"", {"Content-Type": "application/x-protobuf"}, 10_000_000))
        while not stop.is_set() and not select.select([sock], [], [], 0.1)[0]:
            sock.send(b"\x00")
        read_to_end(sock)
    elif kind == "slow":
        sock.sendall(request_bytes("/v1/query", SLOW_SQL, query))
        read_to_end(sock)
    else:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(request_bytes("/v1/query", BIG_SQL, query))
        while not stop.is_set():
            if select.select([sock], [], [], 0.1)[0]:
                if not sock.recv(64).startswith(b"HTTP/1.1 200"):
                    return read_to_end(sock)
                stop.wait()  # the answer started: never read it


def run_attackers(host: str, port: int, kinds: list[str], per_kind: int = 40) -> None:
    """Attack until stdin closes: each attacker starts again as soon as it is refused or cut."""
    stop = threading.Event()

    def attacker(kind: str) -> None:
        while not stop.is_set():
            try:
                with socket.create_connection((host, port), timeout=60) as sock:
                    attack_once(kind, sock, stop)
            except OSError:
                pass
            stop.wait(0.05)

    threads = [threading.Thread(target=attacker, args=(kind,), daemon=True) for kind in kinds for _ in range(per_kind)]
    for thread in threads:
        thread.start()
    sys.stdin.read()
    stop.set()


def measure(host: str, port: int, templates: list[synthetic.FreshIds], seconds: float, rate: float) -> list[float]:
    conn = http.client.HTTPConnection(host, port, timeout=60)
    headers = {"Content-Type": "application/x-protobuf", "Authorization": f"Bearer {TOKENS['ingest']}"}
    latencies, n = [], 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        body = templates[n % len(templates)].render()
        started = time.monotonic()
        conn.request("POST", "/v1/traces", body, headers)
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"ingest got {response.status}: {response.read()[:200]!r}")
        response.read()
        latencies.append(time.monotonic() - started)
        n += 1
        time.sleep(max(0.0, started + 1 / rate - time.monotonic()))
    conn.close()
    return latencies


def run_phase(info: discovery.CollectorInfo, phase: str, templates: list[synthetic.FreshIds],
              args: argparse.Namespace) -> list[float]:
    if not PHASES[phase]:
        return measure(info.host, info.port, templates, args.seconds, args.rate)
    attackers = subprocess.Popen([sys.executable, "-m", "benchmarks.ingest_under_attack", "--attacker",
                                  f"{info.host}:{info.port}:{'+'.join(PHASES[phase])}"], stdin=subprocess.PIPE)
    time.sleep(3)  # every attacker in place
    try:
        return measure(info.host, info.port, templates, args.seconds, args.rate)
    finally:
        attackers.stdin.close()
        attackers.wait(timeout=120)
        # Queries whose clients left run on until the query timeout: let them end before the next phase.
        time.sleep(args.query_timeout_s + 1)


def summary(latencies: list[float]) -> dict[str, float]:
    ms = np.array(latencies) * 1000
    return {"requests": len(ms), "p50_ms": round(float(np.percentile(ms, 50)), 1),
            "p99_ms": round(float(np.percentile(ms, 99)), 1), "max_ms": round(float(ms.max()), 1)}


def start_collector(db: Path, query_timeout_s: float, extra: list[str]) -> tuple[subprocess.Popen,
                                                                                  discovery.CollectorInfo]:
    return ingest_throughput.start_collector(
        db, ["-m", "lightning_otel.cli"], ("--ingest-token", TOKENS["ingest"], "--query-token", TOKENS["query"],
                                           "--admin-token", TOKENS["admin"], "--query-timeout-s", str(query_timeout_s),
                                           *extra))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    parser.add_argument("--spans", type=int, default=100, help="spans per ingest request")
    parser.add_argument("--rate", type=float, default=10.0, help="ingest requests per second")
    parser.add_argument("--rounds", type=int, default=3, help="times every phase runs, interleaved (the machine's "
                        "other load then weighs on every phase alike)")
    parser.add_argument("--query-timeout-s", type=float, default=5.0, help="the collector's query timeout")
    parser.add_argument("--collect-arg", action="append", default=[], metavar="ARG",
                        help="passed to `lightning-otel collect` (repeat it: --collect-arg=--max-queries-per-token=1)")
    parser.add_argument("--phases", default=",".join(PHASES), help="which phases, comma-separated")
    parser.add_argument("--attacker", help=argparse.SUPPRESS)  # host:port:kinds, run by the benchmark itself
    args = parser.parse_args()
    if args.attacker:
        host, port, kinds = args.attacker.split(":")
        return run_attackers(host, int(port), kinds.split("+"))

    templates = [synthetic.FreshIds(body) for body in synthetic.make_bodies(4, args.spans)]
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "attack.duckdb"
        proc, info = start_collector(db, args.query_timeout_s, args.collect_arg)
        latencies: dict[str, list[float]] = {phase: [] for phase in args.phases.split(",")}
        try:
            for _ in range(args.rounds):
                for phase in latencies:
                    latencies[phase] += run_phase(info, phase, templates, args)
                    print(json.dumps({"phase": phase, **summary(latencies[phase])}), flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        acknowledged = sum(len(values) for values in latencies.values()) * args.spans
        stored = client.query("SELECT count(*) AS n FROM spans", db)["n"][0]
    results = {phase: summary(values) for phase, values in latencies.items()}
    idle = results.get("idle", {}).get("p99_ms")
    print("\n| phase | requests | p50 ms | p99 ms | max ms | p99 / idle p99 |\n| --- | --- | --- | --- | --- | --- |")
    for phase, r in results.items():
        ratio = f"{r['p99_ms'] / idle:.2f}" if idle else "-"
        print(f"| {phase} | {r['requests']} | {r['p50_ms']} | {r['p99_ms']} | {r['max_ms']} | {ratio} |")
    print(f"\nacknowledged {acknowledged} spans, {stored} stored in the file")


if __name__ == "__main__":
    main()
