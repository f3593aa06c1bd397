"""Forwarding (`collect --forward URL`): every committed OTLP body goes on to another OTLP/HTTP endpoint, in the
background. The endpoints here are real HTTP servers on 127.0.0.1: a second collector, small servers that fail
in the ways endpoints do (down, busy, refusing, hanging), and a real Phoenix (`phoenix serve`, from the
.venv-phoenix that `make test` builds). Ingest never waits on them and never loses a span to them."""
from __future__ import annotations

import gzip
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from lightning_otel.errors import UserError
from lightning_otel.span_store import client
from lightning_otel.span_store.forwarding import ForwardConfig, parse_headers
from lightning_otel.span_store.tour import sample_requests
from tests.conftest import REPO, health, post
from tests.helpers.loopback import LoopbackServer, QuietHandler
from tests.helpers.phoenix import running_phoenix, wait_for
from tests.helpers.sdk import chat_span, tracer_provider


class Endpoint:
    """An OTLP/HTTP endpoint on 127.0.0.1 that answers each POST with the next of `answers` (the last one
    repeats): an int status, or "hang" (reads the body and never answers). Keeps the bodies it accepted."""

    def __init__(self, answers: list):
        self.answers, self.received, self.requests, self.headers = list(answers), [], 0, []
        self.release = threading.Event()
        outer = self

        class Handler(QuietHandler):
            def do_POST(self):  # noqa: N802
                body = self.body()
                outer.requests += 1
                outer.headers.append(dict(self.headers))
                answer = outer.answers.pop(0) if len(outer.answers) > 1 else outer.answers[0]
                if answer == "hang":
                    outer.release.wait(60)
                    return
                if answer == 200:
                    data = gzip.decompress(body) if self.headers.get("Content-Encoding") == "gzip" else body
                    outer.received.append((self.path, self.headers["Content-Type"], data))
                self.answer(answer, headers={"Retry-After": "0"})

        self.server = LoopbackServer(Handler)
        self.url = self.server.url

    def close(self):
        self.release.set()
        self.server.close()


@pytest.fixture
def endpoint():
    started = []

    def start(*answers):
        started.append(Endpoint(list(answers)))
        return started[-1]

    yield start
    for e in started:
        e.close()


def send_spans(url: str, n: int, rollout_id: str = "ro-fwd") -> None:
    provider = tracer_provider(url, max_batch=1)
    tracer = provider.get_tracer("forwarding-test")
    for i in range(n):
        chat_span(tracer, rollout_id, question=f"question {i}")
        provider.force_flush()
    provider.shutdown()


def stored(db: Path) -> int:
    return client.query("SELECT count(*) AS n FROM spans", db)["n"][0]


def test_every_committed_body_reaches_another_collector(make_collector, tmp_path):
    downstream = make_collector(db=tmp_path / "downstream.duckdb")
    upstream = make_collector(forward=ForwardConfig(downstream.url + "/v1/traces"))  # a full /v1/traces URL works
    send_spans(upstream.url, 5)
    stats = wait_for(lambda: (s := health(upstream.url)["forwarding"])["sent"] == 5 and s)
    assert stats["dropped"] == stats["rejected"] == 0 and stats["sent_rows"] == 5 and stats["queued"] == 0
    mine = client.query("SELECT trace_id, span_id, name, attributes FROM spans ORDER BY span_id", upstream.db)
    theirs = client.query("SELECT trace_id, span_id, name, attributes FROM spans ORDER BY span_id", downstream.db)
    assert mine.height == 5 and mine.equals(theirs)


def test_json_bodies_and_logs_arrive_whole_as_protobuf_with_the_given_headers(make_collector, endpoint, tmp_path):
    # The recorded traces of real agents, sent as OTLP/JSON: forwarded as protobuf (what every receiver takes),
    # and a collector downstream stores exactly the rows this one stored.
    downstream = make_collector(db=tmp_path / "downstream.duckdb")
    upstream = make_collector(forward=ForwardConfig(downstream.url))
    bodies = list(sample_requests())
    assert {"/v1/logs", "/v1/traces"} == {p for p, _ in bodies}
    for path, body in bodies:
        assert post(upstream.url + path, body, "application/json")[0] == 200
    wait_for(lambda: health(upstream.url)["forwarding"]["sent"] == len(bodies))
    for table in ("spans", "logs"):
        sql = f"SELECT * EXCLUDE (received_ns) FROM {table} ORDER BY ALL"
        mine, theirs = client.query(sql, upstream.db), client.query(sql, downstream.db)
        assert mine.height >= 2 and mine.equals(theirs), table

    target = endpoint(200)
    upstream = make_collector(db=tmp_path / "b.duckdb",
                              forward=ForwardConfig(target.url, {"Authorization": "Basic a2V5OnNlY3JldA=="}))
    assert post(upstream.url + bodies[0][0], bodies[0][1], "application/json")[0] == 200
    wait_for(lambda: target.received)
    (path, content_type, _), = target.received
    assert path == bodies[0][0] and content_type == "application/x-protobuf"
    assert target.headers[0]["Authorization"] == "Basic a2V5OnNlY3JldA=="
    assert target.headers[0]["Content-Encoding"] == "gzip"


