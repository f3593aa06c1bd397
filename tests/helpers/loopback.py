"""Small HTTP servers for tests, on 127.0.0.1 at a free port, each in a daemon thread. They play what cannot run
here or cannot be made to fail on demand: a closed model's API, a model hub, an endpoint that is busy or hangs."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class QuietHandler(BaseHTTPRequestHandler):
    """A request handler that logs nothing, with helpers to read a body and to answer."""

    def log_message(self, *args) -> None:
        pass

    def body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def json_body(self):
        return json.loads(self.body())

    def answer(self, status: int, payload: bytes | dict | list = b"", headers: dict | None = None) -> None:
        """Answer with `payload` (a dict or list goes as JSON). A client that already gave up (a test of a slow
        answer) is no error here."""
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        headers = dict(headers or {})
        if not isinstance(payload, bytes):
            headers.setdefault("Content-Type", "application/json")
        try:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            pass


class LoopbackServer:
    """`handler` (a request handler class) served on 127.0.0.1; `url` is its address plus `path`."""

    def __init__(self, handler: type[BaseHTTPRequestHandler], path: str = ""):
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}{path}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> "LoopbackServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
