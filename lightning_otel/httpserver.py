"""What the project's HTTP servers (collector, gateway) share: threads, keep-alive, no Nagle delay,
IPv6 binding, quiet logging, bounded body draining, and bounds on slow clients (ConnectionLimits).

Slow clients: every read of a request waits at most `read_timeout_s`, the whole request (line, headers,
body) must arrive within `request_timeout_s`, and a kept-alive connection may wait `idle_timeout_s` for its
next request. A client too slow mid-request gets 408 and the connection closes; an idle one is closed. The
clocks run only while a request is received: answers (SSE streams, Arrow query results) are not cut for
their length, only when one write waits `send_timeout_s` (or the server's answer_timeout_s) for a client that
stopped reading.
At most `max_connections` connections get a thread; the ones over it get 503 at once. Kept light: the
stdlib only.

Framing (RFC 9112 section 6), checked once the headers are in and before any route runs, so every server
here reads a body the same way and a proxy in front cannot be made to see another request boundary than we
do: a body is framed by one Content-Length of plain ASCII digits, or there is none. Refused with 400 and a
closed connection: two Content-Length fields (even equal ones) or a list in one, a value that is not plain
digits (`+5`, `1_0`, non-ASCII digits, a value folded onto a next line), Transfer-Encoding with
Content-Length. Transfer-Encoding alone (chunked or any other coding) gets 411: the servers do not implement
it, and the client can send Content-Length. A body a route leaves unread closes the connection, so its bytes
are never parsed as a next request.
"""
from __future__ import annotations

import io
import ipaddress
import logging
import re
import select
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from lightning_otel.errors import UserError

log = logging.getLogger(__name__)

# How long the server keeps reading (and dropping) what a refused or timed-out client still sends after
# the answer, so that closing with unread bytes does not reset the connection before the answer is read.
LINGER_S = 1.0
_DIGITS = re.compile(r"[0-9]{1,18}")  # ASCII digits only (str.isdigit takes '٣'); 18 keep int() cheap


