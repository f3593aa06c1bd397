"""The C decoder of protobuf traces (span_store/_otlp_fast.c) against the Python reference
(otlp.decode_traces_protobuf_python): on any input both give the same rows, or both fail with DecodeFailure.

Where the brief for the C decoder and upb disagree, upb wins, because it is what the reference does and what
the protobuf spec asks for: a known field number with an unexpected wire type is an unknown field, and unknown
groups are skipped (test_wrong_wire_types_and_groups_are_unknown_fields).

`make test-asan` runs this file on an AddressSanitizer/UBSan build of the decoder (tests/conftest.py loads it
from LIGHTNING_OTEL_FAST_SO) with LIGHTNING_OTEL_FUZZ_SCALE times the examples of every property test.
"""
from __future__ import annotations

import contextlib
import ctypes
import glob
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from lightning_otel.span_store import otlp
from test_otlp_decode import add_attrs, set_value, text, trace_requests, values

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "otlp"
FAILED = "DecodeFailure"

pytestmark = pytest.mark.skipif(otlp._otlp_fast is None, reason="the C decoder is not built")  # noqa: SLF001
FUZZ_SCALE = float(os.environ.get("LIGHTNING_OTEL_FUZZ_SCALE", "1"))  # below 1 at the floors (Makefile)


def fuzz(max_examples: int) -> settings:
    return settings(max_examples=max(1, round(max_examples * FUZZ_SCALE)), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


# ---- helpers -----------------------------------------------------------------------------------------

def outcome(decode, body: bytes):
    """Rows in order (JSON text columns parsed, received_ns dropped), rejected count and errors; or FAILED."""
    try:
        decoded = decode(body)
    except otlp.DecodeFailure:
        return FAILED
    assert decoded.table.schema == otlp.SPAN_SCHEMA
    rows = decoded.table.drop_columns(["received_ns"]).to_pylist()
    for row in rows:
        for column in ("attributes", "resource", "events", "links"):
            if row[column] is not None:
                row[column] = json.loads(row[column])
    return rows, decoded.rejected, decoded.errors


LIBC = ctypes.CDLL(None)
LIBC.malloc.restype = ctypes.c_void_p
LIBC.free.argtypes = [ctypes.c_void_p]


@contextlib.contextmanager
def exact_copy(body: bytes):
    """body in a malloc'd block of exactly len(body) bytes. A bytes object has a NUL after its last byte (and
    pymalloc slack), where a one-byte over-read goes unseen; under ASan this block has a red zone there."""
    address = LIBC.malloc(len(body))
    if not address:
        raise MemoryError
    try:
        ctypes.memmove(address, body, len(body))
        yield (ctypes.c_char * len(body)).from_address(address)
    finally:
        LIBC.free(address)


def decode_fast(body: bytes) -> otlp.Decoded:
    with mock.patch.object(otlp, "FAST_DECODER", True), exact_copy(body) as buffer:
        return otlp.decode_traces_protobuf(buffer)


def assert_same(body: bytes):
    expected = outcome(otlp.decode_traces_protobuf_python, body)
    assert outcome(decode_fast, body) == expected
    # The C decoder even spells the JSON as orjson does (test_otlp_decode compares pb and JSON rows as text).
    if expected != FAILED:
        assert decode_fast(body).table.drop_columns(["received_ns"]).equals(
            otlp.decode_traces_protobuf_python(body).table.drop_columns(["received_ns"]))
    return expected


def varint(n: int) -> bytes:
    out = b""
    while True:
        low, n = n & 0x7F, n >> 7
        if not n:
            return out + bytes([low])
        out += bytes([low | 0x80])


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited field."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def one_span_request(span_payload: bytes) -> bytes:
    return field(1, field(2, field(2, span_payload)))


GOOD_IDS = field(1, b"\x01" * 16) + field(2, b"\x02" * 8)


# ---- agreement on generated requests -----------------------------------------------------------------

@pytest.mark.heavy
@fuzz(150)
@given(trace_requests())
def test_fast_and_python_decoders_agree(request):
    assert_same(request.SerializeToString())


PROMOTED_KEYS = ["lightning.rollout.id", "lightning.task.id", "lightning.attempt", "gen_ai.operation.name",
                 "llm.request.type", "gen_ai.request.model", "gen_ai.response.model", "gen_ai.usage.input_tokens",
                 "gen_ai.usage.prompt_tokens", "gen_ai.usage.output_tokens", "gen_ai.usage.completion_tokens",
                 "service.name", "k"]
promoted_values = st.one_of(values, st.none(), st.sampled_from(["0", " 12 ", "1_000", "-3", "1e3", "9" * 30, "",
                                                                "٣", str(2**63), str(-(2**63))]),
                            st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2**63), 2**63 - 1))
