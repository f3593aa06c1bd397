"""Strict decoding of OTLP bodies, over a real collector on 127.0.0.1: every gzip member is stored and bytes after
a compressed stream are refused, ids are what the OTLP specification allows, values nest at most
otlp_values.MAX_VALUE_DEPTH levels. After every probe a good request still commits and the store holds exactly the
spans the collector acknowledged (Store.check)."""
from __future__ import annotations

import gzip
import json
import os
import time
import zlib
from unittest import mock

import pytest
from google.rpc import status_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest, ExportTraceServiceResponse)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from conftest import post
from lightning_otel.span_store import client, otlp, otlp_values
from lightning_otel.span_store.collector import Collector, CollectorConfig
from tests.helpers.otlp_json import request_to_json

PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DEPTH = otlp_values.MAX_VALUE_DEPTH


class Store:
    """A real collector and the spans it acknowledged."""

    def __init__(self, url: str, db):
        self.url, self.db = url, db
        self.acked: set[tuple[str, str]] = set()

    @staticmethod
    def request(n: int) -> ExportTraceServiceRequest:
        """n spans with fresh random ids."""
        request = ExportTraceServiceRequest()
        spans = request.resource_spans.add().scope_spans.add().spans
        for i in range(n):
            spans.add(trace_id=os.urandom(15) + b"\x01", span_id=os.urandom(7) + b"\x01", name=f"op{i}")
        return request

    def send(self, body: bytes, content_type: str = "application/x-protobuf", encoding: str = "",
             signal: str = "traces") -> tuple[int, str, bytes]:
        """POST; (status, the error message or '', the raw answer)."""
        headers = {"Content-Encoding": encoding} if encoding else {}
        status, answer_headers, raw = post(f"{self.url}/v1/{signal}", body, content_type, headers)
        assert status < 500, raw
        if status == 200:
            return status, "", raw
        if answer_headers.get("Content-Type") == "application/x-protobuf":
            return status, status_pb2.Status.FromString(raw).message, raw
        return status, json.loads(raw)["message"], raw

    def acknowledge(self, *requests: ExportTraceServiceRequest) -> None:
        for request in requests:
            self.acked |= {(s.trace_id.hex(), s.span_id.hex()) for rs in request.resource_spans
                           for ss in rs.scope_spans for s in ss.spans}

    def check(self) -> None:
        good = self.request(2)
        assert self.send(good.SerializeToString())[0] == 200
        self.acknowledge(good)
        stored = client.query("SELECT trace_id, span_id FROM spans", self.db).rows()
        assert len(stored) == len(set(stored)) and set(stored) == self.acked


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One collector for the whole file (starting one per test would take most of its time)."""
    db = tmp_path_factory.mktemp("strict") / "traces.duckdb"
    collector = Collector(CollectorConfig(db=db, port=0))
    collector.start()
    yield Store(collector.url, db)
    collector.close()


# ---- compressed bodies ---------------------------------------------------------------------------------

def gzip_members(data: bytes, cuts: list[int]) -> bytes:
    """data split at `cuts` (repeats give empty members), each part a gzip member of its own."""
    points = [0, *sorted(cuts), len(data)]
    return b"".join(gzip.compress(data[a:b]) for a, b in zip(points, points[1:]))


def test_every_gzip_member_is_stored(store):
    # Two requests back to back are one request (protobuf concatenation merges), as their members are one body.
    first, second = store.request(3), store.request(4)
    body = gzip.compress(first.SerializeToString()) + gzip.compress(second.SerializeToString())
    assert store.send(body, encoding="gzip")[0] == 200
    store.acknowledge(first, second)
    store.check()


def test_a_body_of_many_tiny_members_is_read_in_linear_time(store):
    # zlib copies what follows a member's end; handing it the whole rest each time took minutes here.
    request = store.request(3)
    raw = request.SerializeToString()
    body = gzip.compress(raw[:5]) + gzip.compress(b"") * 100_000 + gzip.compress(raw[5:])
    started = time.monotonic()
    assert store.send(body, encoding="gzip")[0] == 200
    assert time.monotonic() - started < 10
    store.acknowledge(request)
    store.check()


@pytest.mark.parametrize("encoding,compress,tail,needle", [
    ("gzip", gzip.compress, b"trailing garbage", "not another gzip member"),
    ("gzip", gzip.compress, b"\0\0\0\0", "not another gzip member"),
    ("gzip", gzip.compress, gzip.compress(b"cut", mtime=0)[:-3], "truncated"),
    ("deflate", zlib.compress, b"x", "follow the end of the deflate"),
    ("deflate", zlib.compress, zlib.compress(b"a second stream"), "follow the end of the deflate"),
])
def test_bytes_after_the_compressed_stream_are_refused(store, encoding, compress, tail, needle):
    request = store.request(2)
    status, message, _ = store.send(compress(request.SerializeToString()) + tail, encoding=encoding)
    assert status == 400 and needle in message
    store.check()


def test_the_decompressed_size_limit_covers_every_member(make_collector, db_path):
    store = Store(make_collector(max_body_bytes=4096).url, db_path)
    body = json.dumps(request_to_json(store.request(1))).encode() + b" " * 5000
    compressed = gzip_members(body, [len(body) // 2])
    assert len(compressed) < 4096
    status, message, _ = store.send(compressed, "application/json", "gzip")
    assert status == 413 and "4096-byte limit once decompressed" in message
    store.check()


@PROPERTY
@given(data=st.data())
def test_compressed_bodies(store, data):
    request = store.request(data.draw(st.integers(1, 4)))
    as_json = data.draw(st.booleans())
    raw = json.dumps(request_to_json(request)).encode() if as_json else request.SerializeToString()
    encoding = data.draw(st.sampled_from(["gzip", "deflate"]))
    if encoding == "gzip":
        body = gzip_members(raw, data.draw(st.lists(st.integers(0, len(raw)), max_size=6)))
    else:
        body = zlib.compress(raw, data.draw(st.integers(0, 9)))
    tail = data.draw(st.one_of(st.just(b""), st.binary(min_size=1, max_size=24)))
    status, _, _ = store.send(body + tail, "application/json" if as_json else "application/x-protobuf", encoding)
    if tail:
        assert status == 400
    else:
        assert status == 200
        store.acknowledge(request)
    store.check()


# ---- ids -----------------------------------------------------------------------------------------------

def hex_ids(n_hex: int):
    """Valid ids as text, in either case."""
    return st.tuples(st.binary(min_size=n_hex // 2, max_size=n_hex // 2).filter(any), st.booleans()).map(
        lambda pair: pair[0].hex().upper() if pair[1] else pair[0].hex())


def broken_ids(n_hex: int):
    """Texts that int(text, 16) or a loose check would take, or of a wrong length, or all zero."""
    return hex_ids(n_hex).flatmap(lambda h: st.sampled_from([
        "+" + h[1:], "-" + h[1:], " " + h[1:], h[1:] + "\n", "0x" + h[2:], h[:4] + "_" + h[5:],
        h[:-1] + "\u0661", "\uff11" + h[1:], "0" * n_hex, h[:-2], h + "00", h[:-1] + "g", ""]))


def id_texts(n_hex: int, may_be_empty: bool = False):
    return st.one_of(hex_ids(n_hex), broken_ids(n_hex), *([st.just("")] if may_be_empty else []))


def valid(text: str, n_hex: int, may_be_empty: bool = False) -> bool:
    if may_be_empty and text == "":
        return True
    return len(text) == n_hex and all(c in "0123456789abcdefABCDEF" for c in text) and text.strip("0") != ""


def as_bytes(text: str) -> bytes | None:
    """The protobuf form of an id text, when it has one (hex digits, even length)."""
    if len(text) % 2 or not all(c in "0123456789abcdefABCDEF" for c in text):
        return None
    return bytes.fromhex(text)


def span_json(trace_id: str, span_id: str, parent: str = "", links=(), name: str = "s") -> dict:
    return {"traceId": trace_id, "spanId": span_id, "parentSpanId": parent, "name": name,
            "links": [{"traceId": t, "spanId": s} for t, s in links]}


def traces_json(*spans: dict) -> bytes:
    return json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": list(spans)}]}]}).encode()


def decode_all_protobuf(body: bytes) -> list:
    """The Python decoder's outcome, and the C decoder's when it is built (they must agree)."""
    outcomes = [otlp.decode_traces_protobuf_python(body)]
    if otlp._otlp_fast is not None:  # noqa: SLF001
        with mock.patch.object(otlp, "FAST_DECODER", True):
            outcomes.append(otlp.decode_traces_protobuf(body))
    return outcomes


def rows(decoded: otlp.Decoded) -> list[dict]:
    return decoded.table.drop_columns(["received_ns"]).to_pylist()


@pytest.mark.parametrize("field,text", [
    ("traceId", "+" + "1" * 31), ("traceId", " " + "1" * 31), ("traceId", "0x" + "1" * 30),
    ("traceId", "1_" + "1" * 30), ("traceId", "\u0661" * 32), ("spanId", "-" + "2" * 15),
    ("parentSpanId", "0" * 16), ("parentSpanId", "0x" + "3" * 14), ("parentSpanId", "3" * 15),
    ("link traceId", "0" * 32), ("link spanId", "+" + "4" * 15), ("link spanId", ""),
])
def test_an_invalid_id_rejects_its_span_alone(store, field, text):
    good = store.request(2)
    spans = request_to_json(good)["resourceSpans"][0]["scopeSpans"][0]["spans"]
    bad = span_json("1" * 32, "2" * 16, links=[("1" * 32, "2" * 16)], name="bad")
    if field.startswith("link "):
        bad["links"][0][field.removeprefix("link ")] = text
    else:
        bad[field] = text
    status, _, raw = store.send(traces_json(*spans, bad), "application/json")
    partial = json.loads(raw)["partialSuccess"]
    what = {"traceId": "trace id", "spanId": "span id", "parentSpanId": "parent span id"}
    assert status == 200 and partial["rejectedSpans"] == "1"
    assert partial["errorMessage"].startswith(f"span 'bad': {what.get(field, field.replace('Id', ' id'))} ")
    store.acknowledge(good)
    store.check()


@pytest.mark.parametrize("change", ["parent", "parent zero", "link trace", "link span zero"])
def test_protobuf_ids_are_checked_alike_by_both_decoders(store, change):
    request = store.request(3)
    span = request.resource_spans[0].scope_spans[0].spans[1]
    link = span.links.add(trace_id=b"\x01" * 16, span_id=b"\x02" * 8)
    if change == "parent":
        span.parent_span_id = b"\x03" * 7
    elif change == "parent zero":
        span.parent_span_id = b"\x00" * 8
    elif change == "link trace":
        link.trace_id = b"\x01" * 15
    else:
        link.span_id = b"\x00" * 8
    outcomes = decode_all_protobuf(request.SerializeToString())
    assert [(len(rows(d)), d.rejected, d.errors) for d in outcomes] == [(2, 1, outcomes[0].errors)] * len(outcomes)
    assert outcomes[0].errors[0].startswith("span 'op1': ")
    status, _, raw = store.send(request.SerializeToString())
    assert status == 200 and ExportTraceServiceResponse.FromString(raw).partial_success.rejected_spans == 1
    del request.resource_spans[0].scope_spans[0].spans[1]
    store.acknowledge(request)
    store.check()


def test_log_record_ids_may_be_empty_but_not_invalid(store):
    records = [{"timeUnixNano": "1001", "body": {"stringValue": "no ids"}},
               {"timeUnixNano": "1002", "traceId": "1" * 32, "spanId": "2" * 16},
               {"timeUnixNano": "1003", "traceId": "0x" + "1" * 30},
               {"timeUnixNano": "1004", "traceId": "1" * 32, "spanId": "0" * 16}]
    body = json.dumps({"resourceLogs": [{"scopeLogs": [{"logRecords": records}]}]}).encode()
    status, _, raw = store.send(body, "application/json", signal="logs")
    assert status == 200 and json.loads(raw)["partialSuccess"]["rejectedLogRecords"] == "2"
    request = ExportLogsServiceRequest()
    logs = request.resource_logs.add().scope_logs.add().log_records
    logs.add(time_unix_nano=1005, trace_id=b"\x01" * 16, span_id=b"\x02" * 7)
    logs.add(time_unix_nano=1006, trace_id=b"\x01" * 16, span_id=b"\x02" * 8)
    status, _, _ = store.send(request.SerializeToString(), signal="logs")
    assert status == 200
    stored = client.query("SELECT time_ns, trace_id, span_id FROM logs WHERE time_ns > 1000 ORDER BY time_ns",
                          store.db).rows()
    assert stored == [(1001, None, None), (1002, "1" * 32, "2" * 16), (1006, "01" * 16, "02" * 8)]
    store.check()


@PROPERTY
@given(trace_id=id_texts(32), span_id=id_texts(16), parent=id_texts(16, may_be_empty=True),
       links=st.lists(st.tuples(id_texts(32), id_texts(16)), max_size=2))
def test_ids(store, trace_id, span_id, parent, links):
    expect_valid = (valid(trace_id, 32) and valid(span_id, 16) and valid(parent, 16, True)
                    and all(valid(t, 32) and valid(s, 16) for t, s in links))
    body = traces_json(span_json(trace_id, span_id, parent, links))
    from_json = otlp.decode_traces_json(body)
    assert (from_json.table.num_rows, from_json.rejected) == ((1, 0) if expect_valid else (0, 1))
    if expect_valid:
        row = rows(from_json)[0]
        assert (row["trace_id"], row["span_id"], row["parent_span_id"]) == \
            (trace_id.lower(), span_id.lower(), parent.lower() or None)
        assert [(ln["trace_id"], ln["span_id"]) for ln in json.loads(row["links"] or "[]")] == \
            [(t.lower(), s.lower()) for t, s in links]
    in_bytes = [as_bytes(text) for text in (trace_id, span_id, parent, *(x for pair in links for x in pair))]
    if all(b is not None for b in in_bytes):  # the same ids in protobuf: the same rows and rejections
        request = ExportTraceServiceRequest()
        span = request.resource_spans.add().scope_spans.add().spans.add(
            trace_id=in_bytes[0], span_id=in_bytes[1], parent_span_id=in_bytes[2], name="s")
        for i in range(len(links)):
            span.links.add(trace_id=in_bytes[3 + 2 * i], span_id=in_bytes[4 + 2 * i])
        for decoded in decode_all_protobuf(request.SerializeToString()):
            assert rows(decoded) == rows(from_json)
            assert [e.lower() for e in decoded.errors] == [e.lower() for e in from_json.errors]
    status, _, raw = store.send(body, "application/json")
    assert status == 200 and ("partialSuccess" in json.loads(raw)) != expect_valid
    if expect_valid:
        store.acked.add((trace_id.lower(), span_id.lower()))
    store.check()


# ---- nesting depth -------------------------------------------------------------------------------------

def nested_json(levels: list[bool]) -> dict:
    """An AnyValue of len(levels) + 1 levels: a string inside an arrayValue (True) or kvlistValue per level."""
    value: dict = {"stringValue": "x"}
    for is_array in reversed(levels):
        value = ({"arrayValue": {"values": [value]}} if is_array
                 else {"kvlistValue": {"values": [{"key": "k", "value": value}]}})
    return value


def nested_pb(target: AnyValue, levels: list[bool]) -> None:
    for is_array in levels:
        if is_array:
            target = target.array_value.values.add()
        else:
            kv = target.kvlist_value.values.add(key="k")
            target = kv.value
    target.string_value = "x"


PLACES = ["span", "event", "link", "resource", "log attribute", "log body"]


def deep_request(place: str, levels: list[bool]) -> tuple[str, ExportTraceServiceRequest | ExportLogsServiceRequest]:
    """A request whose value at `place` has len(levels) + 1 levels; (signal, request)."""
    if place.startswith("log"):
        request = ExportLogsServiceRequest()
        record = request.resource_logs.add().scope_logs.add().log_records.add(time_unix_nano=1)
        nested_pb(record.body if place == "log body" else record.attributes.add(key="deep").value, levels)
        return "logs", request
    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    span = rs.scope_spans.add().spans.add(trace_id=b"\x05" * 16, span_id=b"\x06" * 8, name="deep")
    if place == "event":
        owner = span.events.add(name="e")
    elif place == "link":
        owner = span.links.add(trace_id=b"\x01" * 16, span_id=b"\x02" * 8)
    else:
        owner = span if place == "span" else rs.resource
    nested_pb(owner.attributes.add(key="deep").value, levels)
    return "traces", request


def deep_json(place: str, levels: list[bool]) -> bytes:
    """deep_request's request in OTLP/JSON, built without recursing through the protobuf message."""
    text = json.dumps(request_to_json(deep_request(place, [])[1]))
    assert text.count('{"stringValue": "x"}') == 1
    return text.replace('{"stringValue": "x"}', json.dumps(nested_json(levels))).encode()


