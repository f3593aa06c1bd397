"""Encode OTLP protobuf requests as OTLP/JSON the way the specification says (hex ids, integer enums),
so tests can send the same spans in both encodings."""
from __future__ import annotations

import base64

from google.protobuf.json_format import MessageToDict

ID_KEYS = {"traceId", "spanId", "parentSpanId"}


def _hex_ids(node):
    if isinstance(node, dict):
        return {k: (base64.b64decode(v).hex() if k in ID_KEYS and isinstance(v, str) else _hex_ids(v))
                for k, v in node.items()}
    if isinstance(node, list):
        return [_hex_ids(item) for item in node]
    return node


def request_to_json(request) -> dict:
    return _hex_ids(MessageToDict(request, use_integers_for_enums=True))
