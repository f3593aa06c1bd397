"""Forwarding: every OTLP body the collector has committed is sent on to another OTLP/HTTP endpoint (Phoenix,
Langfuse, Jaeger, an OpenTelemetry Collector), so the trace UIs users already run see the same spans.

Ingest never waits for it: an acknowledged body is put on a bounded queue (`max_queue_bytes`) and a background
thread posts it, gzip-compressed, to `<url>/v1/traces` (or `/v1/logs`). Bodies go out as protobuf, the one
encoding every OTLP receiver must take (Phoenix refuses JSON with 415): JSON ones are converted first.

A body the queue has no room for is dropped and counted; so is one the endpoint still refuses after
`max_retry_s` of retries (connection errors, 408, 429 and 5xx are retried with exponential backoff, honouring
Retry-After). One the endpoint rejects for good (another 4xx) is counted as rejected and not retried. The
counts are in the collector's /health.
"""
from __future__ import annotations

import base64
import collections
import gzip
import json
import logging
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable

from google.protobuf import json_format
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from lightning_otel.errors import UserError

log = logging.getLogger(__name__)

SIGNAL_PATHS = {"traces": "/v1/traces", "logs": "/v1/logs"}
RETRIED_STATUSES = {408, 429, 500, 502, 503, 504}
PROTOBUF = "application/x-protobuf"
REQUEST_TYPES = {"traces": ExportTraceServiceRequest, "logs": ExportLogsServiceRequest}
ID_KEYS = ("traceId", "spanId", "parentSpanId")  # hex in OTLP/JSON, bytes (base64 in protobuf's JSON) otherwise


@dataclass
class ForwardConfig:
    url: str  # the endpoint's base (as OTEL_EXPORTER_OTLP_ENDPOINT), or its /v1/traces URL
    headers: dict[str, str] = field(default_factory=dict)  # e.g. Authorization for Langfuse
    max_queue_bytes: int = 64 * 1024 * 1024
    max_retry_s: float = 300.0  # how long one body is retried before it is dropped
    timeout_s: float = 10.0  # one POST
    flush_s: float = 5.0  # at shutdown, how long queued bodies may still take to go out

    def __post_init__(self) -> None:
        self.url = otlp_base_url(self.url, "--forward")
        check_headers(self.headers, "--forward-header")
        if self.max_queue_bytes < 1024:
            raise UserError(f"forward queue of {self.max_queue_bytes} bytes is too small (at least 1024)")
        if not self.max_retry_s >= 0 or not self.timeout_s > 0:
            raise UserError("forwarding's retry and timeout seconds must be positive")

    def endpoint(self, signal_name: str) -> str:
        return self.url + SIGNAL_PATHS[signal_name]