kv_pairs = st.lists(st.tuples(st.sampled_from(PROMOTED_KEYS), promoted_values), max_size=8)  # duplicate keys too


def add_pairs(repeated, pairs) -> None:
    for key, value in pairs:
        kv = repeated.add()
        kv.key = key
        if value is not None:  # None: the value field is left unset
            set_value(kv.value, value)


@st.composite
def edge_requests(draw) -> bytes:
    """Duplicate keys, promoted attributes of every type, invalid ids, odd enums, unknown fields, merges."""
    request = ExportTraceServiceRequest()
    for _ in range(draw(st.integers(1, 2))):
        rs = request.resource_spans.add()
        add_pairs(rs.resource.attributes, draw(kv_pairs))
        ss = rs.scope_spans.add()
        ss.scope.name, ss.scope.version = draw(text), draw(text)
        for _ in range(draw(st.integers(1, 3))):
            span = ss.spans.add(
                trace_id=draw(st.one_of(st.binary(min_size=16, max_size=16), st.binary(max_size=18))),
                span_id=draw(st.one_of(st.binary(min_size=8, max_size=8), st.binary(max_size=9))),
                name=draw(text), kind=draw(st.integers(-3, 9)), flags=draw(st.integers(0, 2**32 - 1)),
                trace_state=draw(text), start_time_unix_nano=draw(st.integers(0, 2**64 - 1)),
                end_time_unix_nano=draw(st.integers(0, 2**64 - 1)))
            span.status.code, span.status.message = draw(st.integers(-2, 5)), draw(text)
            add_pairs(span.attributes, draw(kv_pairs))
            for _ in range(draw(st.integers(0, 2))):
                event = span.events.add(time_unix_nano=draw(st.integers(0, 2**64 - 1)), name=draw(text))
                add_pairs(event.attributes, draw(kv_pairs))
            for _ in range(draw(st.integers(0, 2))):
                link = span.links.add(trace_id=draw(st.binary(max_size=16)), span_id=draw(st.binary(max_size=8)),
                                      trace_state=draw(text))
                add_pairs(link.attributes, draw(kv_pairs))
    body = request.SerializeToString()
    # Concatenated encodings of a message parse as their merge: the same rule at every level.
    return body + draw(st.sampled_from([b"", body, field(1, field(1, field(1, field(1, b"service.name")
                                                                                    + field(2, field(1, b"x"))))),
                                        varint(99 << 3 | 3) + varint(1 << 3) + varint(5) + varint(99 << 3 | 4)]))


@pytest.mark.heavy
@fuzz(300)
@given(edge_requests())
def test_fast_and_python_decoders_agree_on_edge_cases(body):
    assert_same(body)


any_values = st.one_of(values, st.none(), st.floats(allow_nan=True, allow_infinity=True))


def any_value_bytes(value) -> bytes:
    message = AnyValue()
    if value is not None:
        set_value(message, value)
    return message.SerializeToString()


@fuzz(300)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "lightning.rollout.id"]),
                          st.lists(any_values, min_size=1, max_size=4)), max_size=5))
