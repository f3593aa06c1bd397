"""What the collector reads from a request before it decodes the body: the media type, the body as sent before
compression, the bearer token and the roles it holds; and the gRPC code that OTLP/HTTP error bodies carry."""
from __future__ import annotations

import hmac
import zlib
from http import HTTPStatus

from lightning_otel.httpserver import bearer_token


class RequestError(Exception):
    def __init__(self, status: HTTPStatus, message: str, retry_after: int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after


def media_type(header: str | None) -> str:
    return (header or "").split(";", 1)[0].strip().lower()


def decompress(body: bytes, encoding: str, limit: int) -> bytes:
    """The body as sent before compression, at most `limit` bytes of it.

    gzip: every member in turn. A gzip body may be several members (RFC 1952 section 2.2; proxies that
    compress in chunks send them), and their data concatenate. deflate: one zlib stream. Bytes after the last
    complete stream are refused: a 200 would acknowledge data that was never read."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise RequestError(HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                           f"Content-Encoding {encoding!r} is not supported; use gzip, deflate or none")
    wbits = 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS
    view, parts, size, pos = memoryview(body), [], 0, 0
    while True:  # one member per turn
        inflater, chunk = zlib.decompressobj(wbits), 512
        while not inflater.eof:
            if pos == len(body):
                stops = "the stream" if not parts else f"member {len(parts) + 1}"
                raise RequestError(HTTPStatus.BAD_REQUEST, f"body is truncated {encoding} data (it stops inside "
                                                           f"{stops})")
            # zlib copies what follows a member's end (unused_data): input handed over in growing chunks keeps
            # that copy about the size of the member, so a body of many tiny members costs linear time.
            data, chunk = view[pos:pos + chunk], min(2 * chunk, 1 << 20)
            try:
                out = inflater.decompress(data, limit - size + 1)  # never 0, which would mean no limit
            except zlib.error as exc:
                raise RequestError(HTTPStatus.BAD_REQUEST, damage_message(encoding, len(parts), pos, exc)) from None
            pos += len(data)
            size += len(out)
            if size > limit:
                raise RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                   f"body is over the {limit}-byte limit once decompressed; send smaller batches")
            parts.append(out)
        pos -= len(inflater.unused_data)
        if pos == len(body):
            return b"".join(parts)
        if encoding == "deflate":
            raise RequestError(HTTPStatus.BAD_REQUEST,
                               f"{len(body) - pos} bytes follow the end of the deflate (zlib) stream at byte {pos}; "
                               f"send one stream and nothing after it")


def damage_message(encoding: str, members: int, at: int, exc: zlib.error) -> str:
    if not members:
        return f"body is not valid {encoding} data: {exc}"
    return (f"the bytes after gzip member {members} (from about byte {at}) are not another gzip member ({exc}); "
            f"send whole gzip members and nothing after them")


def roles_holding(tokens: dict[str, str], header: str | None) -> set[str]:
    """The roles whose token `header` ("Bearer <token>") carries; every token compared in constant time."""
    sent = bearer_token(header)
    if sent is None:
        return set()
    sent_bytes = sent.encode()
    matches = {role: hmac.compare_digest(sent_bytes, token.encode()) for role, token in tokens.items()}
    return {role for role, match in matches.items() if match}


def grpc_code(status: int) -> int:
    """google.rpc.Code for an HTTP status, as OTLP/HTTP error bodies carry it."""
    return {400: 3, 401: 16, 403: 7, 404: 5, 405: 12, 411: 3, 413: 3, 415: 3, 429: 8, 503: 14}.get(int(status), 13)
