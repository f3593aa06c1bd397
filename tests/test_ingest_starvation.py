"""Ingest is never starved: each attack runs at full strength against a real collector (forty attackers, each
starting again as soon as it is refused or cut) while agents' ingests must still get 200 and be committed, and
every span acknowledged before the attack must still be stored after it."""
from __future__ import annotations

import os
import select
import socket
import sys
import threading
import time
import urllib.parse

import pyarrow as pa
import pytest

from conftest import post
from lightning_otel.errors import UserError
from lightning_otel.span_store import client
from lightning_otel.span_store.collector import QUERY_NICENESS
from test_collector_http import sample_request

TOKENS = {"ingest_token": "ingest-secret", "query_token": "query-secret", "admin_token": "admin-secret"}
ATTACKERS = 40
# A query that runs for minutes (10^10 rows), stopped only by the query timeout.
SLOW_SQL = b"SELECT sum(a.range * b.range) FROM range(100000) a, range(100000) b"
# About 20 MB of answer: far more than the socket buffers of a client that never reads.
BIG_SQL = b"SELECT i, repeat('x', 1000) AS s FROM range(20000) t(i)"


def bearer(role: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[role + '_token']}"}


def raw_post(path: str, body: bytes, headers: dict[str, str], declared: int | None = None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x", f"Content-Length: {len(body) if declared is None else declared}",
             *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class Attack:
    """ATTACKERS threads, each running `one` (one connection's worth of attack) again and again until stopped."""

    def __init__(self, url: str, one):
        parts = urllib.parse.urlsplit(url)
        self.address = (parts.hostname, parts.port)
        self.one = one
        self.stop = threading.Event()
        self.rounds = 0
        self.answers: list[bytes] = []
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(ATTACKERS)]

    def __enter__(self) -> Attack:
        for thread in self.threads:
            thread.start()
        time.sleep(1.5)  # every attacker in place
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=30)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                with socket.create_connection(self.address, timeout=30) as sock:
                    answer = self.one(sock, self.stop)
                    if answer:
                        self.answers.append(answer.split(b"\r\n", 1)[0])
            except OSError:
                pass
            self.rounds += 1
            self.stop.wait(0.05)


def trickle_unauthenticated(sock: socket.socket, stop: threading.Event) -> bytes:
    """Announce a large body without a token, then send it a byte at a time for as long as the server listens."""
    sock.sendall(raw_post("/v1/traces", b"", {"Content-Type": "application/x-protobuf"}, declared=10_000_000))
    while not stop.is_set():
        if select.select([sock], [], [], 0.1)[0]:
            return read_all(sock)
        sock.send(b"\x00")
    return b""


def slow_query(sock: socket.socket, stop: threading.Event) -> bytes:
    headers = {"Content-Type": "text/plain", "Connection": "close", **bearer("query")}
    sock.sendall(raw_post("/v1/query", SLOW_SQL, headers))
    return read_all(sock)


