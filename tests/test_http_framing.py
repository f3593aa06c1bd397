"""Request framing (RFC 9112 section 6) on the real servers over raw sockets: the collector, and the gateway's
real server in front of a stand-in engine (framing is refused before any route, so the engine is never asked).
Each refused request carries a second, smuggled request after it: neither server may answer or run it."""
from __future__ import annotations

import itertools
import re
import socket
import urllib.parse
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_otel.httpserver import ConnectionLimits
from lightning_otel.serve.gateway import Gateway, GatewayConfig
from lightning_otel.span_store import client
from test_collector_http import sample_request
from test_slow_clients import StandInEngine

LIMITS = ConnectionLimits(read_timeout_s=2, request_timeout_s=5, idle_timeout_s=0.5)
SPANS = sample_request(2, seed=7).SerializeToString()
# What a proxy in front would take for a second request of its own, were the server to read it.
SMUGGLED = {"collector": b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                         b"Content-Length: " + str(len(SPANS)).encode() + b"\r\n\r\n" + SPANS,
            "gateway": b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"}
ROUTE = {"collector": b"POST /v1/traces", "gateway": b"POST /v1/chat/completions"}


@dataclass
class Served:
    kind: str
    url: str

    def exchange(self, raw: bytes) -> tuple[list[bytes], bool]:
        """Send `raw`, read until the server closes (or goes quiet): (each answer's status line, closed)."""
        parts = urllib.parse.urlsplit(self.url)
        with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
            sock.sendall(raw)
            received, closed = b"", False
            try:
                while piece := sock.recv(1 << 16):
                    received += piece
                closed = True
            except (TimeoutError, ConnectionResetError):
                pass
        return re.findall(rb"HTTP/1\.1 \d{3}[^\r]*", received), closed


@pytest.fixture(params=["collector", "gateway"])
def served(request, make_collector):
    if request.param == "collector":
        yield Served("collector", make_collector(connection_limits=LIMITS).url)
        return
    gateway = Gateway(StandInEngine(), GatewayConfig(connection_limits=LIMITS))
    gateway.start()
    yield Served("gateway", gateway.url)
    gateway.close()


def request(route: bytes, *headers: bytes, body: bytes = SPANS) -> bytes:
    head = route + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
    return head + b"".join(h + b"\r\n" for h in headers) + b"\r\n" + body


def stored_spans(db) -> int:
    return client.query("SELECT count(*) AS n FROM spans", db)["n"][0]


LENGTH = str(len(SPANS)).encode()
REFUSED = {
    "two different lengths": ([b"Content-Length: " + LENGTH, b"Content-Length: 5"], 400),
    "the same length twice": ([b"Content-Length: " + LENGTH, b"Content-Length: " + LENGTH], 400),
    "a list in one field": ([b"Content-Length: " + LENGTH + b", " + LENGTH], 400),
    "a plus sign": ([b"Content-Length: +" + LENGTH], 400),
    "a negative length": ([b"Content-Length: -1"], 400),
    "an underscore": ([b"Content-Length: 1_0"], 400),
    "a non-ASCII digit": (["Content-Length: \u0663".encode()], 400),
    "a folded value": ([b"Content-Length:", b" " + LENGTH], 400),
    "hex": ([b"Content-Length: 0x10"], 400),
    "chunked with a length": ([b"Transfer-Encoding: chunked", b"Content-Length: " + LENGTH], 400),
    "a length with chunked": ([b"Content-Length: " + LENGTH, b"Transfer-Encoding: chunked"], 400),
    "chunked": ([b"Transfer-Encoding: chunked"], 411),
    "another coding": ([b"Transfer-Encoding: gzip"], 411),
    "codings in two fields": ([b"Transfer-Encoding: gzip", b"Transfer-Encoding: chunked"], 411),
}


@pytest.mark.heavy
@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_ambiguous_framing_is_refused_and_the_connection_closed(served, case, db_path):
    headers, status = REFUSED[case]
    body = b"10\r\n" + SPANS[:16] + b"\r\n0\r\n\r\n" if any(b"chunked" in h for h in headers) else SPANS
    answers, closed = served.exchange(request(ROUTE[served.kind], *headers, body=body) + SMUGGLED[served.kind])
    assert len(answers) == 1 and answers[0].startswith(b"HTTP/1.1 %d " % status), answers
    assert closed, "the connection must close after a framing refusal"
    if served.kind == "collector":
        assert stored_spans(db_path) == 0


def test_a_body_the_route_does_not_read_is_never_taken_for_a_request(served, db_path):
    """GET routes read no body: a GET that declares one must close the connection, not parse it as a request."""
    smuggled = SMUGGLED[served.kind]
    raw = b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(smuggled) + smuggled
    answers, closed = served.exchange(raw)
    assert len(answers) == 1 and answers[0].startswith(b"HTTP/1.1 200 "), answers
    assert closed
    if served.kind == "collector":
        assert stored_spans(db_path) == 0


def _lengths(n: int):
    """Content-Length values around the right one: plain ones (leading zeros included) and near misses."""
    text = str(n)
    good = st.sampled_from([text, "0" + text, "00" + text, text + " ", text + "\t"])  # OWS after is allowed
    bad = st.sampled_from(["+" + text, "-" + text, text + "_0", text[:1] + "_" + text[1:], text + ".0", "0x" + text,
                           text + " " + text, "\u0663", "\uff11" + text, text + "\u00a0", "", "1e3", text + ";"])
    return st.one_of(good, bad)


SEEDS = itertools.count(1000)
CODINGS = st.sampled_from(["chunked", "Chunked", "gzip", "gzip, chunked", "identity", "chunked, chunked", " chunked"])


def expected_status(lengths: list[str], codings: list[str]) -> int:
    """What RFC 9112 section 6 and this project's choices (docs/store.md) say the collector answers."""
    if codings:
        return 400 if lengths else 411
    if not lengths:
        return 411  # the collector needs a length
    if len(lengths) > 1:
        return 400
    value = lengths[0].rstrip(" \t")
    return 200 if value and all(c in "0123456789" for c in value) else 400


@pytest.mark.heavy
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_lengths(len(SPANS)), max_size=3), st.lists(CODINGS, max_size=2), st.randoms())
def test_generated_framing_headers_get_the_rfc_answer(make_collector, db_path, lengths, codings, rng):
    collector = getattr(test_generated_framing_headers_get_the_rfc_answer, "collector", None)
    if collector is None or collector.db != db_path.absolute():
        collector = make_collector(connection_limits=LIMITS)
        test_generated_framing_headers_get_the_rfc_answer.collector = collector
    headers = [b"Content-Length: " + v.encode() for v in lengths] + [b"Transfer-Encoding: " + c.encode()
                                                                      for c in codings]
    rng.shuffle(headers)
    # Spans never sent before, in the body and in the request after it: what is stored tells what was read.
    body, smuggled = (sample_request(2, seed=next(SEEDS)).SerializeToString() for _ in range(2))
    assert len(body) == len(smuggled) == len(SPANS)
    smuggled = SMUGGLED["collector"].replace(SPANS, smuggled)
    before = stored_spans(db_path)
    expected = expected_status(lengths, codings)
    answers, closed = Served("collector", collector.url).exchange(
        request(b"POST /v1/traces", *headers, body=body) + smuggled)
    assert answers and answers[0].startswith(b"HTTP/1.1 %d " % expected), (headers, answers)
    if expected != 200:
        assert len(answers) == 1 and closed, (headers, answers)
        assert stored_spans(db_path) == before
    else:
        assert len(answers) == 2 and stored_spans(db_path) == before + 4
