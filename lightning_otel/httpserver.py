"""What the project's HTTP servers (collector, gateway) share: threads, keep-alive, no Nagle delay,
IPv6 binding, quiet logging and bounded body draining. Kept light: the stdlib only."""
from __future__ import annotations

import logging
import socket
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger(__name__)


class LocalServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type, owner: Any):
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.owner = owner
        super().__init__(address, handler)


class KeepAliveHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes; with Nagle on, keep-alive clients wait ~40 ms for the
    # delayed ACK before the body arrives.
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug("%s %s", self.address_string(), format % args)

    def discard_body(self, length: int, limit: int) -> None:
        """Read and drop `length` bytes in small pieces, so a refused client still gets the answer on a
        usable connection; past `limit` the connection is closed instead of read."""
        if length > limit:
            self.close_connection = True
            return
        while length > 0:
            piece = self.rfile.read(min(length, 1 << 16))
            if not piece:
                break
            length -= len(piece)
