"""Stored spans back into OTLP: rows of the `spans` table (its JSON columns parsed) as one protobuf
ExportTraceServiceRequest, the inverse of the decoders in otlp.py.

What the store keeps, comes back: ids (hex -> bytes), parent, trace state, flags, name, kind, times, status,
attributes, resource, scope name and version, events and links. Attribute values come back as the JSON the
store holds allows: strings, bools, 64-bit integers, doubles (JSON keeps `1.0` apart from `1`), arrays and
key-value lists; a bytes value was stored as its base64 text and comes back as that string, a value too large for
int64 as a double. What the store never kept (dropped counts, the scope's attributes and schema URLs) is not sent.
"""
from __future__ import annotations

from typing import Any, Iterable

import orjson
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from lightning_otel.span_store.otlp import SPAN_KINDS, STATUS_CODES

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# The columns of `spans` a request is built from (`attributes`, `resource`, `events`, `links` as JSON text).
SPAN_COLUMNS = ("trace_id", "span_id", "parent_span_id", "trace_state", "flags", "name", "kind", "start_ns",
                "end_ns", "status_code", "status_message", "attributes", "resource", "scope_name", "scope_version",
                "events", "links")


def set_any_value(target: AnyValue, value: Any) -> None:
    """Fill an AnyValue from a JSON value (None leaves it empty, as OTLP's empty value)."""
    if value is None:
        return
    if isinstance(value, bool):  # before int: bool is an int in Python
        target.bool_value = value
    elif isinstance(value, int):
        if INT64_MIN <= value <= INT64_MAX:
            target.int_value = value
        else:
            target.double_value = float(value)
    elif isinstance(value, float):
        target.double_value = value
    elif isinstance(value, str):
        target.string_value = value
    elif isinstance(value, list):
        values = target.array_value.values
        for item in value:
            set_any_value(values.add(), item)
        if not value:
            target.array_value.SetInParent()  # an empty array stays an array
    elif isinstance(value, dict):
        add_attributes(target.kvlist_value.values, value)
        if not value:
            target.kvlist_value.SetInParent()
    else:
        target.string_value = str(value)


def add_attributes(target: Any, attributes: dict[str, Any] | None) -> None:
    """Append {key: value} to a repeated KeyValue field."""
    for key, value in (attributes or {}).items():
        kv: KeyValue = target.add()
        kv.key = key
        set_any_value(kv.value, value)


def _enum(text: str | None, names: tuple[str, ...]) -> int:
    """A stored enum name (or the number stored for an unknown one) as its number."""
    if not text:
        return 0
    if text in names:
        return names.index(text)
    try:
        return int(text)
    except ValueError:
        return 0


def _json(text: str | None) -> Any:
    return orjson.loads(text) if text else None


def _fill_span(span: Span, row: dict[str, Any], extra: dict[str, Any] | None) -> None:
    span.trace_id = bytes.fromhex(row["trace_id"])
    span.span_id = bytes.fromhex(row["span_id"])
    if row.get("parent_span_id"):
        span.parent_span_id = bytes.fromhex(row["parent_span_id"])
    if row.get("trace_state"):
        span.trace_state = row["trace_state"]
    if row.get("flags"):
        span.flags = int(row["flags"])
    span.name = row["name"]
    span.kind = _enum(row.get("kind"), SPAN_KINDS)  # type: ignore[assignment]
    span.start_time_unix_nano = int(row.get("start_ns") or 0)
    span.end_time_unix_nano = int(row.get("end_ns") or 0)
    code = _enum(row.get("status_code"), STATUS_CODES)
    if code or row.get("status_message"):
        span.status.code = code  # type: ignore[assignment]
        span.status.message = row.get("status_message") or ""
    attributes = _json(row.get("attributes")) or {}
    add_attributes(span.attributes, attributes)
    # Added attributes never replace one the span has: what the agent recorded comes back as it was.
    add_attributes(span.attributes, {k: v for k, v in (extra or {}).items() if k not in attributes})
    for event in _json(row.get("events")) or []:
        out = span.events.add()
        out.time_unix_nano = int(event.get("time_ns") or 0)
        out.name = event.get("name") or ""
        add_attributes(out.attributes, event.get("attributes"))
    for link in _json(row.get("links")) or []:
        out = span.links.add()
        out.trace_id = bytes.fromhex(link["trace_id"])
        out.span_id = bytes.fromhex(link["span_id"])
        if link.get("trace_state"):
            out.trace_state = link["trace_state"]
        add_attributes(out.attributes, link.get("attributes"))


def encode_spans(rows: Iterable[dict[str, Any]],
                 extra_attributes: dict[tuple[str, str], dict[str, Any]] | None = None) -> ExportTraceServiceRequest:
    """One export request of stored span rows (dicts with SPAN_COLUMNS): one ResourceSpans per distinct resource
    JSON, within it one ScopeSpans per (scope name, version), in the order the rows come. `extra_attributes`:
    (trace_id, span_id) -> attributes to add to that span."""
    request = ExportTraceServiceRequest()
    resources: dict[str, Any] = {}
    scopes: dict[tuple[str, str | None, str | None], Any] = {}
    extra_attributes = extra_attributes or {}
    for row in rows:
        resource_key = row.get("resource") or ""
        resource_spans = resources.get(resource_key)
        if resource_spans is None:
            resource_spans = resources[resource_key] = request.resource_spans.add()
            add_attributes(resource_spans.resource.attributes, _json(resource_key))
        scope_key = (resource_key, row.get("scope_name"), row.get("scope_version"))
        scope_spans = scopes.get(scope_key)
        if scope_spans is None:
            scope_spans = scopes[scope_key] = resource_spans.scope_spans.add()
            scope_spans.scope.name = row.get("scope_name") or ""
            scope_spans.scope.version = row.get("scope_version") or ""
        _fill_span(scope_spans.spans.add(), row, extra_attributes.get((row["trace_id"], row["span_id"])))
    return request
