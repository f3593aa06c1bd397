"""Property-based tests of the OTLP decoders: both encodings give the same rows, values survive, and no
input makes a decoder fail with anything but DecodeFailure."""
from __future__ import annotations

import base64
import json
import math

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from lightning_otel.span_store import otlp, otlp_values
from tests.helpers.otlp_json import request_to_json

INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
text = st.text(max_size=20)
scalars = st.one_of(text, st.booleans(), INT64, st.floats(allow_nan=False, allow_infinity=False),
                    st.binary(max_size=8))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(text, inner, max_size=3)), max_leaves=8)
attributes = st.dictionaries(st.text(min_size=1, max_size=30), values, max_size=6)
ids16 = st.binary(min_size=16, max_size=16).filter(any)
ids8 = st.binary(min_size=8, max_size=8).filter(any)
times = st.integers(min_value=0, max_value=2**63 - 1)


def set_value(target: AnyValue, value) -> None:
    if isinstance(value, bool):
        target.bool_value = value
    elif isinstance(value, int):
        target.int_value = value
    elif isinstance(value, float):
        target.double_value = value
    elif isinstance(value, bytes):
        target.bytes_value = value
    elif isinstance(value, str):
        target.string_value = value
    elif isinstance(value, list):
        target.array_value.SetInParent()
        for item in value:
            set_value(target.array_value.values.add(), item)
    else:
        target.kvlist_value.SetInParent()
        for key, item in value.items():
            kv = target.kvlist_value.values.add()
            kv.key = key
            set_value(kv.value, item)


def add_attrs(repeated, attrs: dict) -> None:
    for key, value in attrs.items():
        kv = repeated.add()
        kv.key = key
        set_value(kv.value, value)


def expected_json(value):
    """What a value should look like once stored: bytes as base64, everything else as is."""
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, list):
        return [expected_json(v) for v in value]
    if isinstance(value, dict):
        return {k: expected_json(v) for k, v in value.items()}
    return value


span_st = st.fixed_dictionaries({
    "trace_id": ids16, "span_id": ids8, "parent": st.one_of(st.just(b""), ids8), "name": text,
    "kind": st.integers(0, 5), "start": times, "end": times, "status": st.integers(0, 2), "message": text,
    "attrs": attributes,
    "events": st.lists(st.tuples(times, text, attributes), max_size=2),
    "links": st.lists(st.tuples(ids16, ids8, attributes), max_size=2),
})


@st.composite
def trace_requests(draw):
    request = ExportTraceServiceRequest()
    for _ in range(draw(st.integers(1, 2))):
        rs = request.resource_spans.add()
        add_attrs(rs.resource.attributes, draw(attributes))
        for _ in range(draw(st.integers(1, 2))):
            ss = rs.scope_spans.add()
            ss.scope.name, ss.scope.version = draw(text), draw(text)
            for spec in draw(st.lists(span_st, min_size=1, max_size=3)):
                span = ss.spans.add(trace_id=spec["trace_id"], span_id=spec["span_id"],
                                    parent_span_id=spec["parent"], name=spec["name"], kind=spec["kind"],
                                    start_time_unix_nano=spec["start"], end_time_unix_nano=spec["end"])
                span.status.code, span.status.message = spec["status"], spec["message"]
                add_attrs(span.attributes, spec["attrs"])
                for when, name, attrs in spec["events"]:
                    event = span.events.add(time_unix_nano=when, name=name)
                    add_attrs(event.attributes, attrs)
                for trace_id, span_id, attrs in spec["links"]:
                    link = span.links.add(trace_id=trace_id, span_id=span_id)
                    add_attrs(link.attributes, attrs)
    return request


