"""Decode OTLP/HTTP export requests (protobuf or JSON) into Arrow tables shaped like the store's tables.

Both encodings go through the same row builders, so a span sent once as protobuf and again as JSON
becomes the same row (the store keeps it once, keyed by trace id and span id).

OTLP/JSON differs from the generic proto3 JSON mapping (see the OTLP specification): trace and span
ids are hex strings, enums are integers, 64-bit integers may be strings, keys are lowerCamelCase
(snake_case is accepted too), unknown keys are ignored.
"""
from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import orjson
import pyarrow as pa
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

try:
    from lightning_otel.span_store import _otlp_fast
except ImportError:  # built without a C compiler: the pure-Python decoder does the same work, slower
    _otlp_fast = None

from lightning_otel.capture.agent_header import agent_name as _agent_name  # the one Python definition
from lightning_otel.span_store.otlp_values import (DecodeFailure, ValueTooDeep, as_int, as_str, clamp_ns, dumps_json,
                                                    id_problem, js_attrs, js_body, js_enum, js_id, js_list, js_time,
                                                    pb_attrs, pb_body, pick)

# The C decoder of protobuf traces, when built; LIGHTNING_OTEL_PURE_PYTHON=1 forces the Python reference.
FAST_DECODER = _otlp_fast is not None and os.environ.get("LIGHTNING_OTEL_PURE_PYTHON", "") != "1"


SPAN_KINDS = ("UNSPECIFIED", "INTERNAL", "SERVER", "CLIENT", "PRODUCER", "CONSUMER")
STATUS_CODES = ("UNSET", "OK", "ERROR")

ROLLOUT_ID_KEY = "lightning.rollout.id"
TASK_ID_KEY = "lightning.task.id"
ATTEMPT_KEY = "lightning.attempt"

SPAN_SCHEMA = pa.schema([
    ("trace_id", pa.string()), ("span_id", pa.string()), ("parent_span_id", pa.string()),
    ("trace_state", pa.string()), ("flags", pa.int64()),
    ("name", pa.string()), ("kind", pa.string()),
    ("start_ns", pa.int64()), ("end_ns", pa.int64()),
    ("status_code", pa.string()), ("status_message", pa.string()),
    ("attributes", pa.string()), ("resource", pa.string()),
    ("scope_name", pa.string()), ("scope_version", pa.string()),
    ("events", pa.string()), ("links", pa.string()),
    ("service_name", pa.string()), ("rollout_id", pa.string()), ("task_id", pa.string()),
    ("attempt", pa.int64()), ("operation_name", pa.string()),
    ("request_model", pa.string()), ("response_model", pa.string()),
    ("input_tokens", pa.int64()), ("output_tokens", pa.int64()),
    ("received_ns", pa.int64()),
    # Migration 0006: read here, where the attributes are at hand, so that storing a span parses no JSON.
    ("response_id", pa.string()), ("agent_name", pa.string()),
])

LOG_SCHEMA = pa.schema([
    ("log_id", pa.string()), ("time_ns", pa.int64()), ("observed_ns", pa.int64()),
    ("severity_number", pa.int64()), ("severity_text", pa.string()), ("event_name", pa.string()),
    ("body", pa.string()), ("attributes", pa.string()), ("resource", pa.string()),
    ("scope_name", pa.string()), ("scope_version", pa.string()),
    ("trace_id", pa.string()), ("span_id", pa.string()), ("flags", pa.int64()),
    ("service_name", pa.string()), ("rollout_id", pa.string()), ("task_id", pa.string()),
    ("attempt", pa.int64()), ("received_ns", pa.int64()),
])

# protobuf's parser says only "Error parsing message", for damage and for nesting past its limit alike.
UPB_HINT = " (damaged, or messages nested deeper than 100 levels)"


@dataclass
class Decoded:
    """What one export request yields: rows to store and the parts it rejected (OTLP partial success)."""

    table: pa.Table
    rejected: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def error_message(self) -> str:
        shown = self.errors[:3]
        more = f" (and {len(self.errors) - 3} more)" if len(self.errors) > 3 else ""
        return "; ".join(shown) + more


# ---- shared row building ---------------------------------------------------------------------------

class _ResourceContext:
    """Resource-level values every span of a ResourceSpans shares."""

    __slots__ = ("resource", "resource_json", "service_name", "rollout_id", "task_id", "attempt")

    def __init__(self, resource: dict[str, Any]):
        self.resource = resource
        self.resource_json = dumps_json(resource)
        self.service_name = as_str(resource.get("service.name"))
        self.rollout_id = as_str(resource.get(ROLLOUT_ID_KEY))
        self.task_id = as_str(resource.get(TASK_ID_KEY))
        self.attempt = as_int(resource.get(ATTEMPT_KEY))