def decoders(signal: str):
    if signal == "logs":
        return [otlp.decode_logs_protobuf], otlp.decode_logs_json
    return [otlp.decode_traces_protobuf_python, *([otlp.decode_traces_protobuf] if otlp.FAST_DECODER else [])], \
        otlp.decode_traces_json


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("as_json", [True, False])
def test_values_nested_too_deep_get_a_400_naming_where(store, place, as_json):
    levels = [True] * 300 if as_json else [True] * (DEPTH + 5)  # protobuf's parser stops at 100 messages
    signal, request = deep_request(place, levels)
    body = deep_json(place, levels) if as_json else request.SerializeToString()
    status, message, _ = store.send(body, "application/json" if as_json else "application/x-protobuf",
                                    signal=signal)
    where = "a log record body" if place == "log body" else "attribute 'deep'"
    assert status == 400 and message.startswith(f"{where} nests arrayValue/kvlistValue more than {DEPTH} levels")
    store.check()


@pytest.mark.parametrize("place", PLACES)
def test_protobuf_nested_past_its_parsers_limit_gets_a_clean_400(store, place):
    signal, request = deep_request(place, [True] * 300)
    body = request.SerializeToString()
    for decode in decoders(signal)[0]:
        with pytest.raises(otlp.DecodeFailure, match="nested deeper than 100 levels"):
            decode(body)
    status, message, _ = store.send(body, signal=signal)
    assert status == 400 and "nested deeper than 100 levels" in message
    store.check()


