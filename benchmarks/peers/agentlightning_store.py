"""Peer benchmark: sustained span ingest of Microsoft Agent Lightning's LightningStore.

Run with the Agent Lightning venv's python (see README.md in this folder), never the project's:

    /work/venvs/agl/bin/python benchmarks/peers/agentlightning_store.py --bodies /tmp/bodies.bin --seconds 25

Path measured: the store server exactly as `agl store` starts it (InMemoryLightningStore(thread_safe=True)
behind LightningStoreServer, uvicorn, asyncio launch mode), fed over OTLP/HTTP protobuf on
127.0.0.1:<port>/v1/traces by several keep-alive client threads -- the same route Agent Lightning's own
LightningStoreOTLPExporter uses. The server runs in its own process, so it gets a core of its own.

Agent Lightning drops any OTLP span whose resource (or span) attributes lack `agentlightning.rollout_id` and
`agentlightning.attempt_id`, and rejects spans of a rollout/attempt it does not know. So before timing we start
R rollouts through its REST API and add those two resource attributes to each body, as its exporter does. Its
spans collection is keyed by (rollout_id, attempt_id, span_id) and falls back to one-by-one inserts with an error
per duplicate, so every send gets fresh random trace and span ids (patched in place at offsets found once, so
the client spends microseconds per request, not a protobuf re-encode) and the next rollout/attempt in turn.

This file is self-contained: it does not import lightning_otel.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from importlib.metadata import version as pkg_version

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

ROLLOUT_ATTR = "agentlightning.rollout_id"
ATTEMPT_ATTR = "agentlightning.attempt_id"
RO_PLACEHOLDER = "ro-" + "R" * 12  # Agent Lightning ids: "ro-" + 12 chars, "at-" + 8 chars
AT_PLACEHOLDER = "at-" + "A" * 8


def read_bodies(path: str) -> list[bytes]:
    bodies = []
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    while pos < len(data):
        (n,) = struct.unpack_from(">I", data, pos)
        bodies.append(data[pos + 4 : pos + 4 + n])
        pos += 4 + n
    return bodies


class Template:
    """One body with the Agent Lightning resource attributes added and the offsets of every id to rewrite."""

    def __init__(self, body: bytes):
        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        for rs in req.resource_spans:
            rs.resource.attributes.append(KeyValue(key=ROLLOUT_ATTR, value=AnyValue(string_value=RO_PLACEHOLDER)))
            rs.resource.attributes.append(KeyValue(key=ATTEMPT_ATTR, value=AnyValue(string_value=AT_PLACEHOLDER)))
        raw = req.SerializeToString()
        self.data = bytearray(raw)
        self.n_spans = sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
        self.ro_offsets = _find_all(raw, RO_PLACEHOLDER.encode())
        self.at_offsets = _find_all(raw, AT_PLACEHOLDER.encode())
        self.span_offsets: list[int] = []
        trace_groups: dict[bytes, list[int]] = {}
        for rs in req.resource_spans:
            for ss in rs.scope_spans:
                for sp in ss.spans:
                    # Span.span_id is field 2 (tag 0x12, length 8); Span.trace_id is field 1 (tag 0x0a, length 16).
                    self.span_offsets.append(_find_unique(raw, b"\x12\x08" + sp.span_id) + 2)
                    if sp.trace_id not in trace_groups:
                        trace_groups[sp.trace_id] = [o + 2 for o in _find_all(raw, b"\x0a\x10" + sp.trace_id)]
                    if sp.parent_span_id:
                        raise SystemExit("bodies with parent_span_id are not supported by the id rewriter")
        self.trace_groups = list(trace_groups.values())
        if len(self.span_offsets) != self.n_spans or not self.ro_offsets or not self.at_offsets:
            raise SystemExit("could not locate ids in a body")

    def render(self, rollout_id: str, attempt_id: str) -> bytes:
        buf = self.data
        ro, at = rollout_id.encode(), attempt_id.encode()
        for o in self.ro_offsets:
            buf[o : o + 15] = ro
        for o in self.at_offsets:
            buf[o : o + 11] = at
        fresh = os.urandom(8 * len(self.span_offsets) + 16 * len(self.trace_groups))
        for i, o in enumerate(self.span_offsets):
            buf[o : o + 8] = fresh[8 * i : 8 * i + 8]
        base = 8 * len(self.span_offsets)
        for j, offsets in enumerate(self.trace_groups):
            tid = fresh[base + 16 * j : base + 16 * j + 16]
            for o in offsets:
                buf[o : o + 16] = tid
        return bytes(buf)


def _find_all(haystack: bytes, needle: bytes) -> list[int]:
    out, pos = [], haystack.find(needle)
    while pos >= 0:
        out.append(pos)
        pos = haystack.find(needle, pos + 1)
    return out


def _find_unique(haystack: bytes, needle: bytes) -> int:
    found = _find_all(haystack, needle)
    if len(found) != 1:
        raise SystemExit(f"id pattern found {len(found)} times in a body")
    return found[0]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http_json(base: str, method: str, path: str, payload=None, timeout: float = 30.0):
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(base + path, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _vm_hwm_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _cpu_s(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _first_last(samples: list[tuple[float, int]], window: float = 5.0) -> tuple[float, float]:
    """spans/s over the first and the last `window` seconds of the run."""
    if len(samples) < 2:
        return (float("nan"), float("nan"))
    pts = [(0.0, 0)] + samples
    first = next((p for p in pts if p[0] >= window), pts[-1])
    last_start = next((p for p in pts if p[0] >= pts[-1][0] - window), pts[0])
    rate = lambda a, b: (b[1] - a[1]) / (b[0] - a[0]) if b[0] > a[0] else float("nan")  # noqa: E731
    return (rate(pts[0], first), rate(last_start, pts[-1]))


def start_server(port: int, log_path: str) -> subprocess.Popen:
    log = open(log_path, "wb")
    # LiteLLM (imported by agentlightning) otherwise tries to fetch a model price list from GitHub at start-up.
    env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True")
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentlightning.cli.store", "--host", "127.0.0.1", "--port", str(port),
         "--log-level", "WARNING"],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"agl store exited early (rc={proc.returncode}); see {log_path}")
        try:
            if _http_json(base, "GET", "/v1/agl/health", timeout=2).get("status") == "ok":
                return proc
        except Exception:
            time.sleep(0.25)
    proc.kill()
    raise SystemExit("agl store did not become healthy within 120 s")


def run_http(templates: list[Template], seconds: float, threads: int, n_rollouts: int, log_path: str) -> dict:
    port = _free_port()
    t_boot = time.perf_counter()
    server = start_server(port, log_path)
    boot_s = time.perf_counter() - t_boot
    base = f"http://127.0.0.1:{port}"
    try:
        pairs = []
        for i in range(n_rollouts):
            r = _http_json(base, "POST", "/v1/agl/rollouts", {"input": {"question": f"q{i}"}, "mode": "train"})
            pairs.append((r["rollout_id"], r["attempt"]["attempt_id"]))
        for ro, at in pairs:
            if len(ro) != 15 or len(at) != 11:
                raise SystemExit(f"unexpected id lengths: {ro!r} {at!r}")

        stop = threading.Event()
        lock = threading.Lock()
        totals = {"requests": 0, "spans": 0, "errors": 0, "latency_s": 0.0}
        counter = iter(range(1 << 62))
        live = [0]  # spans acknowledged so far, for the throughput-over-time samples

        def worker(k: int) -> None:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            headers = {"Content-Type": "application/x-protobuf"}
            # Each thread owns its templates (render mutates a shared buffer).
            mine = [Template.__new__(Template) for _ in templates]
            for m, t in zip(mine, templates):
                m.__dict__.update(t.__dict__)
                m.data = bytearray(t.data)
            rng = random.Random(k)
            req_n = res_n = err_n = 0
            lat = 0.0
            while not stop.is_set():
                t = mine[rng.randrange(len(mine))]
                ro, at = pairs[next(counter) % len(pairs)]
                body = t.render(ro, at)
                t0 = time.perf_counter()
                conn.request("POST", "/v1/traces", body=body, headers=headers)
                resp = conn.getresponse()
                resp.read()
                if stop.is_set() and time.perf_counter() > deadline:
                    break  # finished after the window closed: not counted
                lat += time.perf_counter() - t0
                req_n += 1
                if resp.status == 200:
                    res_n += t.n_spans
                    with lock:
                        live[0] += t.n_spans
                else:
                    err_n += 1
            conn.close()
            with lock:
                totals["requests"] += req_n
                totals["spans"] += res_n
                totals["errors"] += err_n
                totals["latency_s"] += lat

        # Warm-up: one request per thread's worth, not counted.
        warm = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        for i in range(2):
            ro, at = pairs[i % len(pairs)]
            warm.request("POST", "/v1/traces", body=templates[i % len(templates)].render(ro, at),
                         headers={"Content-Type": "application/x-protobuf"})
            warm.getresponse().read()
        warm.close()
        warm_spans = sum(templates[i % len(templates)].n_spans for i in range(2))
        stats0 = _http_json(base, "GET", "/v1/agl/statistics")

        deadline = float("inf")
        ts = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(threads)]
        cpu0, client_cpu0 = _cpu_s(server.pid), time.process_time()
        t0 = time.perf_counter()
        for th in ts:
            th.start()
        samples = []  # (t, spans) once a second
        while time.perf_counter() - t0 < seconds:
            time.sleep(min(1.0, max(seconds - (time.perf_counter() - t0), 0.0)))
            samples.append((time.perf_counter() - t0, live[0]))
        deadline = time.perf_counter()
        cpu1, client_cpu1 = _cpu_s(server.pid), time.process_time()
        stop.set()
        for th in ts:
            th.join(timeout=300)
        elapsed = deadline - t0
        stats1 = _http_json(base, "GET", "/v1/agl/statistics")
        peak_rss = _vm_hwm_mb(server.pid)
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
    with open(log_path, "rb") as f:
        log_text = f.read().decode(errors="replace")
    benign = ("INFO:", "No access host provided")
    log_lines = [ln.strip() for ln in log_text.splitlines() if ln.strip() and not any(b in ln for b in benign)]
    return {
        "spans": totals["spans"], "seconds": elapsed, "requests": totals["requests"], "errors": totals["errors"],
        "mean_latency_ms": 1000 * totals["latency_s"] / max(totals["requests"], 1),
        "stored_before": stats0.get("total_spans"), "stored_after": stats1.get("total_spans"),
        "warm_spans": warm_spans, "server_cpu_s": cpu1 - cpu0, "client_cpu_s": client_cpu1 - client_cpu0,
        "rate_first_last": _first_last(samples), "peak_rss_mb": peak_rss, "boot_s": boot_s,
        "server_log_lines": len(log_lines), "server_log_head": log_lines[:3],
    }


def run_breakdown(templates: list[Template], seconds: float) -> dict:
    """In-process split of the server's per-span cost: OTLP protobuf -> agentlightning Span, then add_many_spans."""
    import asyncio

    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    from agentlightning.store.memory import InMemoryLightningStore
    from agentlightning.utils.otlp import spans_from_proto

    async def main() -> dict:
        store = InMemoryLightningStore(thread_safe=True)
        pairs = []
        for i in range(64):
            r = await store.start_rollout(input={"question": f"q{i}"}, mode="train")
            pairs.append((r.rollout_id, r.attempt.attempt_id))
        parse_s = conv_s = add_s = 0.0
        n = i = 0
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            ro, at = pairs[i % len(pairs)]
            body = templates[i % len(templates)].render(ro, at)
            i += 1
            t0 = time.perf_counter()
            req = ExportTraceServiceRequest()
            req.ParseFromString(body)
            t1 = time.perf_counter()
            spans = await spans_from_proto(req, store.get_many_span_sequence_ids)
            t2 = time.perf_counter()
            added = await store.add_many_spans(spans)
            t3 = time.perf_counter()
            parse_s, conv_s, add_s = parse_s + t1 - t0, conv_s + t2 - t1, add_s + t3 - t2
            n += len(added)
        return {"spans": n, "parse_us_per_span": 1e6 * parse_s / n, "convert_us_per_span": 1e6 * conv_s / n,
                "add_many_spans_us_per_span": 1e6 * add_s / n,
                "in_process_spans_per_s": n / (parse_s + conv_s + add_s)}

    return asyncio.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bodies", required=True, help="file of 4-byte big-endian length-prefixed OTLP trace bodies")
    ap.add_argument("--seconds", type=float, default=25.0, help="measurement window over HTTP")
    ap.add_argument("--threads", type=int, default=4, help="OTLP/HTTP client threads (keep-alive connections)")
    ap.add_argument("--rollouts", type=int, default=64, help="rollouts the spans are spread over")
    ap.add_argument("--breakdown-seconds", type=float, default=0.0,
                    help="if > 0, also time parse/convert/add_many_spans in-process for this long (after the HTTP run)")
    args = ap.parse_args()

    load_before = os.getloadavg()[0]
    templates = [Template(b) for b in read_bodies(args.bodies)]
    if not templates:
        raise SystemExit("no bodies")
    with tempfile.TemporaryDirectory() as tmp:
        r = run_http(templates, args.seconds, args.threads, args.rollouts, os.path.join(tmp, "agl_store.log"))

    expected_stored = (r["stored_before"] or 0) + r["spans"]
    notes = [
        f"agl store (InMemoryLightningStore thread_safe=True, LightningStoreServer, uvicorn asyncio, 1 process) "
        f"on 127.0.0.1, {args.threads} keep-alive client threads in a separate process, uncompressed protobuf",
        f"{r['requests']} requests of {templates[0].n_spans} spans, {r['errors']} non-200, "
        f"mean request latency {r['mean_latency_ms']:.0f} ms",
        f"fresh random trace/span ids per send; agentlightning.rollout_id/attempt_id resource attributes added, "
        f"spread over {args.rollouts} rollouts started via its REST API",
        f"store total_spans after run {r['stored_after']} (expected >= {expected_stored}); "
        f"everything is held in Python memory (pydantic Span objects), nothing persisted",
        f"server used {r['server_cpu_s']:.1f} CPU-s in the window = "
        f"{r['spans'] / max(r['server_cpu_s'], 1e-9):.0f} spans per server CPU-second (1 core busy at most, "
        f"the asyncio server is single-threaded); client used {r['client_cpu_s']:.1f} CPU-s; "
        f"spans/s first 5 s {r['rate_first_last'][0]:.0f}, "
        f"last 5 s {r['rate_first_last'][1]:.0f}",
        f"load average before run {load_before:.2f} on {os.cpu_count()} cores",
        f"peak_rss_mb is the server process VmHWM; server boot {r['boot_s']:.1f} s; "
        f"server warnings/errors: {r['server_log_lines']}",
    ]
    out = {
        "peer": "agentlightning",
        "version": pkg_version("agentlightning"),
        "path": "OTLP/HTTP protobuf POST /v1/traces to its LightningStoreServer (`agl store`, in-memory backend), "
                "over 127.0.0.1 from concurrent client threads",
        "spans": r["spans"],
        "seconds": round(r["seconds"], 3),
        "spans_per_s": round(r["spans"] / r["seconds"], 1),
        "peak_rss_mb": round(r["peak_rss_mb"], 1),
    }
    if args.breakdown_seconds > 0:
        b = run_breakdown(templates, args.breakdown_seconds)
        notes.append(
            f"in-process breakdown over {b['spans']} spans: protobuf parse {b['parse_us_per_span']:.1f} us/span, "
            f"spans_from_proto (OTLP -> agentlightning Span) {b['convert_us_per_span']:.1f} us/span, "
            f"add_many_spans {b['add_many_spans_us_per_span']:.1f} us/span => "
            f"{b['in_process_spans_per_s']:.0f} spans/s without HTTP"
        )
        out["breakdown"] = {k: round(v, 2) for k, v in b.items()}
    if r["server_log_head"]:
        notes.append("first server warnings/errors: " + " | ".join(r["server_log_head"])[:400])
    out["notes"] = "; ".join(notes)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