def _append_identity(columns: dict[str, list], attrs: dict[str, Any], res: _ResourceContext) -> None:
    """Rollout id, task id and attempt: the record's own attribute first, else its resource's."""
    rollout = attrs.get(ROLLOUT_ID_KEY)
    columns["rollout_id"].append(res.rollout_id if rollout is None else str(rollout))
    task = attrs.get(TASK_ID_KEY)
    columns["task_id"].append(res.task_id if task is None else str(task))
    attempt = attrs.get(ATTEMPT_KEY)
    columns["attempt"].append(res.attempt if attempt is None else as_int(attempt))


class _Columns:
    """Rows of one table being built, and the records rejected on the way (OTLP partial success)."""

    def __init__(self, schema: pa.Schema) -> None:
        self.schema = schema
        self.columns: dict[str, list] = {name: [] for name in schema.names}
        self.rejected = 0
        self.errors: list[str] = []
        self.received_ns = time.time_ns()

    def reject(self, reason: str) -> None:
        self.rejected += 1
        if len(self.errors) < 20:
            self.errors.append(reason)

    def result(self) -> Decoded:
        return Decoded(pa.Table.from_pydict(self.columns, schema=self.schema), self.rejected, self.errors)


class _SpanColumns(_Columns):
    def __init__(self) -> None:
        super().__init__(SPAN_SCHEMA)

    def add(self, trace_id: str, span_id: str, parent: str, trace_state: str, flags: int, name: str,
            kind: int, start: int, end: int, status_code: int, status_message: str,
            attrs: dict[str, Any], res: _ResourceContext, scope_name: str, scope_version: str,
            events: list, links: list) -> None:
        """Ids as sent (hex text; protobuf bytes as .hex()): a span with an invalid one is rejected whole."""
        ids = (("trace id", trace_id, 32, False), ("span id", span_id, 16, False),
               ("parent span id", parent, 16, True))
        for link in links:
            ids += (("link trace id", link["trace_id"], 32, False), ("link span id", link["span_id"], 16, False))
        problem = id_problem(ids)
        if problem is not None:
            self.reject(f"span {name!r}: {problem}")
            return
        for link in links:
            link["trace_id"], link["span_id"] = link["trace_id"].lower(), link["span_id"].lower()
        c = self.columns
        c["trace_id"].append(trace_id.lower())
        c["span_id"].append(span_id.lower())
        c["parent_span_id"].append(parent.lower() if parent else None)
        c["trace_state"].append(trace_state or None)
        c["flags"].append(flags)
        c["name"].append(name)
        c["kind"].append(SPAN_KINDS[kind] if 0 <= kind < len(SPAN_KINDS) else str(kind))
        c["start_ns"].append(clamp_ns(start))
        c["end_ns"].append(clamp_ns(end))
        c["status_code"].append(STATUS_CODES[status_code] if 0 <= status_code < 3 else str(status_code))
        c["status_message"].append(status_message or None)
        c["attributes"].append(dumps_json(attrs))
        c["resource"].append(res.resource_json)
        c["scope_name"].append(scope_name or None)
        c["scope_version"].append(scope_version or None)
        c["events"].append(dumps_json(events) if events else None)
        c["links"].append(dumps_json(links) if links else None)
        c["service_name"].append(res.service_name)
        _append_identity(c, attrs, res)
        get = attrs.get
        c["operation_name"].append(as_str(get("gen_ai.operation.name", get("llm.request.type"))))
        c["request_model"].append(as_str(get("gen_ai.request.model")))
        c["response_model"].append(as_str(get("gen_ai.response.model")))
        c["input_tokens"].append(as_int(get("gen_ai.usage.input_tokens", get("gen_ai.usage.prompt_tokens"))))
        c["output_tokens"].append(
            as_int(get("gen_ai.usage.output_tokens", get("gen_ai.usage.completion_tokens"))))
        c["received_ns"].append(self.received_ns)
        c["response_id"].append(as_str(get("gen_ai.response.id")))
        c["agent_name"].append(_agent_name(name, c["operation_name"][-1], attrs))


# ---- traces ----------------------------------------------------------------------------------------