@dataclass
class ConnectionLimits:
    read_timeout_s: float = 10.0  # the longest one read of a request waits for bytes
    # Request line + headers + body, from the first byte (from the accept on a new connection). OTLP
    # exporters give up after 10 s; 32 MB takes well under a second on a local link.
    request_timeout_s: float = 30.0
    # A kept-alive connection waiting for its next request. Longer than client pools keep idle connections
    # (httpx: 5 s), so that the client, not the server, usually closes them: no race with a new request.
    idle_timeout_s: float = 60.0
    max_connections: int = 256  # open connections with a thread each; beyond, 503 + Retry-After
    send_timeout_s: float = 30.0  # one write of an answer waits at most this long for the client to read

    def __post_init__(self) -> None:
        for name in ("read_timeout_s", "request_timeout_s", "idle_timeout_s", "send_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0):
                raise UserError(f"{name}={value!r}: give a positive number of seconds")
        if self.max_connections < 1:
            raise UserError(f"max_connections={self.max_connections}: at least one connection must be served")


def bearer_token(header: str | None) -> str | None:
    """The token of an Authorization header ("Bearer <token>", the scheme in any case), or None."""
    scheme, _, sent = (header or "").strip().partition(" ")
    sent = sent.strip()
    return sent if scheme.lower() == "bearer" and sent else None


def check_exposure(host: str, secured: bool, how: str) -> None:
    """Refuse (UserError) to bind a server to an address other machines reach while it accepts requests without
    a token or key; `how` says what to give."""
    if not secured and not is_loopback(host):
        raise UserError(f"--host {host} makes this server reachable from other machines, and it would answer "
                        f"requests without a token there: {how}, or --insecure-no-auth on a network you trust")


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a server on this machine: a loopback address, or a name whose every
    address is one ("localhost"). An empty host or a wildcard (0.0.0.0, ::) binds every interface."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    if not host:
        return False
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


class _TooSlow(BaseException):
    """The client took too long sending its request. A BaseException, like asyncio.CancelledError: handlers
    catch Exception to answer 500, and must let this through to KeepAliveHandler, which answers 408."""

    def __init__(self, message: str, mid_request: bool):
        super().__init__(message)
        self.mid_request = mid_request  # some of the request arrived (else: idle, nothing to answer)


class _TimedReader(io.RawIOBase):
    """The connection's read side under ConnectionLimits. A socket timeout alone bounds one read only: a
    client sending a byte every few seconds would hold a thread forever."""

    def __init__(self, sock: socket.socket, limits: ConnectionLimits):
        self._sock = sock
        self._limits = limits
        self._deadline: float | None = time.monotonic() + limits.request_timeout_s
        self._received = False  # any byte of the current request

    def readable(self) -> bool:
        return True

    def next_request(self) -> None:
        """Idle until the next request's first byte starts its clock."""
        self._deadline, self._received = None, False

    def readinto(self, buffer: Any) -> int:
        limits = self._limits
        if self._deadline is None:
            wait = limits.idle_timeout_s
        else:
            wait = min(limits.read_timeout_s, self._deadline - time.monotonic())
            if wait <= 0:
                raise _TooSlow(f"the request took over {limits.request_timeout_s:g} s to arrive", self._received)
        self._sock.settimeout(wait)
        try:
            n = self._sock.recv_into(buffer)
        except TimeoutError:
            if self._deadline is None:
                raise _TooSlow(f"idle for {wait:g} s", False) from None
            what = (f"no byte for {wait:g} s" if wait >= limits.read_timeout_s
                    else f"the request took over {limits.request_timeout_s:g} s to arrive")
            raise _TooSlow(what, self._received) from None
        if n and self._deadline is None:
            self._deadline = time.monotonic() + limits.request_timeout_s
        self._received = self._received or n > 0
        return n


class FramingError(ValueError):
    """A request whose body length cannot be known without guessing (RFC 9112 section 6)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def body_length(content_length: list[str], transfer_encoding: list[str]) -> int | None:
    """The body length the request's framing headers (every field of each name) give; None: no body.

    Raises FramingError for framing this server refuses, with the status to answer."""
    if transfer_encoding:
        if content_length:
            raise FramingError(400, "the request has both Transfer-Encoding and Content-Length; send Content-Length "
                                    "only (a proxy could read the body's end differently)")
        codings = ", ".join(value.strip() for value in transfer_encoding)
        raise FramingError(411, f"Transfer-Encoding {codings!r} is not accepted; send the body with Content-Length")
    if not content_length:
        return None
    if len(content_length) > 1 or "," in content_length[0]:
        raise FramingError(400, f"the request has {len(content_length)} Content-Length fields "
                                f"({', '.join(repr(v) for v in content_length)}); send exactly one")
    # The header parser drops the spaces after the colon; one left in front came from a folded line (obs-fold).
    value = content_length[0].rstrip(" \t")
    if not _DIGITS.fullmatch(value):
        raise FramingError(400, f"Content-Length {content_length[0]!r} is not a size: give plain ASCII digits")
    return int(value)


def _linger(sock: socket.socket, deadline: float) -> None:
    """Half-close, then drop what the client still sends until `deadline`: closing with unread bytes would reset
    the connection before the client read its answer."""
    try:
        sock.shutdown(socket.SHUT_WR)
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if not sock.recv(1 << 16):
                break
    except OSError:
        pass  # the client went away: nothing left to tell it


def _answer_and_close(sock: socket.socket, status: bytes, message: str, extra_headers: bytes = b"") -> None:
    """Send a last plain-text answer, half-close, and drop what the client still sends for up to LINGER_S."""
    body = message.encode() + b"\n"
    head = (b"HTTP/1.1 " + status + b"\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\nConnection: close\r\n" + extra_headers + b"\r\n")
    deadline = time.monotonic() + LINGER_S
    try:
        sock.settimeout(LINGER_S)
        sock.sendall(head + body)
    except OSError:
        return  # the client went away: nothing left to tell it
    _linger(sock, deadline)


class LocalServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type, owner: Any,
                 limits: ConnectionLimits | None = None):
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.owner = owner
        self.limits = limits or ConnectionLimits()
        self._slots = threading.BoundedSemaphore(self.limits.max_connections)
        super().__init__(address, handler)

    def process_request(self, request: socket.socket, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            # Refused on a short-lived thread of its own: the accept loop must not wait on a slow client.
            log.info("refusing %s: %d connections open (max_connections)", client_address[0],
                     self.limits.max_connections)
            threading.Thread(target=self._refuse, args=(request,), name="http-refuse", daemon=True).start()
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: socket.socket, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _refuse(self, request: socket.socket) -> None:
        try:
            _answer_and_close(request, b"503 Service Unavailable",
                              f"the server has {self.limits.max_connections} connections open (its max_connections); "
                              f"retry shortly", b"Retry-After: 1\r\n")
        finally:
            request.close()


class KeepAliveHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes; with Nagle on, keep-alive clients wait ~40 ms for the
    # delayed ACK before the body arrives.
    disable_nagle_algorithm = True
    server: LocalServer

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the plain socket file: replaced by one under the server's limits
        self._reader = _TimedReader(self.connection, self.server.limits)
        self.rfile = io.BufferedReader(self._reader)
        self._answering = False

    def handle_one_request(self) -> None:
        self._answering = False
        self.body_length: int | None = None  # from the framing headers, once they are checked
        self._body_read = True
        try:
            super().handle_one_request()
        except _TooSlow as exc:
            self.close_connection = True
            self._close_too_slow(exc)
        else:
            if not self._body_read:
                self.close_connection = True  # its bytes must not be read as the next request
            self._reader.next_request()

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        try:
            self.body_length = body_length(self.headers.get_all("Content-Length", []),
                                           self.headers.get_all("Transfer-Encoding", []))
        except FramingError as exc:
            self.close_connection = True
            log.info("%s: refusing %s %s: %s", self.address_string(), self.command, self.path, exc)
            status = f"{exc.status} {'Bad Request' if exc.status == 400 else 'Length Required'}".encode()
            _answer_and_close(self.connection, status, str(exc))
            return False
        self._body_read = not self.body_length
        return True

    def read_body(self) -> bytes:
        """The request's body, `body_length` bytes (b"" when it has none); shorter when the client stopped."""
        self._body_read = True
        return self.rfile.read(self.body_length) if self.body_length else b""

    def refuse_and_close(self) -> None:
        """After an answer to a request whose body is left unread: half-close and drop what the client still
        sends for up to LINGER_S (a refused client never gets more of the server's time than that)."""
        self.close_connection = True
        self._body_read = True
        try:
            self.wfile.flush()
        except OSError:
            return
        _linger(self.connection, time.monotonic() + LINGER_S)

    def send_response_only(self, code: int, message: str | None = None) -> None:
        if code >= 200:  # not for "100 Continue": the body is still to be received
            self._answering = True
            # An answer takes as long as it takes (streams, big results), but each write of it must be taken by
            # the client within answer_timeout_s: one that stops reading loses the connection, and its thread
            # and slot are freed.
            self.connection.settimeout(self.answer_timeout_s())
        super().send_response_only(code, message)

    def peer_closed(self) -> bool:
        """Whether the client has closed its side of the connection (it left before its answer): the socket is
        readable and holds no more bytes. Safe from another thread while this one waits on work."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except (OSError, ValueError):  # reset, or already closed here
            return True

    def answer_timeout_s(self) -> float:
        """How long one write of an answer may wait for the client to take bytes (servers set their own)."""
        return self.server.limits.send_timeout_s

    def _close_too_slow(self, exc: _TooSlow) -> None:
        if not exc.mid_request:
            log.debug("%s: closing the connection, %s", self.address_string(), exc)
            return
        log.info("%s: closing a request that is too slow to arrive: %s", self.address_string(), exc)
        if not self._answering:
            _answer_and_close(self.connection, b"408 Request Timeout", f"request timeout: {exc}")

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug("%s %s", self.address_string(), format % args)

    def discard_body(self, length: int, limit: int) -> None:
        """Read and drop `length` bytes in small pieces, so a refused client still gets the answer on a
        usable connection; past `limit` the connection is closed instead of read."""
        self._body_read = True
        if length > limit:
            self.close_connection = True
            return
        while length > 0:
            piece = self.rfile.read(min(length, 1 << 16))
            if not piece:
                break
            length -= len(piece)