@pytest.mark.parametrize("place", PLACES)
def test_the_depth_limit_is_the_same_in_either_encoding(place):
    too_deep = [False, True] * (DEPTH // 2) + [False]  # DEPTH + 2 levels, kvlists outermost and innermost
    signal, request = deep_request(place, too_deep)
    pb_decoders, json_decoder = decoders(signal)
    for decode in pb_decoders:
        with pytest.raises(otlp.DecodeFailure):
            decode(request.SerializeToString())
    with pytest.raises(otlp_values.ValueTooDeep):
        json_decoder(deep_json(place, too_deep))
    deepest = too_deep[2:]  # DEPTH levels
    signal, request = deep_request(place, deepest)
    expected = rows(json_decoder(deep_json(place, deepest)))
    assert len(expected) == 1
    for decode in pb_decoders:
        assert rows(decode(request.SerializeToString())) == expected


@PROPERTY
@given(levels=st.lists(st.booleans(), max_size=2 * DEPTH), place=st.sampled_from(PLACES))
def test_nesting_depth(store, levels, place):
    signal, request = deep_request(place, levels)
    pb_body, json_body = request.SerializeToString(), deep_json(place, levels)
    fits = len(levels) + 1 <= DEPTH
    pb_decoders, json_decoder = decoders(signal)
    outcomes = []
    for decode in [*pb_decoders, json_decoder]:
        try:
            outcomes.append(rows(decode(json_body if decode is json_decoder else pb_body)))
        except otlp.DecodeFailure as exc:
            assert not fits and (decode is not json_decoder or isinstance(exc, otlp_values.ValueTooDeep)), exc
            outcomes.append(None)
    assert outcomes == [outcomes[-1]] * len(outcomes) and (outcomes[-1] is not None) == fits
    for body, content_type in ((pb_body, "application/x-protobuf"), (json_body, "application/json")):
        assert store.send(body, content_type, signal=signal)[0] == (200 if fits else 400)
    if fits and signal == "traces":
        store.acknowledge(request)
    store.check()
