"""The rollout gateway's HTTP side: routes, the API key, errors in OpenAI's shape, answers that a client must
take in time, and streams written out event by event as the gateway's streams yield them. What a request does
is the Gateway's (gateway.py); how a stream is sampled and recorded is streaming.py's."""
from __future__ import annotations

import contextlib
import hmac
import json
import logging
import socket
import struct
from typing import TYPE_CHECKING, Iterable, Iterator

from lightning_otel.httpserver import KeepAliveHandler, LocalServer, bearer_token
from lightning_otel.serve.engine import EngineError
from lightning_otel.serve.request_checks import BadRequest, check_rollout_id, parse_body
from lightning_otel.serve.responses import ResponseStream
from lightning_otel.serve.streaming import AnswerStream

if TYPE_CHECKING:
    from lightning_otel.serve.gateway import Gateway

log = logging.getLogger(__name__)


def chat_sse(stream: AnswerStream) -> Iterator[bytes | None]:
    """A chat stream as server-sent events, `[DONE]` last; None where the stream had nothing for the client."""
    for chunks in stream:
        if not chunks:
            yield None
        for chunk in chunks:
            yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


class GatewayServer(LocalServer):
    @property
    def gateway(self) -> "Gateway":
        return self.owner


class GatewayHandler(KeepAliveHandler):
    server: GatewayServer

    def _route(self) -> tuple[str | None, str]:
        """The rollout (the /r/<rollout_id>/ prefix, else the X-Lightning-Rollout-Id header) and the path under
        it. Ids are checked (check_rollout_id); a prefix and a header that name different rollouts are refused."""
        path = self.path.split("?", 1)[0]
        header = self.headers.get("X-Lightning-Rollout-Id")
        if not path.startswith("/r/"):
            if header is not None:
                check_rollout_id(header)
            return header, path
        rollout_id, _, tail = path[len("/r/"):].partition("/")
        check_rollout_id(rollout_id)
        if header is not None and header != rollout_id:
            raise BadRequest(f"the path names rollout {rollout_id} and the X-Lightning-Rollout-Id header names "
                             f"{header[:80]!r}: name one rollout", "rollout_id")
        return rollout_id, "/" + tail

    def answer_timeout_s(self) -> float:
        return self.server.gateway.config.send_timeout_s

    def _send(self, status: int, content_type: str, chunks: Iterable[bytes | None], length: int | None = None) -> None:
        """Answer with `chunks`: a body of `length` bytes, or (None) a stream that ends with the connection,
        each chunk written as it comes (None: nothing to write yet, but a client that has left ends the stream).
        A client that stops reading for send_timeout_s loses the connection; its thread is freed."""
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            if length is None:
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.close_connection = True
            else:
                self.send_header("Content-Length", str(length))
            self.end_headers()
            for chunk in chunks:
                if chunk is not None:
                    self.wfile.write(chunk)
                elif self.peer_closed():
                    raise ConnectionResetError("the client closed the connection")
        except OSError as exc:  # TimeoutError included
            log.info("%s: dropping the connection, the answer could not be sent: %s", self.address_string(),
                     exc or type(exc).__name__)
            self.close_connection = True
            with contextlib.suppress(OSError):  # reset: the kernel must not keep the unread bytes queued
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    def _stream(self, stream: AnswerStream | ResponseStream, events: Iterable[bytes | None]) -> None:
        """Send a stream's events as they come; however it ends (whole, the client gone or too slow, a failure
        after the first byte, which can no longer be an error status), the stream is closed: a generation still
        running is dropped, and what was generated is recorded."""
        try:
            self._send(200, "text/event-stream", events)
        except Exception:  # noqa: BLE001 - the answer has begun: end it, and keep the gateway up
            log.exception("gateway error while streaming %s", self.path[:200])
            self.close_connection = True
        finally:
            stream.close()

    def _json(self, status: int, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self._send(status, "application/json", [body], len(body))

    def _error(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> None:
        self._json(status, {"error": {"message": message, "type": kind, "param": param, "code": status}})

    def _authorized(self) -> bool:
        """With an API key set, only requests that send it (`Authorization: Bearer <key>`, compared in constant
        time) get through; any other gets a 401 before its body is read, and the connection is closed."""
        key = self.server.gateway.config.api_key
        sent = bearer_token(self.headers.get("Authorization"))
        if key is None or (sent is not None and hmac.compare_digest(sent.encode(), key.encode())):
            return True
        self._json(401, {"error": {"message": "missing or wrong API key: send 'Authorization: Bearer <key>' with the "
                                              "key this server was started with (OPENAI_API_KEY for OpenAI clients)",
                                   "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}})
        self.refuse_and_close()
        return False

    def do_GET(self) -> None:  # noqa: N802
        if self.path.split("?", 1)[0] != "/health" and not self._authorized():
            return
        try:
            _, path = self._route()
        except BadRequest as exc:
            return self._error(exc.status, exc.message, param=exc.param)
        if path in ("/v1/models", "/models") and self.server.gateway.outside is not None:
            headers = {k.lower(): v for k, v in self.headers.items()}
            try:
                return self._json(200, self.server.gateway.outside.models(headers))
            except EngineError as exc:
                return self._json(exc.status, exc.body)
        if path in ("/v1/models", "/models"):
            engine = self.server.gateway.engine
            # one adapter per agent: each adapter too, by the name an agent may ask for it by
            adapters = [{"id": name, "object": "model", "owned_by": "lightning-otel", "adapter_of": pattern,
                         "policy_version": engine.policy_version}
                        for name, pattern in self.server.gateway.config.adapters.items()]
            return self._json(200, {"object": "list", "data": [
                {"id": engine.model_name, "object": "model", "owned_by": "lightning-otel",
                 "policy_version": engine.policy_version}, *adapters]})
        if path == "/health":
            return self._json(200, {"status": "ok"})
        self._error(404, f"no endpoint GET {path}", "not_found")

    def do_POST(self) -> None:  # noqa: N802
        gateway = self.server.gateway
        if not self._authorized():
            return
        length = self.body_length  # framing checked by KeepAliveHandler: one plain Content-Length, or none
        if length is None:
            self.close_connection = True
            return self._error(411, "Content-Length is required")
        if length > gateway.config.max_body_bytes:
            self.discard_body(length, 4 * gateway.config.max_body_bytes)
            return self._error(413, f"request body is over the {gateway.config.max_body_bytes}-byte limit")
        raw = self.read_body()
        headers = {k.lower(): v for k, v in self.headers.items()}
        # The whole request, a stream until it is closed and recorded, runs under one policy version (gate.py).
        with gateway.gate.request():
            self._answer(gateway, raw, headers)

    def _answer(self, gateway: "Gateway", raw: bytes, headers: dict[str, str]) -> None:
        try:
            rollout_id, path = self._route()
            body = parse_body(raw)
            streamed = isinstance(body, dict) and body.get("stream") is True  # other values: the checks refuse them
            if path in ("/v1/chat/completions", "/chat/completions"):
                if streamed:
                    stream = gateway.chat_stream(body, headers, rollout_id)
                    return self._stream(stream, chat_sse(stream))
                response = gateway.chat(body, headers, rollout_id)
                response.pop("_token_pieces", None)
                return self._json(200, response)
            if path in ("/v1/responses", "/responses"):
                if streamed:
                    answer = gateway.respond_stream(body, headers, rollout_id)
                    return self._stream(answer, answer)
                return self._json(200, gateway.respond(body, headers, rollout_id))
            if path in ("/v1/completions", "/completions"):
                return self._json(200, gateway.complete(body, headers, rollout_id))
            return self._error(404, f"no endpoint POST {path}", "not_found")
        except BadRequest as exc:
            return self._error(exc.status, exc.message, param=exc.param)
        except EngineError as exc:
            error = exc.body.get("error") if isinstance(exc.body.get("error"), dict) else {"message": str(exc)}
            return self._json(exc.status, {"error": {**error, "code": exc.status}})
        except Exception as exc:  # noqa: BLE001 - one bad request must not take the gateway down
            log.exception("gateway error on %s", self.path[:200])
            return self._error(500, f"internal error: {exc}", "server_error")