def test_merged_attribute_values_agree(pairs):
    """A KeyValue whose value occurs several times: AnyValue merges (oneof: last member wins, lists concatenate)."""
    payload = GOOD_IDS
    for key, parts in pairs:
        kv = field(1, key.encode()) + b"".join(field(2, any_value_bytes(part)) for part in parts)
        payload += field(9, kv)
    assert_same(one_span_request(payload))


@fuzz(200)
@given(st.lists(st.sampled_from([[1], [2, 3], [], ["x"], {"a": 1}, {"a": 2, "b": [1]}, {}, "s", 7]),
                min_size=1, max_size=5))
def test_merged_lists_agree(parts):
    kv = field(1, b"k") + b"".join(field(2, any_value_bytes(part)) for part in parts)
    expected = assert_same(one_span_request(GOOD_IDS + field(9, kv)))
    assert expected != FAILED


def test_duplicate_keys_keep_first_position_and_last_value():
    span = Span(trace_id=b"\x01" * 16, span_id=b"\x02" * 8)
    add_pairs(span.attributes, [("a", 1), ("b", 2), ("a", 3), ("lightning.rollout.id", "x"),
                                ("lightning.rollout.id", "y")])
    add_pairs(span.attributes, [(f"k{i % 40}", i) for i in range(100)])  # the hashed path (> 32 keys)
    request = ExportTraceServiceRequest()
    request.resource_spans.add().scope_spans.add().spans.append(span)
    cols, _, _ = otlp._otlp_fast.decode_traces(request.SerializeToString(), 0)  # noqa: SLF001
    assert list(json.loads(cols["attributes"][0]).items())[:3] == [("a", 3), ("b", 2), ("lightning.rollout.id", "y")]
    assert json.loads(cols["attributes"][0])["k0"] == 80
    assert cols["rollout_id"] == ["y"]
    assert_same(request.SerializeToString())


def test_columns_are_the_schema_in_order():
    columns, rejected, errors = otlp._otlp_fast.decode_traces(b"", 5)  # noqa: SLF001
    assert list(columns) == otlp.SPAN_SCHEMA.names
    assert (rejected, errors) == (0, [])


def test_infinite_token_count():
    """An infinite token count is no count: both paths store None (int(inf) would raise OverflowError)."""
    span = Span(trace_id=b"\x01" * 16, span_id=b"\x02" * 8)
    add_pairs(span.attributes, [("gen_ai.usage.input_tokens", math.inf)])
    request = ExportTraceServiceRequest()
    request.resource_spans.add().scope_spans.add().spans.append(span)
    assert decode_fast(request.SerializeToString()).table.column("input_tokens").to_pylist() == [None]
    reference = otlp.decode_traces_protobuf_python(request.SerializeToString())
    assert reference.table.column("input_tokens").to_pylist() == [None]


# ---- recorded payloads -------------------------------------------------------------------------------

@pytest.mark.parametrize("path", sorted(glob.glob(str(FIXTURES / "*" / "[0-9]*.pb"))), ids=lambda p: p[-40:])
def test_recorded_payloads_decode_the_same(path):
    rows, rejected, _ = assert_same(Path(path).read_bytes())
    assert rows and rejected == 0


# ---- malformed input ---------------------------------------------------------------------------------

@fuzz(500)
@given(st.binary(max_size=400))
def test_random_bytes(body):
    assert_same(body)


@fuzz(300)
@given(st.lists(st.sampled_from([varint(1 << 3 | 2), varint(2 << 3 | 2), varint(9 << 3 | 2), varint(5 << 3 | 2),
                                 varint(1 << 3 | 0), varint(6 << 3 | 1), varint(3 << 3 | 3), varint(3 << 3 | 4),
                                 b"\x00", b"\x01", b"\x02", b"\x05", b"\x10", b"\xff", b"\x80", b"\xc3\xa9"]),
                max_size=60))
def test_random_token_soup(tokens):
    """Random sequences of plausible tags and lengths reach deeper than uniformly random bytes."""
    assert_same(b"".join(tokens))