def decode_traces_protobuf(body: bytes) -> Decoded:
    """The C decoder when built (same rows as the Python reference, ~5x faster), else the reference."""
    if not FAST_DECODER:
        return decode_traces_protobuf_python(body)
    try:
        columns, rejected, errors = _otlp_fast.decode_traces(body, time.time_ns())
    except ValueError as exc:
        raise DecodeFailure(f"body is not a protobuf ExportTraceServiceRequest: {exc}") from None
    except RecursionError as exc:  # the C decoder's ValueTooDeep; its message names the attribute
        too_deep = ValueTooDeep()
        too_deep.where = str(exc)
        raise too_deep from None
    return Decoded(pa.Table.from_pydict(columns, schema=SPAN_SCHEMA), rejected, errors)


def decode_traces_protobuf_python(body: bytes) -> Decoded:
    request = ExportTraceServiceRequest()
    try:
        request.ParseFromString(body)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise DecodeFailure(f"body is not a protobuf ExportTraceServiceRequest: {exc}{UPB_HINT}") from None
    out = _SpanColumns()
    for resource_spans in request.resource_spans:
        res = _ResourceContext(pb_attrs(resource_spans.resource.attributes))
        for scope_spans in resource_spans.scope_spans:
            scope = scope_spans.scope
            for s in scope_spans.spans:
                events = [{"time_ns": e.time_unix_nano, "name": e.name, "attributes": pb_attrs(e.attributes)}
                          for e in s.events]
                links = [{"trace_id": ln.trace_id.hex(), "span_id": ln.span_id.hex(),
                          "trace_state": ln.trace_state, "attributes": pb_attrs(ln.attributes)}
                         for ln in s.links]
                out.add(s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.trace_state, s.flags,
                        s.name, s.kind, s.start_time_unix_nano, s.end_time_unix_nano, s.status.code,
                        s.status.message, pb_attrs(s.attributes), res, scope.name, scope.version,
                        events, links)
    return out.result()


