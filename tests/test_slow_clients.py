"""Slow clients on real servers over 127.0.0.1: slowloris headers, a body that stops, idle keep-alive,
fifty slow clients at once, the connection cap; and what must not be cut: multi-MB bodies, slow answers,
answers read slowly. The collector is the real one; the gateway is the real server in front of a stand-in
engine (the engine is not what is under test, and vLLM takes minutes to start)."""
from __future__ import annotations

import http.client
import select
import socket
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass

import orjson
import pyarrow as pa
import pytest

from conftest import post
from lightning_otel.errors import UserError
from lightning_otel.serve.gateway import Gateway, GatewayConfig
from lightning_otel.httpserver import ConnectionLimits
from lightning_otel.span_store import client
from test_collector_http import sample_request
from tests.helpers.streams import ChunkList, engine_chunks

FAST = ConnectionLimits(read_timeout_s=0.5, request_timeout_s=1.5, idle_timeout_s=0.5)
# Far above every limit used here, so a busy machine does not fail the tests; without the limits the
# servers never cut a slow client, and each check below would fail at this bound.
BOUND_S = 20.0
TRICKLE_S = 0.1  # under read_timeout_s: only the total request timeout can cut these clients


class StandInEngine:
    """Answers every generation after `delay_s`, whole or streamed."""
    name, policy_version, model_name = "stand-in", 0, "policy"

    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s

    def stream(self, path: str, body: dict, timeout: float = 600) -> ChunkList:
        time.sleep(self.delay_s)
        return ChunkList(engine_chunks(["Hello!"]))

    def generate(self, path: str, body: dict, timeout: float = 600) -> dict:
        time.sleep(self.delay_s)
        tokens = [{"token": t, "logprob": -0.5} for t in ("Hel", "lo", "!")]
        return {"id": "cmpl-1", "prompt_token_ids": [1, 2], "usage": {"prompt_tokens": 2, "completion_tokens": 3},
                "choices": [{"index": 0, "message": {"content": "Hello!"}, "finish_reason": "stop",
                             "token_ids": [3, 4, 5], "logprobs": {"content": tokens}}]}


@pytest.fixture
def make_gateway():
    started: list[Gateway] = []

    def start(engine: StandInEngine | None = None, limits: ConnectionLimits = FAST) -> Gateway:
        gateway = Gateway(engine or StandInEngine(), GatewayConfig(connection_limits=limits))
        gateway.start()
        started.append(gateway)
        return gateway

    yield start
    for gateway in started:
        gateway.close()


@dataclass
class Served:
    url: str
    post_path: str  # an endpoint that reads a body


@pytest.fixture(params=["collector", "gateway"])
def served(request, make_collector, make_gateway) -> Served:
    if request.param == "collector":
        return Served(make_collector(connection_limits=FAST).url, "/v1/traces")
    return Served(make_gateway().url, "/v1/chat/completions")


def connect(url: str, rcvbuf: int | None = None) -> socket.socket:
    parts = urllib.parse.urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(BOUND_S)
    sock.connect((parts.hostname, parts.port))
    return sock


def headers_forever():
    """A request whose headers never end: the classic slowloris."""
    yield from b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
    while True:
        yield from b"X-Padding: aaaaaaaaaa\r\n"


class SlowClient:
    """One connection that sends `trickle` one byte per TRICKLE_S; `poll` notes when the server cuts it."""

    def __init__(self, url: str, trickle=None, first: bytes = b""):
        self.started = time.monotonic()
        self.sock = connect(url)
        self.sock.sendall(first)
        self.trickle = trickle
        self.answer = b""
        self.cut_after: float | None = None

    def poll(self) -> None:
        if self.cut_after is not None:
            return
        try:
            if select.select([self.sock], [], [], 0)[0]:
                self._read_to_end()
            elif self.trickle is not None:
                self.sock.send(bytes([next(self.trickle)]))
        except (BrokenPipeError, ConnectionResetError):
            self.cut_after = time.monotonic() - self.started

    def _read_to_end(self) -> None:
        while piece := self.sock.recv(1 << 16):
            self.answer += piece
        self.cut_after = time.monotonic() - self.started

    def close(self) -> None:
        self.sock.close()


def trickle(clients: list[SlowClient], bound_s: float = BOUND_S) -> threading.Thread:
    """Keep the clients trickling, in the background, until the server has cut them all (or `bound_s`)."""
    def run() -> None:
        deadline = time.monotonic() + bound_s
        while time.monotonic() < deadline and any(c.cut_after is None for c in clients):
            for c in clients:
                c.poll()
            time.sleep(TRICKLE_S)

    thread = threading.Thread(target=run, name="trickle", daemon=True)
    thread.start()
    return thread


def assert_all_cut(clients: list[SlowClient], trickler: threading.Thread) -> None:
    trickler.join()
    stuck = [c for c in clients if c.cut_after is None]
    assert not stuck, f"{len(stuck)} slow client(s) still connected after {BOUND_S} s"


def request_threads() -> int:
    """Connection threads alive in this process (ThreadingMixIn names them after their target)."""
    return sum("process_request_thread" in t.name for t in threading.enumerate())


def wait_threads_freed(bound_s: float = BOUND_S) -> None:
    deadline = time.monotonic() + bound_s
    while request_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert request_threads() == 0, "a slow client's connection thread was not freed"


