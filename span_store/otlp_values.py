"""OTLP's values as the decoders read them: AnyValue and attribute lists (protobuf and JSON, bounded in depth),
OTLP/JSON's enums, times and ids, and the id rule both encodings share. A value that breaks a rule raises
DecodeFailure with a message naming it."""
from __future__ import annotations

import base64
import re
from typing import Any

import orjson


class DecodeFailure(ValueError):
    """The request body is not a valid OTLP export request; nothing of it may be stored."""


INT64_MAX = 2**63 - 1
# arrayValue/kvlistValue levels an attribute value or log body may have (a plain value is level 1). Protobuf's
# own parser stops at 100 nested messages and a kvlist level costs 3 of them (AnyValue, KeyValueList, KeyValue):
# 32 levels is the most every place a value can sit holds, so JSON is held to the same and both accept alike.
MAX_VALUE_DEPTH = 32
def dumps_json(value: Any) -> str:
    # NaN and infinities have no JSON form; orjson writes them as null.
    return orjson.dumps(value).decode()


def as_int(value: Any) -> int | None:
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: int(float("inf"))
        return None
    return number if -INT64_MAX - 1 <= number <= INT64_MAX else None


def as_str(value: Any) -> str | None:
    return None if value is None else str(value)


def clamp_ns(value: int) -> int:
    # fixed64 timestamps above int64 are nonsense (after year 2262); keep the row, clamp the field.
    return value if value <= INT64_MAX else INT64_MAX


class ValueTooDeep(DecodeFailure):
    """An AnyValue nested deeper than MAX_VALUE_DEPTH; `where` is set by the outermost attribute list."""

    def __init__(self) -> None:
        super().__init__()
        self.where = "a value"

    def __str__(self) -> str:
        return (f"{self.where} nests arrayValue/kvlistValue more than {MAX_VALUE_DEPTH} levels deep; "
                f"flatten it, or send it as a JSON string")


# ---- protobuf AnyValue -----------------------------------------------------------------------------

def pb_value(value: Any, depth: int = 1) -> Any:
    if depth > MAX_VALUE_DEPTH:
        raise ValueTooDeep
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [pb_value(item, depth + 1) for item in value.array_value.values]
    if kind == "kvlist_value":
        return pb_attrs(value.kvlist_value.values, depth + 1)
    if kind == "bytes_value":
        return base64.b64encode(value.bytes_value).decode()
    return getattr(value, kind)


SCALAR_KINDS = frozenset(("string_value", "int_value", "double_value", "bool_value"))


def pb_attrs(key_values: Any, depth: int = 1) -> dict[str, Any]:
    # The hot loop of ingest: scalars inline, one call fewer per attribute than pb_value.
    out = {}
    key = ""
    try:
        if depth > MAX_VALUE_DEPTH and key_values:
            raise ValueTooDeep
        for kv in key_values:
            key, value = kv.key, kv.value
            kind = value.WhichOneof("value")
            out[key] = getattr(value, kind) if kind in SCALAR_KINDS else pb_value(value, depth)
    except ValueTooDeep as exc:
        exc.where = f"attribute {key!r}"  # the outermost list sets it last
        raise
    return out


# ---- JSON AnyValue ---------------------------------------------------------------------------------

def pick(obj: dict, camel: str, snake: str | None = None, default: Any = None) -> Any:
    if camel in obj:
        return obj[camel]
    if snake is not None and snake in obj:
        return obj[snake]
    return default


def js_value(value: Any, depth: int = 1) -> Any:
    if depth > MAX_VALUE_DEPTH:
        raise ValueTooDeep
    if not isinstance(value, dict):
        raise DecodeFailure(f"an attribute value must be an AnyValue object, got {type(value).__name__}")
    for key, snake in (("stringValue", "string_value"), ("boolValue", "bool_value")):
        if key in value or snake in value:
            return pick(value, key, snake)
    if "intValue" in value or "int_value" in value:
        number = as_int(pick(value, "intValue", "int_value"))
        if number is None:
            raise DecodeFailure(f"intValue {pick(value, 'intValue', 'int_value')!r} is not a 64-bit integer")
        return number
    if "doubleValue" in value or "double_value" in value:
        raw = pick(value, "doubleValue", "double_value")
        try:
            return float(raw)
        except (TypeError, ValueError):
            raise DecodeFailure(f"doubleValue {raw!r} is not a number") from None
    if "arrayValue" in value or "array_value" in value:
        items = pick(pick(value, "arrayValue", "array_value") or {}, "values", default=[]) or []
        if not isinstance(items, list):
            raise DecodeFailure("arrayValue 'values' must be a list")
        return [js_value(item, depth + 1) for item in items]
    if "kvlistValue" in value or "kvlist_value" in value:
        return js_attrs(pick(pick(value, "kvlistValue", "kvlist_value") or {}, "values", default=[]), depth + 1)
    if "bytesValue" in value or "bytes_value" in value:
        return pick(value, "bytesValue", "bytes_value")
    return None