def rows(decoded: otlp.Decoded) -> list[dict]:
    return sorted(decoded.table.drop_columns(["received_ns"]).to_pylist(), key=lambda r: (r["trace_id"], r["span_id"]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace_requests())
def test_protobuf_and_json_encodings_give_identical_rows(request):
    from_pb = otlp.decode_traces_protobuf(request.SerializeToString())
    from_json = otlp.decode_traces_json(orjson.dumps(request_to_json(request)))
    assert rows(from_pb) == rows(from_json)
    n_spans = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
    assert from_pb.table.num_rows + from_pb.rejected == n_spans


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace_requests())
def test_values_survive_decoding(request):
    decoded = rows(otlp.decode_traces_protobuf(request.SerializeToString()))
    by_id = {(r["trace_id"], r["span_id"]): r for r in decoded}
    ids = [(s.trace_id, s.span_id) for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
    for rs in request.resource_spans:
        for ss in rs.scope_spans:
            for span in ss.spans:
                if ids.count((span.trace_id, span.span_id)) > 1:
                    continue  # the same id twice in one request: one of them is stored, either is right
                row = by_id[(span.trace_id.hex(), span.span_id.hex())]
                assert row["name"] == span.name
                assert row["kind"] == otlp.SPAN_KINDS[span.kind]
                assert row["start_ns"] == span.start_time_unix_nano
                assert row["parent_span_id"] == (span.parent_span_id.hex() or None)
                stored = json.loads(row["attributes"])
                for kv in span.attributes:
                    assert stored[kv.key] == expected_json(otlp_values.pb_value(kv.value))
                assert len(json.loads(row["events"] or "[]")) == len(span.events)
                assert json.loads(row["resource"]) == {kv.key: expected_json(otlp_values.pb_value(kv.value))
                                                       for kv in rs.resource.attributes}


@given(st.dictionaries(st.text(min_size=1, max_size=10), values, max_size=4))
def test_attribute_values_round_trip_through_anyvalue(attrs):
    request = ExportTraceServiceRequest()
    span = request.resource_spans.add().scope_spans.add().spans.add(trace_id=b"\x01" * 16, span_id=b"\x02" * 8)
    add_attrs(span.attributes, attrs)
    row = otlp.decode_traces_protobuf(request.SerializeToString()).table.to_pylist()[0]
    stored = json.loads(row["attributes"])
    assert stored == {k: expected_json(v) for k, v in attrs.items()}


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_never_crash_the_protobuf_decoders(body):
    for decode in (otlp.decode_traces_protobuf, otlp.decode_logs_protobuf):
        try:
            decode(body)
        except otlp.DecodeFailure:
            pass


json_values = st.recursive(st.one_of(st.none(), st.booleans(), INT64, st.floats(allow_nan=False),
                                     st.text(max_size=5)),
                           lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                   st.dictionaries(st.sampled_from(
                                                       ["resourceSpans", "scopeSpans", "spans", "traceId",
                                                        "spanId", "attributes", "key", "value", "stringValue",
                                                        "intValue", "kind", "status", "code", "events",
                                                        "resourceLogs", "scopeLogs", "logRecords", "body",
                                                        "arrayValue", "values", "kvlistValue", "x"]), inner,
                                                       max_size=4)), max_leaves=25)


@settings(max_examples=400, deadline=None)
@given(json_values)
def test_arbitrary_json_never_crashes_the_json_decoders(doc):
    body = orjson.dumps(doc)
    for decode in (otlp.decode_traces_json, otlp.decode_logs_json):
        try:
            decode(body)
        except otlp.DecodeFailure:
            pass


def test_logs_encodings_agree():
    request = ExportLogsServiceRequest()
    rl = request.resource_logs.add()
    add_attrs(rl.resource.attributes, {"service.name": "svc", "lightning.rollout.id": "ro-1"})
    sl = rl.scope_logs.add()
    record = sl.log_records.add(time_unix_nano=5, observed_time_unix_nano=6, severity_number=9,
                                severity_text="INFO", trace_id=b"\x01" * 16, span_id=b"\x02" * 8,
                                event_name="gen_ai.choice")
    set_value(record.body, {"message": {"role": "assistant", "content": "SELECT 1"}})
    add_attrs(record.attributes, {"gen_ai.system": "openai"})
    from_pb = otlp.decode_logs_protobuf(request.SerializeToString()).table.drop_columns(["received_ns"])
    from_json = otlp.decode_logs_json(orjson.dumps(request_to_json(request))).table.drop_columns(["received_ns"])
    assert from_pb.to_pylist() == from_json.to_pylist()
    row = from_pb.to_pylist()[0]
    assert json.loads(row["body"])["message"]["content"] == "SELECT 1"
    assert (row["rollout_id"], row["event_name"], row["span_id"]) == ("ro-1", "gen_ai.choice", "02" * 8)


def test_non_finite_doubles_are_stored_as_null():
    request = ExportTraceServiceRequest()
    span = request.resource_spans.add().scope_spans.add().spans.add(trace_id=b"\x01" * 16, span_id=b"\x02" * 8)
    add_attrs(span.attributes, {"x": math.inf, "y": math.nan, "z": 1.5})
    row = otlp.decode_traces_protobuf(request.SerializeToString()).table.to_pylist()[0]
    assert json.loads(row["attributes"]) == {"x": None, "y": None, "z": 1.5}


def test_the_c_decoder_is_built_and_chosen():
    """CI must notice when the build silently stops producing the optional extension. Deliberately outside
    test_otlp_fast.py, whose tests skip when the extension is missing."""
    import os
    assert otlp._otlp_fast is not None, (  # noqa: SLF001
        "span_store/_otlp_fast.c was not built: check the compiler and the install log")
    assert otlp.FAST_DECODER is (os.environ.get("LIGHTNING_OTEL_PURE_PYTHON", "") != "1")
    if os.environ.get("LIGHTNING_OTEL_FAST_SO"):  # `make test-asan`: the sanitizer build, not the installed one
        assert otlp._otlp_fast.__file__ == os.path.abspath(os.environ["LIGHTNING_OTEL_FAST_SO"])