def small_body() -> bytes:
    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    add_attrs(rs.resource.attributes, {"service.name": "svc", "lightning.attempt": "0"})
    ss = rs.scope_spans.add()
    ss.scope.name = "scope"
    span = ss.spans.add(trace_id=b"\x01" * 16, span_id=b"\x02" * 8, name="é", kind=3,
                        start_time_unix_nano=5, end_time_unix_nano=2**64 - 1)
    add_attrs(span.attributes, {"s": "a\"b\\c\n\x01", "i": -5, "d": 0.1, "b": True, "x": b"\xff\x00",
                                "l": [1, "a", [2.5]], "m": {"k": {"n": 1}}})
    span.events.add(time_unix_nano=7, name="e").attributes.add(key="q").value.int_value = 1
    span.links.add(trace_id=b"\x03" * 16, span_id=b"\x04" * 8, trace_state="t=1")
    return request.SerializeToString()


def test_every_truncation_of_a_small_body():
    body = small_body()
    assert assert_same(body) != FAILED
    for end in range(len(body)):
        assert_same(body[:end])


@pytest.mark.heavy
@fuzz(300)
@given(trace_requests(), st.data())
def test_bit_flips(request, data):
    body = bytearray(request.SerializeToString())
    for _ in range(data.draw(st.integers(1, 3))):
        bit = data.draw(st.integers(0, len(body) * 8 - 1))
        body[bit // 8] ^= 1 << (bit % 8)
    assert_same(bytes(body))


def test_every_single_bit_flip_of_a_small_body():
    body = small_body()
    for bit in range(len(body) * 8):
        flipped = bytearray(body)
        flipped[bit // 8] ^= 1 << (bit % 8)
        assert_same(bytes(flipped))


INVALID_UTF8 = [b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"a\xe2\x82", b"\x80"]


@pytest.mark.parametrize("bad", INVALID_UTF8)
@pytest.mark.parametrize("where", ["span name", "key", "string value", "nested value", "scope name",
                                   "event name", "link trace state", "status message", "schema url"])
def test_invalid_utf8_fails_the_request(bad, where):
    kv = field(1, b"k") + field(2, field(1, b"ok"))
    span = GOOD_IDS + field(5, b"name")
    scope = field(1, field(1, b"scope"))
    if where == "span name":
        span += field(5, bad)
    elif where == "key":
        span += field(9, field(1, bad))
    elif where == "string value":
        span += field(9, field(1, b"k") + field(2, field(1, bad)))
    elif where == "nested value":
        span += field(9, field(1, b"k") + field(2, field(6, field(1, field(1, b"k") + field(2, field(1, bad))))))
    elif where == "scope name":
        scope = field(1, field(1, bad))
    elif where == "event name":
        span += field(11, field(2, bad))
    elif where == "link trace state":
        span += field(13, field(3, bad))
    elif where == "status message":
        span += field(15, field(2, bad))
    body = field(1, field(2, scope + field(2, span + field(9, kv))))
    if where == "schema url":
        body = field(1, field(3, bad) + field(2, field(2, span)))
    assert assert_same(body) == FAILED
    with pytest.raises(ValueError, match="invalid UTF-8"):
        otlp._otlp_fast.decode_traces(body, 0)  # noqa: SLF001


def test_invalid_utf8_in_bytes_is_fine():
    body = one_span_request(GOOD_IDS + field(9, field(1, b"k") + field(2, field(7, b"\xff\xc0"))))
    rows, _, _ = assert_same(body)
    assert rows[0]["attributes"] == {"k": "/8A="}


def string_field_paths():
    """For every string field reachable from ExportTraceServiceRequest: the shortest request that sets it."""
    paths, seen, queue = ([], {ExportTraceServiceRequest.DESCRIPTOR.full_name},
                          [(ExportTraceServiceRequest.DESCRIPTOR, [])])
    while queue:
        descriptor, path = queue.pop(0)
        for f in descriptor.fields:
            if f.type == f.TYPE_STRING:
                paths.append((f.full_name, path + [f.number]))
            elif f.message_type is not None and f.message_type.full_name not in seen:
                seen.add(f.message_type.full_name)
                queue.append((f.message_type, path + [f.number]))
    return paths


@pytest.mark.parametrize("name,path", string_field_paths(), ids=[name for name, _ in string_field_paths()])
def test_every_string_field_of_the_schema_is_checked(name, path):
    """The C schema table covers every string field of the installed descriptors (UTF-8 is checked in each)."""
    body = b"\xff"
    for number in reversed(path):
        body = field(number, body)
    assert assert_same(body) == FAILED, name


def test_wrong_wire_types_and_groups_are_unknown_fields():
    """upb (and the protobuf spec) skip a known field with an unexpected wire type, and unknown groups."""
    span = (GOOD_IDS + varint(5 << 3 | 0) + varint(7) + varint(9 << 3 | 5) + b"\x00" * 4
            + varint(40 << 3 | 3) + varint(1 << 3 | 0) + varint(1) + varint(40 << 3 | 4) + varint(6 << 3 | 2)
            + varint(0))
    rows, _, _ = assert_same(one_span_request(span))
    assert len(rows) == 1
    for body in (varint(1 << 3 | 4), varint(3 << 3 | 3) + varint(4 << 3 | 4), varint(3 << 3 | 3),
                 varint(1 << 3 | 6) + b"\x00", varint(0) + b"\x00", b"\x8a\x80\x80\x80\x80\x00",
                 varint(99 << 3 | 0) + b"\xff" * 10 + b"\x01"):
        assert assert_same(body) == FAILED, body


def nested_arrays(depth: int, innermost: bytes = field(1, b"a")) -> bytes:
    value = innermost
    for _ in range(depth):
        value = field(5, field(1, value))
    return value


@pytest.mark.parametrize("depth", [45, 46, 47, 48, 49])
def test_nesting_limit_is_upbs(depth):
    # request > resource_spans > scope_spans > span > KeyValue > AnyValue: 5 levels, then 2 per array.
    for innermost in (field(1, b"a"), b"", field(5, b"")):
        body = one_span_request(GOOD_IDS + field(9, field(1, b"k") + field(2, nested_arrays(depth, innermost))))
        assert_same(body)
    groups = varint(77 << 3 | 3) * depth * 2 + varint(77 << 3 | 4) * depth * 2
    assert_same(one_span_request(GOOD_IDS + groups))


def test_nesting_bomb_fails_cleanly():
    body = one_span_request(GOOD_IDS + field(9, field(1, b"k") + field(2, nested_arrays(20_000))))
    assert assert_same(body) == FAILED
    with pytest.raises(ValueError, match="nested deeper than 100"):
        otlp._otlp_fast.decode_traces(body, 0)  # noqa: SLF001
    groups = varint(77 << 3 | 3) * 100_000
    assert assert_same(groups) == FAILED


def test_rejected_spans_and_error_messages():
    request = ExportTraceServiceRequest()
    ss = request.resource_spans.add().scope_spans.add()
    for i in range(25):
        ss.spans.add(trace_id=b"\x00" * 16 if i % 2 else b"\x01" * 15, span_id=b"\x02" * 8, name=f"s'\"{i}\n")
    ss.spans.add(trace_id=b"\x01" * 16, span_id=b"\x00" * 8, name="zero span id")
    ss.spans.add(trace_id=b"\x01" * 16, span_id=b"\x02" * 8, name="ok")
    rows, rejected, errors = assert_same(request.SerializeToString())
    assert (len(rows), rejected, len(errors)) == (1, 26, 20)


def test_pure_python_env_var_forces_the_reference():
    code = "from lightning_otel.span_store import otlp; print(otlp.FAST_DECODER)"
    env = dict(os.environ, LIGHTNING_OTEL_PURE_PYTHON="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