def js_attrs(key_values: Any, depth: int = 1) -> dict[str, Any]:
    if key_values is None:
        return {}
    if not isinstance(key_values, list):
        raise DecodeFailure("attributes must be a list of {key, value} objects")
    out = {}
    for kv in key_values:
        # proto3 JSON omits default values, so a missing key is the empty string.
        if not isinstance(kv, dict) or not isinstance(kv.get("key", ""), str):
            raise DecodeFailure("each attribute must be an object with a string 'key'")
        key = kv.get("key", "")
        try:
            out[key] = js_value(kv.get("value", {}), depth)
        except ValueTooDeep as exc:
            exc.where = f"attribute {key!r}"  # the outermost list sets it last
            raise
    return out


def js_id(value: Any, what: str) -> str:
    """An id as sent; whether it is a valid one is up to the row builder (it rejects that record alone)."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise DecodeFailure(f"{what} must be a string of hex digits, got {type(value).__name__}")
    return value


def js_body(value: Any) -> Any:
    try:
        return None if value is None else js_value(value)
    except ValueTooDeep as exc:
        exc.where = "a log record body"
        raise


def pb_body(value: Any) -> Any:
    try:
        return pb_value(value)
    except ValueTooDeep as exc:
        exc.where = "a log record body"
        raise


def js_list(obj: dict, camel: str, snake: str, what: str) -> list:
    items = pick(obj, camel, snake, default=[])
    if items is None:
        return []
    if not isinstance(items, list):
        raise DecodeFailure(f"'{camel}' in {what} must be a list")
    for item in items:
        if not isinstance(item, dict):
            raise DecodeFailure(f"each entry of '{camel}' in {what} must be an object")
    return items


def js_enum(value: Any, names: tuple[str, ...], prefix: str, what: str) -> int:
    if value is None:
        return 0
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        short = value.upper().removeprefix(prefix)
        if short in names:
            return names.index(short)
        number = as_int(value)
        if number is not None:
            return number
    raise DecodeFailure(f"{what} {value!r} is not a valid enum value")


def js_time(value: Any, what: str) -> int:
    if value in (None, ""):
        return 0
    number = as_int(value) if not isinstance(value, float) else int(value)
    if number is None:
        try:
            number = int(value)
        except (TypeError, ValueError):
            raise DecodeFailure(f"{what} {value!r} is not an integer number of nanoseconds") from None
        number = clamp_ns(number)
    if number < 0:
        raise DecodeFailure(f"{what} {value!r} is negative")
    return number



_HEX_ID = {n: re.compile(f"[0-9a-fA-F]{{{n}}}") for n in (16, 32)}
_ID_RULE = {32: "32 hex digits (16 bytes), not all zero", 16: "16 hex digits (8 bytes), not all zero"}


def valid_id(value: str, length: int) -> bool:
    """An OTLP id: exactly `length` ASCII hex digits (either case; no sign, space, 0x or _), not all zero.
    Protobuf ids arrive as bytes.hex(), so one rule covers both encodings."""
    return _HEX_ID[length].fullmatch(value) is not None and value.strip("0") != ""


def id_problem(ids: tuple[tuple[str, str, int, bool], ...]) -> str | None:
    """The first of (what, value, length, may_be_empty) that is not a valid id, as an error message part."""
    for what, value, length, may_be_empty in ids:
        if may_be_empty and not value:
            continue
        if not valid_id(value, length):
            return f"{what} {value!r} is not {_ID_RULE[length]}"
    return None