@pytest.mark.heavy
def test_slowloris_headers_are_cut_while_others_are_served(served):
    slow = SlowClient(served.url, headers_forever())
    trickler = trickle([slow])
    answered = []
    while trickler.is_alive():
        with urllib.request.urlopen(served.url + "/health", timeout=BOUND_S) as resp:  # a new connection
            answered.append(resp.status)
        time.sleep(TRICKLE_S)
    assert_all_cut([slow], trickler)
    assert FAST.request_timeout_s <= slow.cut_after < BOUND_S
    assert slow.answer == b"" or slow.answer.startswith(b"HTTP/1.1 408 "), slow.answer[:100]
    assert answered and set(answered) == {200}
    wait_threads_freed()  # while the slow client's socket is still open on its side
    slow.close()


@pytest.mark.heavy
def test_a_body_that_stops_gets_408(served):
    head = (f"POST {served.post_path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: 100000\r\n\r\n").encode()
    stalled = SlowClient(served.url, first=head + b"{" * 1000)  # then nothing
    assert_all_cut([stalled], trickle([stalled]))
    assert FAST.read_timeout_s <= stalled.cut_after < BOUND_S
    status_line, _, rest = stalled.answer.partition(b"\r\n")
    assert status_line == b"HTTP/1.1 408 Request Timeout", stalled.answer[:200]
    assert b"Connection: close" in rest and b"request timeout" in rest
    wait_threads_freed()
    stalled.close()


def test_an_idle_keep_alive_connection_is_closed(served):
    parts = urllib.parse.urlsplit(served.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=BOUND_S)
    for _ in range(2):  # kept alive between two quick requests ...
        started = time.monotonic()
        conn.request("GET", "/health")
        response = conn.getresponse()
        assert response.status == 200
        response.read()
    assert select.select([conn.sock], [], [], BOUND_S)[0], "the idle connection was never closed"
    assert conn.sock.recv(1 << 16) == b""  # ... then closed without a word (no stray 408 to misread)
    assert time.monotonic() - started >= FAST.idle_timeout_s
    conn.close()
    wait_threads_freed()


@pytest.mark.heavy
def test_fifty_slow_clients_do_not_stop_ingest_and_query(make_collector, db_path):
    limits = ConnectionLimits(read_timeout_s=0.5, request_timeout_s=4, idle_timeout_s=0.5)
    collector = make_collector(connection_limits=limits)
    slow = [SlowClient(collector.url, headers_forever()) for _ in range(50)]
    trickler = trickle(slow)
    assert post(collector.url + "/v1/traces", sample_request(100).SerializeToString())[0] == 200
    assert client.query("SELECT count(*) AS n FROM spans", db_path)["n"][0] == 100
    assert_all_cut(slow, trickler)
    assert all(c.cut_after >= limits.request_timeout_s for c in slow)
    wait_threads_freed()
    for c in slow:
        c.close()


@pytest.mark.heavy
def test_connections_over_the_cap_get_503_at_once(make_collector):
    limits = ConnectionLimits(read_timeout_s=0.5, request_timeout_s=2, idle_timeout_s=0.5, max_connections=4)
    collector = make_collector(connection_limits=limits)
    slow = [SlowClient(collector.url, headers_forever()) for _ in range(4)]
    trickler = trickle(slow)
    status, headers, body = post(collector.url + "/v1/traces", sample_request(1).SerializeToString())
    assert status == 503 and headers["Retry-After"] == "1", body
    assert b"max_connections" in body
    assert_all_cut(slow, trickler)
    wait_threads_freed()  # the slots are free again
    assert post(collector.url + "/v1/traces", sample_request(1).SerializeToString())[0] == 200
    for c in slow:
        c.close()


@pytest.mark.heavy
def test_a_multi_megabyte_ingest_still_succeeds(make_collector, db_path):
    collector = make_collector(connection_limits=FAST)
    body = sample_request(60_000).SerializeToString()
    assert len(body) > 3 * 2**20
    assert post(collector.url + "/v1/traces", body)[0] == 200
    assert client.query("SELECT count(*) AS n FROM spans", db_path)["n"][0] == 60_000


def test_a_slow_generation_streams_in_full(make_gateway):
    """The generation takes longer than every receive limit: the answer must still come, whole."""
    gateway = make_gateway(StandInEngine(delay_s=FAST.request_timeout_s + 1))
    request = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    status, headers, body = post(gateway.url + "/v1/chat/completions", orjson.dumps(request), "application/json")
    assert status == 200 and headers["Content-Type"] == "text/event-stream"
    events = [event[len(b"data: "):] for event in body.split(b"\n\n") if event]
    assert events[-1] == b"[DONE]"
    text = "".join(orjson.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == "Hello!"


def test_a_query_result_read_slowly_is_not_cut(make_collector):
    """The client reads the Arrow stream for longer than every receive limit; it must arrive whole."""
    collector = make_collector(connection_limits=FAST)
    sql = b"SELECT i, repeat('x', 200) AS s FROM range(80000) t(i)"  # ~16 MB
    sock = connect(collector.url, rcvbuf=16 * 1024)
    sock.sendall(b"POST /v1/query HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nContent-Length: "
                 + str(len(sql)).encode() + b"\r\n\r\n" + sql)
    started, answer = time.monotonic(), bytearray()
    while piece := sock.recv(1 << 16):
        answer += piece
        if time.monotonic() - started < FAST.request_timeout_s + 1:
            time.sleep(0.02)
    sock.close()
    assert time.monotonic() - started > FAST.request_timeout_s + 1, "the reader must outlast the limits"
    head, _, stream = bytes(answer).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert pa.ipc.open_stream(stream).read_all().num_rows == 80000


@pytest.mark.parametrize("bad", [{"read_timeout_s": 0}, {"request_timeout_s": -1}, {"idle_timeout_s": None},
                                 {"max_connections": 0}])
def test_limits_that_would_serve_nobody_are_refused(bad):
    with pytest.raises(UserError, match=next(iter(bad))):
        ConnectionLimits(**bad)