def otlp_base_url(url: str, flag: str) -> str:
    """An OTLP/HTTP endpoint's base URL: `url` without a trailing /v1/traces or /v1/logs (either is accepted)."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise UserError(f"{flag} {url!r} is not an http(s) URL: give the OTLP/HTTP endpoint, e.g. "
                        f"http://127.0.0.1:6006 (Phoenix) or https://cloud.langfuse.com/api/public/otel")
    path = parsed.path.rstrip("/")
    for suffix in SIGNAL_PATHS.values():
        if path.endswith(suffix):
            path = path[: -len(suffix)]
    return urllib.parse.urlunsplit((parsed.scheme, parsed.netloc, path, "", ""))


def check_headers(headers: dict[str, str], flag: str) -> None:
    for name, value in headers.items():
        if not name or any(c in name + value for c in "\r\n") or ":" in name:
            raise UserError(f"{flag} {name!r}: give NAME=VALUE, a header name without ':' and no line breaks")


def parse_headers(pairs: list[str], flag: str = "--forward-header") -> dict[str, str]:
    """`K=V` strings (`--forward-header`, `--header`) as a dict; the value may itself hold '='."""
    headers = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.strip():
            raise UserError(f"{flag} {pair!r}: give NAME=VALUE, e.g. Authorization='Basic <key>'")
        headers[name.strip()] = value
    return headers


@dataclass
class _Body:
    signal_name: str
    content_type: str
    data: bytes
    rows: int


class Forwarder:
    """The queue and the thread that drains it. `offer` never blocks."""

    def __init__(self, config: ForwardConfig):
        self.config = config
        self._queue: collections.deque[_Body] = collections.deque()
        self._queued_bytes = 0
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="collector-forward", daemon=True)
        self.counts = {"sent": 0, "sent_rows": 0, "retries": 0, "dropped": 0, "dropped_rows": 0, "rejected": 0}
        self.last_error = ""

    def start(self) -> None:
        self._thread.start()

    def offer(self, signal_name: str, content_type: str, data: bytes, rows: int) -> bool:
        """Queue one acknowledged body; False (and counted as dropped) when the queue has no room for it."""
        with self._lock:
            if self._stopping.is_set() or self._queued_bytes + len(data) > self.config.max_queue_bytes:
                self._drop(rows, "the forward queue is full" if not self._stopping.is_set() else "shutting down")
                return False
            self._queue.append(_Body(signal_name, content_type, data, rows))
            self._queued_bytes += len(data)
            self._ready.notify()
        return True

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"url": self.config.url, "queued": len(self._queue), "queued_bytes": self._queued_bytes,
                    **self.counts, "last_error": self.last_error}

    def close(self) -> None:
        """Let queued bodies go out for up to flush_s, then drop (and count) what is left."""
        deadline = time.monotonic() + self.config.flush_s
        with self._lock:
            while self._queue and self._thread.is_alive() and time.monotonic() < deadline:
                self._ready.wait(0.05)
            self._stopping.set()
            self._ready.notify_all()
            for body in self._queue:
                self._drop(body.rows, "the collector stopped before it went out")
            self._queue.clear()
            self._queued_bytes = 0
        self._thread.join(self.config.timeout_s + 1)

    def _drop(self, rows: int, why: str) -> None:  # with the lock held
        self.counts["dropped"] += 1
        self.counts["dropped_rows"] += rows
        if self.counts["dropped"] in (1, 10, 100, 1000) or self.counts["dropped"] % 10000 == 0:
            log.warning("forwarding to %s: dropped a body of %d rows (%s); %d dropped so far", self.config.url, rows,
                        why, self.counts["dropped"])

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._stopping.is_set():
                    self._ready.wait()
                if not self._queue:
                    return
                body = self._queue[0]
            outcome = self._deliver(body)
            with self._lock:
                if self._queue and self._queue[0] is body:
                    self._queue.popleft()
                    self._queued_bytes -= len(body.data)
                if outcome == "sent":
                    self.counts["sent"] += 1
                    self.counts["sent_rows"] += body.rows
                elif outcome == "rejected":
                    self.counts["rejected"] += 1
                elif outcome == "gave up":
                    self._drop(body.rows, f"still failing after {self.config.max_retry_s:g} s: {self.last_error}")
                self._ready.notify_all()

    def _deliver(self, body: _Body) -> str:
        """'sent', 'rejected' (a 4xx that retrying cannot fix), 'gave up' (retried past max_retry_s) or
        'stopped' (the collector is closing)."""
        data, content_type = body.data, body.content_type
        if content_type != PROTOBUF:
            try:
                data, content_type = json_to_protobuf(body.signal_name, data), PROTOBUF
            except (ValueError, json_format.ParseError) as exc:  # stored already, so it decoded: send it as it is
                log.warning("forwarding: an OTLP/JSON body did not convert to protobuf (%s); sent as JSON", exc)

        def retrying(error: str) -> None:
            self.last_error = error
            with self._lock:
                self.counts["retries"] += 1

        delivery = post_otlp(self.config.endpoint(body.signal_name), data, content_type, self.config.headers,
                             timeout_s=self.config.timeout_s, max_retry_s=self.config.max_retry_s,
                             stop=self._stopping, on_retry=retrying)
        if delivery.error:
            self.last_error = delivery.error
        if delivery.outcome == "rejected":
            log.warning("forwarding: %s; the body is not sent again", delivery.error)
        return delivery.outcome


@dataclass
class Delivery:
    """How one POST ended: outcome 'sent', 'rejected' (a 4xx that retrying cannot fix), 'gave up' (still failing
    after max_retry_s) or 'stopped' (`stop` was set while waiting to retry)."""
    outcome: str
    error: str = ""  # the last failure, "HTTP 503 from <url>: <start of the body>" or the connection error
    retries: int = 0
    response: bytes = b""  # the endpoint's answer when sent


def post_otlp(url: str, data: bytes, content_type: str, headers: dict[str, str], timeout_s: float = 10.0,
              max_retry_s: float = 300.0, stop: threading.Event | None = None,
              on_retry: Callable[[str], None] | None = None) -> Delivery:
    """POST one OTLP body to `url`, gzip-compressed. Connection errors, 408, 429 and 5xx are retried with
    exponential backoff (0.5 s doubling up to 30 s, or the endpoint's Retry-After) until max_retry_s has passed;
    `on_retry(error)` is called before each wait."""
    data = gzip.compress(data, compresslevel=1)
    headers = {**headers, "Content-Type": content_type, "Content-Encoding": "gzip"}
    give_up_at, delay = time.monotonic() + max_retry_s, 0.5
    error, retries = "", 0
    while True:
        request = urllib.request.Request(url, data=data, headers=headers, method="POST")
        retry_after = None
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return Delivery("sent", error, retries, response.read())
        except urllib.error.HTTPError as exc:
            error = f"HTTP {exc.code} from {exc.url}: {exc.read(300).decode('utf-8', 'replace')}"
            if exc.code not in RETRIED_STATUSES:
                return Delivery("rejected", error, retries)
            retry_after = _seconds(exc.headers.get("Retry-After"))
        except (OSError, ValueError) as exc:  # refused, reset, timed out, not HTTP
            error = f"{type(exc).__name__}: {exc}"
        wait = min(retry_after if retry_after is not None else delay, 30.0)
        if time.monotonic() + wait > give_up_at:
            return Delivery("gave up", error, retries)
        retries += 1
        if on_retry is not None:
            on_retry(error)
        if stop is not None and stop.wait(wait):
            return Delivery("stopped", error, retries)
        if stop is None:
            time.sleep(wait)
        delay = min(delay * 2, 30.0)


def json_to_protobuf(signal_name: str, body: bytes) -> bytes:
    """An OTLP/JSON request as the same request in protobuf. OTLP/JSON writes trace and span ids in hex where
    protobuf's JSON mapping expects base64, and leaves out what is empty; everything else maps as it is."""
    doc = json.loads(body)
    _ids_to_base64(doc)
    message = json_format.ParseDict(doc, REQUEST_TYPES[signal_name](), ignore_unknown_fields=True)
    return message.SerializeToString()


def _ids_to_base64(node: Any) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ID_KEYS and isinstance(value, str):
                node[key] = base64.b64encode(bytes.fromhex(value)).decode()
            else:
                _ids_to_base64(value)
    elif isinstance(node, list):
        for item in node:
            _ids_to_base64(item)


def _seconds(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value else None
    except ValueError:
        return None