def _parse_json(body: bytes, what: str) -> dict:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise DecodeFailure(f"body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise DecodeFailure(f"body must be a JSON object ({what}), got {type(doc).__name__}")
    return doc


def _js_scope(scope_block: dict) -> tuple[str, str]:
    scope = pick(scope_block, "scope", default={}) or {}
    if not isinstance(scope, dict):
        raise DecodeFailure("'scope' must be an object")
    return str(scope.get("name") or ""), str(scope.get("version") or "")


def _js_resource(block: dict) -> _ResourceContext:
    resource = pick(block, "resource", default={}) or {}
    if not isinstance(resource, dict):
        raise DecodeFailure("'resource' must be an object")
    return _ResourceContext(js_attrs(resource.get("attributes")))


def decode_traces_json(body: bytes | dict) -> Decoded:
    doc = body if isinstance(body, dict) else _parse_json(body, "an ExportTraceServiceRequest")
    out = _SpanColumns()
    for block in js_list(doc, "resourceSpans", "resource_spans", "the request"):
        res = _js_resource(block)
        for scope_block in js_list(block, "scopeSpans", "scope_spans", "resourceSpans"):
            scope_name, scope_version = _js_scope(scope_block)
            for s in js_list(scope_block, "spans", "spans", "scopeSpans"):
                status = pick(s, "status", default={}) or {}
                if not isinstance(status, dict):
                    raise DecodeFailure("span 'status' must be an object")
                events = [{"time_ns": js_time(pick(e, "timeUnixNano", "time_unix_nano"), "event time"),
                           "name": str(e.get("name") or ""),
                           "attributes": js_attrs(e.get("attributes"))}
                          for e in js_list(s, "events", "events", "a span")]
                links = [{"trace_id": js_id(pick(ln, "traceId", "trace_id"), "link traceId"),
                          "span_id": js_id(pick(ln, "spanId", "span_id"), "link spanId"),
                          "trace_state": str(pick(ln, "traceState", "trace_state") or ""),
                          "attributes": js_attrs(ln.get("attributes"))}
                         for ln in js_list(s, "links", "links", "a span")]
                out.add(js_id(pick(s, "traceId", "trace_id"), "traceId"),
                        js_id(pick(s, "spanId", "span_id"), "spanId"),
                        js_id(pick(s, "parentSpanId", "parent_span_id"), "parentSpanId"),
                        str(pick(s, "traceState", "trace_state") or ""),
                        as_int(s.get("flags")) or 0,
                        str(s.get("name") or ""),
                        js_enum(s.get("kind"), SPAN_KINDS, "SPAN_KIND_", "span kind"),
                        js_time(pick(s, "startTimeUnixNano", "start_time_unix_nano"), "startTimeUnixNano"),
                        js_time(pick(s, "endTimeUnixNano", "end_time_unix_nano"), "endTimeUnixNano"),
                        js_enum(status.get("code"), STATUS_CODES, "STATUS_CODE_", "status code"),
                        str(status.get("message") or ""),
                        js_attrs(s.get("attributes")), res, scope_name, scope_version, events, links)
    return out.result()


# ---- logs ------------------------------------------------------------------------------------------

class _LogColumns(_Columns):
    def __init__(self) -> None:
        super().__init__(LOG_SCHEMA)

    def add(self, time_ns: int, observed_ns: int, severity_number: int, severity_text: str, event_name: str,
            body: Any, attrs: dict[str, Any], res: _ResourceContext, scope_name: str, scope_version: str,
            trace_id: str, span_id: str, flags: int) -> None:
        """trace_id and span_id may be empty (a log outside any span); a record with an invalid one is rejected."""
        problem = id_problem((("trace id", trace_id, 32, True), ("span id", span_id, 16, True)))
        if problem is not None:
            self.reject(f"log record at {time_ns}: {problem}")
            return
        trace_id, span_id = trace_id.lower(), span_id.lower()
        c = self.columns
        body_json = dumps_json(body)
        attrs_json = dumps_json(attrs)
        # Log records carry no id of their own; a content hash lets a retried export be stored once.
        identity = "\x1f".join((str(time_ns), str(observed_ns), trace_id, span_id, str(severity_number),
                                event_name, body_json, attrs_json, res.resource_json, scope_name))
        c["log_id"].append(hashlib.blake2b(identity.encode(), digest_size=16).hexdigest())
        c["time_ns"].append(clamp_ns(time_ns))
        c["observed_ns"].append(clamp_ns(observed_ns))
        c["severity_number"].append(severity_number)
        c["severity_text"].append(severity_text or None)
        c["event_name"].append(event_name or None)
        c["body"].append(body_json)
        c["attributes"].append(attrs_json)
        c["resource"].append(res.resource_json)
        c["scope_name"].append(scope_name or None)
        c["scope_version"].append(scope_version or None)
        c["trace_id"].append(trace_id or None)
        c["span_id"].append(span_id or None)
        c["flags"].append(flags)
        c["service_name"].append(res.service_name)
        _append_identity(c, attrs, res)
        c["received_ns"].append(self.received_ns)



def decode_logs_protobuf(body: bytes) -> Decoded:
    request = ExportLogsServiceRequest()
    try:
        request.ParseFromString(body)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise DecodeFailure(f"body is not a protobuf ExportLogsServiceRequest: {exc}{UPB_HINT}") from None
    out = _LogColumns()
    for resource_logs in request.resource_logs:
        res = _ResourceContext(pb_attrs(resource_logs.resource.attributes))
        for scope_logs in resource_logs.scope_logs:
            for r in scope_logs.log_records:
                out.add(r.time_unix_nano, r.observed_time_unix_nano, r.severity_number, r.severity_text,
                        r.event_name, pb_body(r.body), pb_attrs(r.attributes), res, scope_logs.scope.name,
                        scope_logs.scope.version, r.trace_id.hex(), r.span_id.hex(), r.flags)
    return out.result()


def decode_logs_json(body: bytes | dict) -> Decoded:
    doc = body if isinstance(body, dict) else _parse_json(body, "an ExportLogsServiceRequest")
    out = _LogColumns()
    for block in js_list(doc, "resourceLogs", "resource_logs", "the request"):
        res = _js_resource(block)
        for scope_block in js_list(block, "scopeLogs", "scope_logs", "resourceLogs"):
            scope_name, scope_version = _js_scope(scope_block)
            for r in js_list(scope_block, "logRecords", "log_records", "scopeLogs"):
                out.add(js_time(pick(r, "timeUnixNano", "time_unix_nano"), "timeUnixNano"),
                        js_time(pick(r, "observedTimeUnixNano", "observed_time_unix_nano"), "observedTimeUnixNano"),
                        js_enum(pick(r, "severityNumber", "severity_number"), (), "", "severityNumber"),
                        str(pick(r, "severityText", "severity_text") or ""),
                        str(pick(r, "eventName", "event_name") or ""),
                        js_body(r.get("body")),
                        js_attrs(r.get("attributes")), res, scope_name, scope_version,
                        js_id(pick(r, "traceId", "trace_id"), "traceId"),
                        js_id(pick(r, "spanId", "span_id"), "spanId"),
                        as_int(r.get("flags")) or 0)
    return out.result()


DECODERS: dict[tuple[str, str], Callable[[bytes], Decoded]] = {
    ("traces", "protobuf"): decode_traces_protobuf,
    ("traces", "json"): decode_traces_json,
    ("logs", "protobuf"): decode_logs_protobuf,
    ("logs", "json"): decode_logs_json,
}
