"""The collector over real HTTP, fed by the real OTel SDK exporters and by hand-made bad requests."""
from __future__ import annotations

import gzip
import json
import zlib

import orjson
import pytest
from google.rpc import status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest, ExportTraceServiceResponse)

from conftest import health, post
from lightning_otel.errors import UserError
from lightning_otel.span_store import client
from tests.helpers.sdk import chat_span, logger_provider, tracer_provider
from tests.helpers.otlp_json import request_to_json


def count(db, sql="SELECT count(*) AS n FROM spans") -> int:
    return client.query(sql, db)["n"][0]


def sample_request(n: int = 3, seed: int = 1) -> ExportTraceServiceRequest:
    import random
    rng = random.Random(seed)
    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    kv = rs.resource.attributes.add()
    kv.key, kv.value.string_value = "service.name", "svc"
    ss = rs.scope_spans.add()
    ss.scope.name = "test"
    trace_id = rng.randbytes(16)
    for i in range(n):
        span = ss.spans.add(trace_id=trace_id, span_id=rng.randbytes(8), name=f"op{i}", kind=3,
                            start_time_unix_nano=1_700_000_000_000_000_000 + i,
                            end_time_unix_nano=1_700_000_000_000_000_100 + i)
        attr = span.attributes.add()
        attr.key, attr.value.int_value = "gen_ai.usage.input_tokens", 7 + i
    return request


def test_sdk_spans_arrive_with_attributes_and_resource(collector, db_path):
    provider = tracer_provider(collector.url, {"service.name": "agent-a", "lightning.rollout.id": "ro-9",
                                               "lightning.task.id": "t-3", "lightning.attempt": 2})
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("workflow"):
        chat_span(tracer, rollout_id="ro-9", tokens=42)
    provider.shutdown()
    rows = client.query("SELECT * FROM spans ORDER BY start_ns", db_path).to_dicts()
    assert [r["name"] for r in rows] == ["workflow", "openai.chat"]
    chat = rows[1]
    assert chat["parent_span_id"] == rows[0]["span_id"]
    assert chat["kind"] == "CLIENT" and chat["service_name"] == "agent-a"
    assert (chat["rollout_id"], chat["task_id"], chat["attempt"]) == ("ro-9", "t-3", 2)
    assert rows[0]["rollout_id"] == "ro-9"  # from the resource
    assert (chat["operation_name"], chat["request_model"], chat["input_tokens"], chat["output_tokens"]) == \
        ("chat", "gpt-4o", 42, 21)
    assert json.loads(chat["attributes"])["gen_ai.provider.name"] == "openai"
    assert json.loads(chat["resource"])["telemetry.sdk.language"] == "python"
    assert len(chat["trace_id"]) == 32 and len(chat["span_id"]) == 16


def test_gzip_and_json_encodings(collector, db_path):
    provider = tracer_provider(collector.url, gzip=True)
    chat_span(provider.get_tracer("t"), rollout_id="gz")
    provider.shutdown()
    body = request_to_json(sample_request(4, seed=2))
    status, headers, raw = post(collector.url + "/v1/traces", json.dumps(body).encode(), "application/json")
    assert status == 200 and headers["Content-Type"] == "application/json"
    assert json.loads(raw) == {}
    deflated = zlib.compress(sample_request(2, seed=3).SerializeToString())
    status, _, _ = post(collector.url + "/v1/traces", deflated, headers={"Content-Encoding": "deflate"})
    assert status == 200
    assert count(db_path) == 1 + 4 + 2


def test_logs_from_the_sdk(collector, db_path):
    import logging
    from opentelemetry.sdk._logs import LoggingHandler
    provider = logger_provider(collector.url, {"service.name": "agent-logs", "lightning.rollout.id": "ro-l"})
    logger = logging.getLogger("test-logs")
    logger.addHandler(LoggingHandler(logger_provider=provider))
    logger.warning("tool %s failed", "execute_sql")
    provider.shutdown()
    rows = client.query("SELECT * FROM logs", db_path).to_dicts()
    assert len(rows) == 1
    assert json.loads(rows[0]["body"]) == "tool execute_sql failed"
    assert rows[0]["severity_text"] == "WARN" or rows[0]["severity_number"] == 13
    assert rows[0]["rollout_id"] == "ro-l" and rows[0]["service_name"] == "agent-logs"


def test_same_spans_resent_in_either_encoding_are_stored_once(collector, db_path):
    request = sample_request(5, seed=4)
    for _ in range(2):
        assert post(collector.url + "/v1/traces", request.SerializeToString())[0] == 200
    assert post(collector.url + "/v1/traces", json.dumps(request_to_json(request)).encode(),
                "application/json")[0] == 200
    gz = gzip.compress(request.SerializeToString())
    assert post(collector.url + "/v1/traces", gz, headers={"Content-Encoding": "gzip"})[0] == 200
    assert count(db_path) == 5
    assert count(db_path, "SELECT count(DISTINCT attributes) AS n FROM spans") == 5


