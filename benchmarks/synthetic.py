"""Realistic synthetic OTLP trace requests: openai.chat-shaped spans of ~1.2 KB with ~20 attributes.

The attribute names and value shapes follow what Traceloop's OpenAI instrumentation emits
(../shared/notes/otel-span-shapes.md); ids are random so every request holds fresh spans.
"""
from __future__ import annotations

import json
import os
import random

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

QUESTIONS = [
    "How many singers do we have?", "List the names of all dogs older than 3.",
    "What is the average age of players in each team?", "Which documents have template type 'PPT'?",
]


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
    for i in range(n_spans):
        trace_id = os.urandom(16) if i % 8 == 0 or i == 0 else trace_id  # noqa: F821 - set at i == 0
        span = Span(trace_id=trace_id, span_id=os.urandom(8), name="openai.chat", kind=Span.SPAN_KIND_CLIENT,
                    start_time_unix_nano=start + i * 1000, end_time_unix_nano=start + i * 1000 + 900_000_000)
        span.attributes.extend(chat_attributes(rng, f"ro-{seed}-{i // 8}"))
        span.status.code = 1
        scope_spans.spans.append(span)
    return request


def make_bodies(n_requests: int, spans_per_request: int, seed: int = 0) -> list[bytes]:
    """Pre-encoded protobuf request bodies, so a load generator spends nothing on encoding."""
    return [make_request(spans_per_request, seed * 1_000_003 + i).SerializeToString() for i in range(n_requests)]
