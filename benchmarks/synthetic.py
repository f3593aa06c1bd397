"""Realistic synthetic OTLP trace requests: openai.chat-shaped spans of ~1.2 KB with ~20 attributes.

The attribute names and value shapes follow what Traceloop's OpenAI instrumentation emits
(../shared/notes/otel-span-shapes.md); `FreshIds` rewrites the trace and span ids of a pre-encoded
body in place, so a load generator can send millions of distinct spans without re-encoding anything.
"""
from __future__ import annotations

import json
import os
import random
import struct

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

QUESTIONS = [
    "How many singers do we have?", "List the names of all dogs older than 3.",
    "What is the average age of players in each team?", "Which documents have template type 'PPT'?",
]
SPANS_PER_TRACE = 8


def _kv(key: str, value) -> KeyValue:
    if isinstance(value, bool):
        return KeyValue(key=key, value=AnyValue(bool_value=value))
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    if isinstance(value, float):
        return KeyValue(key=key, value=AnyValue(double_value=value))
    return KeyValue(key=key, value=AnyValue(string_value=str(value)))


def chat_attributes(rng: random.Random, rollout_id: str) -> list[KeyValue]:
    question = rng.choice(QUESTIONS)
    messages = json.dumps([
        {"role": "system", "parts": [{"type": "text", "content": "You write one SQLite query. Answer with SQL only."}]},
        {"role": "user", "parts": [{"type": "text", "content": f"{question} Tables: singer(id, name, age, country)."}]},
    ])
    output = json.dumps([{"role": "assistant", "finish_reason": "stop",
                          "parts": [{"type": "text", "content": "SELECT count(*) FROM singer WHERE age > 30"}]}])
    pairs = {
        "gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai", "gen_ai.request.model": "gpt-4o",
        "gen_ai.request.max_tokens": 256, "gen_ai.request.temperature": 0.7, "gen_ai.is_streaming": False,
        "gen_ai.openai.api_base": "http://127.0.0.1:8000/r/rollout/v1/", "gen_ai.response.model": "smollm2-135m",
        "gen_ai.response.id": f"chatcmpl-{rng.getrandbits(64):016x}", "gen_ai.response.finish_reasons": "stop",
        "gen_ai.usage.input_tokens": rng.randint(40, 400), "gen_ai.usage.output_tokens": rng.randint(5, 120),
        "gen_ai.usage.total_tokens": rng.randint(50, 500), "gen_ai.usage.cache_read.input_tokens": 0,
        "gen_ai.input.messages": messages, "gen_ai.output.messages": output,
        "llm.headers": "None", "llm.is_streaming": False, "lightning.rollout.id": rollout_id,
        "server.address": "127.0.0.1",
    }
    return [_kv(k, v) for k, v in pairs.items()]


def make_request(n_spans: int, seed: int) -> ExportTraceServiceRequest:
    rng = random.Random(seed)
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    for key, value in (("service.name", "sql-agent"), ("telemetry.sdk.language", "python"),
                       ("telemetry.sdk.name", "opentelemetry"), ("telemetry.sdk.version", "1.45.2")):
        resource_spans.resource.attributes.append(_kv(key, value))
    scope_spans = resource_spans.scope_spans.add()
    scope_spans.scope.name = "opentelemetry.instrumentation.openai.v1"
    scope_spans.scope.version = "0.62.4"
    start = 1_764_480_000_000_000_000 + rng.randint(0, 10**15)
    trace_id = b""
    for i in range(n_spans):
        if i % SPANS_PER_TRACE == 0:
            trace_id = rng.randbytes(16)
        span = Span(trace_id=trace_id, span_id=rng.randbytes(8), name="openai.chat", kind=Span.SPAN_KIND_CLIENT,
                    start_time_unix_nano=start + i * 1000, end_time_unix_nano=start + i * 1000 + 900_000_000)
        span.attributes.extend(chat_attributes(rng, f"ro-{seed}-{i // SPANS_PER_TRACE}"))
        span.status.code = 1
        scope_spans.spans.append(span)
    return request


def make_bodies(n_requests: int, spans_per_request: int, seed: int = 0) -> list[bytes]:
    """Pre-encoded protobuf request bodies, so a load generator spends nothing on encoding."""
    return [make_request(spans_per_request, seed * 1_000_003 + i).SerializeToString() for i in range(n_requests)]


def write_bodies(path: str, bodies: list[bytes]) -> None:
    """One file of bodies, each prefixed with its 4-byte big-endian length (what the peer scripts read)."""
    with open(path, "wb") as fh:
        for body in bodies:
            fh.write(struct.pack(">I", len(body)) + body)


class FreshIds:
    """Re-issue a pre-encoded body with new random trace and span ids, patched at offsets found once."""

    def __init__(self, body: bytes):
        request = ExportTraceServiceRequest.FromString(body)
        self.template = bytearray(body)
        self.span_offsets: list[int] = []
        self.trace_offsets: list[list[int]] = []
        seen: set[bytes] = set()
        for rs in request.resource_spans:
            for ss in rs.scope_spans:
                for span in ss.spans:
                    # Span.span_id is field 2 (tag 0x12, length 8); trace_id field 1 (tag 0x0a, length 16).
                    self.span_offsets.append(body.index(b"\x12\x08" + span.span_id) + 2)
                    if span.trace_id not in seen:
                        seen.add(span.trace_id)
                        self.trace_offsets.append(_find_all(body, b"\x0a\x10" + span.trace_id, 2))
        self.n_spans = len(self.span_offsets)

    def render(self) -> bytes:
        data = bytearray(self.template)
        fresh = os.urandom(8 * len(self.span_offsets) + 16 * len(self.trace_offsets))
        for i, offset in enumerate(self.span_offsets):
            data[offset:offset + 8] = fresh[8 * i:8 * i + 8]
        base = 8 * len(self.span_offsets)
        for j, offsets in enumerate(self.trace_offsets):
            new_id = fresh[base + 16 * j:base + 16 * j + 16]
            for offset in offsets:
                data[offset:offset + 16] = new_id
        return bytes(data)


def _find_all(haystack: bytes, needle: bytes, skip: int) -> list[int]:
    found, start = [], 0
    while (at := haystack.find(needle, start)) != -1:
        found.append(at + skip)
        start = at + 1
    return found