@pytest.mark.parametrize("body,content_type,status,needle", [
    (b"\xff\xff\xff\x00garbage", "application/x-protobuf", 400, "protobuf"),
    (b"{not json", "application/json", 400, "JSON"),
    (b"[1, 2]", "application/json", 400, "JSON object"),
    (b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": 5}]}]}]}', "application/json", 400, "hex"),
    (b'{"resourceSpans": "x"}', "application/json", 400, "list"),
    (b"hello", "text/plain", 415, "application/x-protobuf"),
    (b"hello", "", 415, "Content-Type"),
])
@pytest.mark.heavy
def test_malformed_requests_are_refused_and_nothing_is_stored(collector, db_path, body, content_type, status,
                                                              needle):
    code, headers, raw = post(collector.url + "/v1/traces", body, content_type)
    assert code == status
    if headers.get("Content-Type") == "application/x-protobuf":
        message = status_pb2.Status.FromString(raw).message
    else:
        message = json.loads(raw)["message"]
    assert needle in message
    assert count(db_path) == 0
    # The connection handling survived: a good request still works.
    assert post(collector.url + "/v1/traces", sample_request(1).SerializeToString())[0] == 200


def test_a_bad_span_among_good_ones_gives_partial_success(collector, db_path):
    request = sample_request(3, seed=5)
    request.resource_spans[0].scope_spans[0].spans[1].span_id = b""
    status, _, raw = post(collector.url + "/v1/traces", request.SerializeToString())
    assert status == 200
    response = ExportTraceServiceResponse.FromString(raw)
    assert response.partial_success.rejected_spans == 1
    assert "span id" in response.partial_success.error_message
    assert count(db_path) == 2
    doc = request_to_json(sample_request(2, seed=6))
    doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["traceId"] = "00" * 16
    status, _, raw = post(collector.url + "/v1/traces", orjson.dumps(doc), "application/json")
    assert status == 200 and json.loads(raw)["partialSuccess"]["rejectedSpans"] == "1"


def test_unknown_paths_and_methods(collector):
    assert post(collector.url + "/v1/metrics", b"x")[0] == 404
    assert post(collector.url + "/nope", b"x")[0] == 404
    assert post(collector.url + "/v1/traces", b"x", method="PUT")[0] == 405
    status, _, raw = post(collector.url + "/v1/traces", b"", method="GET")
    assert status == 405
    assert health(collector.url)["status"] == "ok"


def test_oversized_bodies_get_413(make_collector, db_path):
    collector = make_collector(max_body_bytes=64 * 1024)
    big = sample_request(1)
    big.resource_spans[0].scope_spans[0].spans[0].name = "x" * (100 * 1024)
    status, _, raw = post(collector.url + "/v1/traces", big.SerializeToString())
    assert status == 413 and b"limit" in raw
    # Small on the wire, too big once inflated: still refused.
    status, _, _ = post(collector.url + "/v1/traces", gzip.compress(big.SerializeToString()),
                        headers={"Content-Encoding": "gzip"})
    assert status == 413
    status, _, _ = post(collector.url + "/v1/traces", b"\x1f\x8b not gzip", headers={"Content-Encoding": "gzip"})
    assert status == 400
    assert count(db_path) == 0


def test_token_is_required_for_ingest_and_queries(make_collector, db_path):
    collector = make_collector(token="s3cret")
    body = sample_request(2).SerializeToString()
    assert post(collector.url + "/v1/traces", body)[0] == 401
    assert post(collector.url + "/v1/traces", body, headers={"Authorization": "Bearer wrong"})[0] == 401
    assert post(collector.url + "/v1/query", b"SELECT 1", "text/plain")[0] == 401
    provider = tracer_provider(collector.url, token="s3cret")
    chat_span(provider.get_tracer("t"))
    provider.shutdown()
    # The CLI and the Python API find the token in <db>.collector.json.
    assert count(db_path) == 1


def test_second_collector_on_the_same_file_names_the_holder(collector, db_path):
    with pytest.raises(UserError, match=f"pid {collector.info.pid}"):
        from lightning_otel.span_store.collector import Collector, CollectorConfig
        Collector(CollectorConfig(db=db_path, port=0))


def test_a_batch_mixing_stored_and_new_spans_keeps_the_new_ones(collector, db_path):
    first = sample_request(3, seed=40)
    assert post(collector.url + "/v1/traces", first.SerializeToString())[0] == 200
    mixed = sample_request(2, seed=41)
    mixed.resource_spans[0].scope_spans[0].spans.extend(first.resource_spans[0].scope_spans[0].spans)
    assert post(collector.url + "/v1/traces", mixed.SerializeToString())[0] == 200
    assert count(db_path) == 5