def unread_query(sock: socket.socket, stop: threading.Event) -> bytes:
    """Ask for a big answer; once it starts, read no more of it and hold the connection until the attack ends."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.sendall(raw_post("/v1/query", BIG_SQL, {"Content-Type": "text/plain", **bearer("query")}))
    while not stop.is_set():
        if select.select([sock], [], [], 0.1)[0]:
            head = sock.recv(64)
            if not head.startswith(b"HTTP/1.1 200"):
                return head + read_all(sock)
            stop.wait()
            return head
    return b""


def read_all(sock: socket.socket) -> bytes:
    received = b""
    try:
        while piece := sock.recv(1 << 16):
            received += piece
    except OSError:
        pass
    return received


def ingest_while(collector, acknowledged: list[int], rounds: int = 5) -> None:
    """Agents keep sending spans; each must get 200 and be committed."""
    for i in range(rounds):
        seed = 10_000 + len(acknowledged)
        started = time.monotonic()
        status, headers, body = post(collector.url + "/v1/traces", sample_request(20, seed=seed).SerializeToString(),
                                     headers=bearer("ingest"))
        assert status == 200, (status, body, time.monotonic() - started)
        acknowledged.append(20)
        time.sleep(0.2)
    assert stored(collector) == sum(acknowledged)


def stored(collector) -> int:
    """Spans in the store, asked with the admin token (the attacks use the query token's share)."""
    status, _, body = post(collector.url + "/v1/query", b"SELECT count(*) AS n FROM spans", "text/plain",
                           headers=bearer("admin"))
    assert status == 200, body
    return pa.ipc.open_stream(body).read_all()["n"][0].as_py()


@pytest.fixture
def guarded(make_collector, db_path):
    """A collector with a token per role and spans already acknowledged; after the test, all still stored."""
    collector = make_collector(**TOKENS, query_timeout_s=3, query_send_timeout_s=1)
    acknowledged: list[int] = []
    ingest_while(collector, acknowledged, rounds=2)
    yield collector, acknowledged
    collector.close()  # then read the file itself: what was acknowledged is on disk
    assert client.query("SELECT count(*) AS n FROM spans", db_path)["n"][0] == sum(acknowledged)


@pytest.mark.heavy
def test_unauthenticated_tricklers_never_hold_ingest(guarded):
    collector, acknowledged = guarded
    with Attack(collector.url, trickle_unauthenticated) as attack:
        ingest_while(collector, acknowledged)
        cut = attack.rounds
    assert cut >= ATTACKERS, "the server must answer 401 and close at once, not read the trickle"
    assert set(attack.answers) == {b"HTTP/1.1 401 Unauthorized"}


@pytest.mark.heavy
def test_slow_queries_never_hold_ingest(guarded):
    collector, acknowledged = guarded
    with Attack(collector.url, slow_query) as attack:
        ingest_while(collector, acknowledged)
    refused = [a for a in attack.answers if a.startswith(b"HTTP/1.1 429")]
    assert refused, "one token's queries past max_queries_per_token must get 429"


@pytest.mark.heavy
def test_query_clients_that_never_read_never_hold_ingest_nor_their_slots(guarded):
    collector, acknowledged = guarded
    with Attack(collector.url, unread_query) as attack:
        ingest_while(collector, acknowledged, rounds=15)
        # Another caller's query still runs (the attacker's token holds its own share of query slots only).
        status, _, _ = post(collector.url + "/v1/query", b"SELECT 1", "text/plain", headers=bearer("admin"))
        assert status == 200
    # Every attacker that got an answer still held its connection, unread: more answers than the token's two
    # slots started only because the server cut the unread ones (query_send_timeout_s) and freed their slots.
    started = [a for a in attack.answers if a.startswith(b"HTTP/1.1 200")]
    assert len(started) >= 4, attack.answers


@pytest.mark.heavy
def test_a_commands_concurrent_queries_wait_their_turn(make_collector, db_path):
    """The client library waits out 429/503 (Retry-After), so one program's threads sharing a token all get
    their answers even past max_queries_per_token."""
    make_collector(**TOKENS, max_queries_per_token=1)
    answers: list[int] = []

    def one() -> None:
        sql = "SELECT count(*) AS n FROM range(8000) a, range(8000) b"
        answers.append(client.query(sql, db_path)["n"][0])

    threads = [threading.Thread(target=one) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert answers == [64_000_000] * 4


def test_a_sequential_caller_never_meets_its_own_finished_query(make_collector):
    """The slot of a query is free before its answer ends: a caller that sends its next query as soon as it
    has read an answer (200, 400 or 413) is never refused 429 on account of the query it has just read."""
    collector = make_collector(**TOKENS, max_queries_per_token=1, max_result_rows=10)
    statements = [b"SELECT 1 AS n", b"SELECT * FROM range(11)", b"SELEC nothing"] * 40
    statuses = [post(collector.url + "/v1/query", sql, "text/plain", headers=bearer("query"))[0] for sql in statements]
    assert statuses == [200, 413, 400] * 40


def test_duckdb_leaves_a_core_to_ingest(make_collector):
    """DuckDB runs on every core but one by default (its own default is every core, so one query held them all
    while ingest waited), and --threads sets it."""
    default = make_collector()
    status, _, body = post(default.url + "/v1/query", b"SELECT current_setting('threads') AS n", "text/plain")
    assert status == 200
    assert pa.ipc.open_stream(body).read_all()["n"][0].as_py() == max(1, (os.cpu_count() or 1) - 1)
    with pytest.raises(UserError, match="--threads 0"):
        make_collector(threads=0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice value is Linux's")
def test_queries_run_on_threads_that_yield_the_cores_to_ingest(make_collector):
    collector = make_collector()
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert collector.query_threads.submit(niceness).result() == min(19, own + QUERY_NICENESS)
    assert niceness() == own  # the request threads, the writer and everything else keep theirs
    status, _, _ = post(collector.url + "/v1/query", b"SELECT 1", "text/plain")
    assert status == 200


def test_a_query_whose_client_left_stops_and_frees_its_slot(make_collector):
    """A client that sends a slow query and hangs up: the query is interrupted within a moment, not at the
    query timeout, so the token's max_queries_per_token slots are free again for its next queries."""
    collector = make_collector(**TOKENS, query_timeout_s=300, max_queries_per_token=2)
    address = (urllib.parse.urlsplit(collector.url).hostname, urllib.parse.urlsplit(collector.url).port)
    for _ in range(2):
        with socket.create_connection(address, timeout=10) as sock:
            sock.sendall(raw_post("/v1/query", SLOW_SQL, {"Content-Type": "text/plain", **bearer("query")}))
            time.sleep(0.5)  # the query is running when the client leaves
    deadline, statuses = time.monotonic() + 30, []
    while time.monotonic() < deadline:
        status, _, _ = post(collector.url + "/v1/query", b"SELECT 1", "text/plain", headers=bearer("query"))
        statuses.append(status)
        if status == 200:
            break
        time.sleep(0.2)
    assert statuses[-1] == 200, statuses  # without the watcher: 429 until the 300 s timeout
