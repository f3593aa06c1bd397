"""Sustained ingest: spans/s from OTLP/HTTP request to committed DuckDB row, side by side in one run.

    .venv/bin/python -m benchmarks.ingest_throughput --spans 1000000 [--agl-python /work/venvs/agl/bin/python]

Contenders, each a real server process on 127.0.0.1 fed by the same load generator (pre-encoded
protobuf bodies of 512 openai.chat-shaped spans, ~1.2 KB and ~20 attributes each, fresh ids per send,
K keep-alive connections):
  lightning-otel   `lightning-otel collect` (Arrow batches, group commit)
  row-by-row       the same collector with one INSERT per row (benchmarks/row_by_row_collector.py)
  agentlightning   Agent Lightning's store server over its OTLP/HTTP endpoint (benchmarks/peers/), run
                   in its own venv when --agl-python is given
A request counts when its 200 arrives, which the collectors send only after the commit.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from benchmarks import synthetic
from lightning_otel.span_store import client, discovery

HERE = Path(__file__).resolve().parent


def start_collector(db: Path, script: list[str], extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen,
                                                                                     discovery.CollectorInfo]:
    """`<script> collect` on db (any free port, `extra` flags), once its discovery file names it."""
    proc = subprocess.Popen([sys.executable, *script, "collect", "--db", str(db), "--port", "0", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        info = discovery.find_collector(db)
        if info is not None and info.pid == proc.pid:
            return proc, info
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"collector {script} did not start")


class Load:
    """K threads POSTing fresh-id bodies until n_spans are acknowledged; RSS of the server sampled."""

    def __init__(self, templates: list[synthetic.FreshIds], n_spans: int, connections: int):
        self.templates = templates
        self.n_requests = max(1, n_spans // templates[0].n_spans)
        self.connections = connections
        self.next = 0
        self.lock = threading.Lock()
        self.errors: list[str] = []
        self.rss: list[tuple[int, int]] = []  # (spans acknowledged, server RSS bytes)
        self.acked = 0

    def _take(self) -> int | None:
        with self.lock:
            if self.next >= self.n_requests:
                return None
            self.next += 1
            return self.next - 1

    def _worker(self, host: str, port: int) -> None:
        conn = http.client.HTTPConnection(host, port, timeout=120)
        while (index := self._take()) is not None:
            template = self.templates[index % len(self.templates)]
            body = template.render()
            while True:
                conn.request("POST", "/v1/traces", body, {"Content-Type": "application/x-protobuf"})
                response = conn.getresponse()
                response.read()
                if response.status == 503:
                    time.sleep(float(response.getheader("Retry-After") or 1))
                    continue
                break
            if response.status != 200:
                self.errors.append(f"HTTP {response.status}")
            with self.lock:
                self.acked += template.n_spans

    def run(self, host: str, port: int, pid: int) -> float:
        process = psutil.Process(pid)
        threads = [threading.Thread(target=self._worker, args=(host, port)) for _ in range(self.connections)]
        started = time.perf_counter()
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            self.rss.append((self.acked, process.memory_info().rss))
            time.sleep(0.25)
        elapsed = time.perf_counter() - started
        self.rss.append((self.acked, process.memory_info().rss))
        return elapsed


def measure_collector(name: str, script: list[str], templates, n_spans: int, connections: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "bench.duckdb"
        proc, info = start_collector(db, script)
        try:
            load = Load(templates, n_spans, connections)
            elapsed = load.run(info.host, info.port, proc.pid)
            stored = client.query("SELECT count(*) AS n FROM spans", db)["n"][0]
            memory = client.query("SELECT tag, memory_usage_bytes FROM duckdb_memory() "
                                  "WHERE memory_usage_bytes > 0", db).to_dicts()
        finally:
            proc.terminate()
            proc.wait(60)
    marks = {}
    for fraction in (0.25, 0.5, 1.0):
        want = fraction * load.acked
        marks[f"rss_mb_at_{int(fraction * 100)}pct"] = round(
            next(rss for acked, rss in load.rss if acked >= want) / 2**20)
    return {"contender": name, "spans": load.acked, "stored": stored, "seconds": round(elapsed, 2),
            "spans_per_s": round(load.acked / elapsed), "errors": len(load.errors),
            "peak_rss_mb": round(max(r for _, r in load.rss) / 2**20), **marks,
            "duckdb_memory_mb": {m["tag"]: round(m["memory_usage_bytes"] / 2**20) for m in memory}}


def measure_agl(agl_python: str, bodies: list[bytes], seconds: float) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".bin") as fh:
        synthetic.write_bodies(fh.name, bodies)
        result = subprocess.run([agl_python, str(HERE / "peers" / "agentlightning_store.py"), "--bodies", fh.name,
                                 "--seconds", str(seconds)], capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        return {"contender": "agentlightning", "error": result.stderr[-500:]}
    line = [ln for ln in result.stdout.splitlines() if ln.startswith("{")][-1]
    data = json.loads(line)
    return {"contender": f"agentlightning {data.get('version', '')}", "spans": data["spans"],
            "seconds": round(data["seconds"], 2), "spans_per_s": round(data["spans_per_s"]),
            "peak_rss_mb": round(data["peak_rss_mb"]), "path": data.get("path")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spans", type=int, default=1_000_000, help="spans sent to lightning-otel")
    parser.add_argument("--baseline-spans", type=int, default=50_000, help="spans sent to the row-by-row baseline")
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--agl-python", help="python of a venv with agentlightning installed")
    parser.add_argument("--agl-seconds", type=float, default=25)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    bodies = synthetic.make_bodies(20, 512)
    templates = [synthetic.FreshIds(body) for body in bodies]
    print(f"machine: {os.cpu_count()} cores; span size {len(bodies[0]) / 512:.0f} B; 512 spans/request", flush=True)
    results = [measure_collector("lightning-otel", ["-m", "lightning_otel.cli"], templates, args.spans,
                                 args.connections)]
    print(json.dumps(results[-1]), flush=True)
    results.append(measure_collector("row-by-row", [str(HERE / "row_by_row_collector.py")], templates,
                                     args.baseline_spans, args.connections))
    print(json.dumps(results[-1]), flush=True)
    if args.agl_python:
        results.append(measure_agl(args.agl_python, bodies, args.agl_seconds))
        print(json.dumps(results[-1]), flush=True)
    ours = results[0]["spans_per_s"]
    print("\n| contender | spans | s | spans/s | ratio (ours / it) | peak RSS MB |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in results:
        if "error" in r:
            print(f"| {r['contender']} | failed: {r['error'][:80]} | | | | |")
            continue
        print(f"| {r['contender']} | {r['spans']} | {r['seconds']} | {r['spans_per_s']} | "
              f"{ours / r['spans_per_s']:.2f} | {r['peak_rss_mb']} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