def test_a_busy_endpoint_is_retried_and_a_refusing_one_is_not(make_collector, endpoint, tmp_path):
    busy = endpoint(503, 429, 200)
    upstream = make_collector(forward=ForwardConfig(busy.url))
    send_spans(upstream.url, 1)
    stats = wait_for(lambda: (s := health(upstream.url)["forwarding"])["sent"] == 1 and s)
    assert stats["retries"] == 2 and busy.requests == 3
    (path, _, body), = busy.received
    assert path == "/v1/traces" and len(ExportTraceServiceRequest.FromString(body).resource_spans) == 1

    refusing = endpoint(400)
    upstream = make_collector(db=tmp_path / "b.duckdb", forward=ForwardConfig(refusing.url))
    send_spans(upstream.url, 2)
    stats = wait_for(lambda: (s := health(upstream.url)["forwarding"])["rejected"] == 2 and s)
    assert stats["retries"] == 0 and refusing.requests == 2 and "HTTP 400" in stats["last_error"]
    assert stored(upstream.db) == 2


@pytest.mark.heavy
def test_a_hanging_endpoint_never_slows_ingest_and_the_overflow_is_counted(make_collector, endpoint):
    hanging = endpoint("hang")
    upstream = make_collector(forward=ForwardConfig(hanging.url, max_queue_bytes=2048, timeout_s=30))
    started = time.monotonic()
    send_spans(upstream.url, 20)  # one body per span, ~400 bytes each: the queue holds a few
    took = time.monotonic() - started
    stats = health(upstream.url)["forwarding"]
    assert stored(upstream.db) == 20  # every span acknowledged is stored
    assert stats["sent"] == 0 and stats["dropped"] >= 10 and stats["dropped"] + stats["queued"] + 1 >= 20
    assert took < 20, f"ingest waited on the endpoint ({took:.1f} s for 20 spans)"
    hanging.release.set()


def test_an_endpoint_that_stays_down_costs_nothing_and_closing_counts_what_never_went(make_collector, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens once the socket is closed
    upstream = make_collector(forward=ForwardConfig(dead, max_retry_s=600, flush_s=0.5))
    send_spans(upstream.url, 3)
    stats = wait_for(lambda: (s := health(upstream.url)["forwarding"])["retries"] >= 1 and s)
    assert stats["sent"] == 0 and ("Connection" in stats["last_error"] or "refused" in stats["last_error"])
    forwarder = upstream.forwarder
    started = time.monotonic()
    upstream.close()
    assert time.monotonic() - started < 10
    assert forwarder.counts["dropped"] == 3 and forwarder.counts["dropped_rows"] == 3
    assert client.query("SELECT count(*) AS n FROM spans", upstream.db)["n"][0] == 3  # from the closed file


@pytest.mark.parametrize("url, headers, message", [
    ("phoenix:6006", {}, "is not an http(s) URL"),
    ("ftp://host/v1/traces", {}, "is not an http(s) URL"),
    ("http://host", {"Bad: name": "x"}, "a header name without ':'"),
    ("http://host", {"X-Key": "a\r\nInjected: yes"}, "no line breaks"),
])
def test_bad_forward_settings_are_refused(url, headers, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ForwardConfig(url, headers)


def test_forward_flags_parse_and_the_url_base_is_kept():
    assert parse_headers(["Authorization=Basic a=b=", "x-tenant=7"]) == {"Authorization": "Basic a=b=",
                                                                         "x-tenant": "7"}
    with pytest.raises(UserError, match="NAME=VALUE"):
        parse_headers(["Authorization"])
    config = ForwardConfig("https://cloud.langfuse.com/api/public/otel/")
    assert config.endpoint("traces") == "https://cloud.langfuse.com/api/public/otel/v1/traces"
    assert ForwardConfig("http://h:4318/v1/logs").endpoint("logs") == "http://h:4318/v1/logs"
    result = subprocess.run([str(REPO / ".venv" / "bin" / "lightning-otel"), "collect", "--db", "x.duckdb",
                             "--forward-header", "A=b"], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "--forward-header is for --forward" in result.stderr


@pytest.mark.heavy
def test_recorded_rollouts_reach_a_real_phoenix_and_killing_it_loses_no_local_span(collector_process, tmp_path):
    with running_phoenix(tmp_path) as phoenix:
        collector = collector_process("--forward", phoenix.url, "--forward-retry-s", "600")
        # The recorded traces of real agents (LangGraph, CrewAI, AutoGen, the OpenAI SDK), as they came.
        traces = [(p, b) for p, b in sample_requests() if p == "/v1/traces"]
        for path, body in traces:
            assert post(collector.url + path, body, "application/json")[0] == 200
        local = stored(collector.db)
        wait_for(lambda: health(collector.url)["forwarding"]["sent"] == len(traces), timeout=60,
                 detail=lambda: health(collector.url)["forwarding"])
        spans = wait_for(lambda: (s := phoenix.spans()) and len(s) == local and s, timeout=60,
                         detail=lambda: f"{len(phoenix.spans())} of {local} spans in Phoenix")
        mine = client.query("SELECT span_id FROM spans", collector.db)["span_id"].to_list()
        assert sorted(s["context"]["span_id"] for s in spans) == sorted(mine)

        phoenix.kill()  # Phoenix dies mid-run; the agents go on sending
        send_spans(collector.url, 5, rollout_id="ro-after-phoenix")
        assert stored(collector.db) == local + 5
        stats = wait_for(lambda: (s := health(collector.url)["forwarding"])["retries"] >= 1 and s)
        assert stats["sent"] == len(traces) and stats["queued"] >= 1
        assert collector.stop() == 0
        assert stored(collector.db) == local + 5
