"""The viewer's HTTP server (`lightning-otel view`): GET pages, the static files, and one write, POST
/rollout/<id>/feedback, which needs the collector's admin token and goes through its admin route.

Loopback by default. When a collector holds the store and its query role has a token, every request must carry
the query (or admin) token: as `Authorization: Bearer <token>`, or once as `?token=` (the address the command
prints), which sets a cookie for the rest of the session. Pages are read-only: GET and HEAD only, except the
feedback form. A Content-Security-Policy keeps the page on this server: it loads nothing from the network.
A viewer on a loopback address answers only requests addressed to a loopback name (the Host header), so a web
page elsewhere cannot read it by pointing a name of its own at 127.0.0.1 (DNS rebinding).
"""
from __future__ import annotations

import hmac
import ipaddress
import logging
import threading
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from http.cookies import SimpleCookie
from importlib import resources
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlsplit

from lightning_otel.errors import UserError
from lightning_otel.httpserver import ConnectionLimits, KeepAliveHandler, LocalServer, bearer_token, check_exposure
from lightning_otel.span_store.feedback import Feedback
from lightning_otel.view import pages, queries, runs, tokens
from lightning_otel.view.html import esc, page, rollout_url
from lightning_otel.view.source import StoreSource

log = logging.getLogger(__name__)
MAX_FORM_BYTES = 64 * 1024
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
COOKIE = "lightning_view_token"
STATIC_TYPES = {".css": "text/css; charset=utf-8", ".js": "text/javascript; charset=utf-8"}
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
                               "form-action 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-store"}


@dataclass
class ViewConfig:
    db: Path | None = None
    run: Path | None = None           # a run folder: its traces.duckdb, metrics.jsonl, rounds' transitions
    # compile's Parquet; default: the run folder's transitions.parquet, else the Parquet each of its training
    # rounds wrote (rounds/round-NNNN/transitions.parquet), else the store's view
    transitions: Path | list[Path] | None = None
    model: str | None = "bundled"     # whose tokenizer turns token ids into text
    reward: str | None = None         # the reward name shown first; default: the most stored one
    host: str = "127.0.0.1"
    port: int = 8765
    insecure_no_auth: bool = False
    limits: ConnectionLimits = field(default_factory=ConnectionLimits)

    def __post_init__(self) -> None:
        if self.run is not None:
            self.run = Path(self.run)
            if not self.run.is_dir():
                raise UserError(f"--run {self.run}: no such folder; give the output_dir of `lightning-otel train`")
            if self.db is None:
                self.db = self.run / "traces.duckdb"
            if self.transitions is None and (self.run / "transitions.parquet").is_file():
                self.transitions = self.run / "transitions.parquet"
            elif self.transitions is None:
                self.transitions = sorted(self.run.glob("rounds/round-*/transitions.parquet")) or None
        if self.db is None:
            raise UserError("give the store to view: --db traces.duckdb, or --run RUN_FOLDER")
        self.db = Path(self.db)
        if not self.db.is_file():
            raise UserError(f"no trace store at {self.db}: give the DuckDB file of `lightning-otel collect` (--db) "
                            f"or a run folder that holds traces.duckdb (--run)")
        if isinstance(self.transitions, (str, Path)):
            self.transitions = Path(self.transitions)
            if not self.transitions.is_file():
                raise UserError(f"--transitions {self.transitions}: no such file; give the Parquet that "
                                f"`lightning-otel compile --out` wrote")
        if not 0 <= self.port <= 65535:
            raise UserError(f"--port {self.port}: give a port between 0 and 65535 (0 picks a free one)")


class Viewer:
    """Owns the server thread and the store source. Use as a context manager, or start()/close()."""

    def __init__(self, config: ViewConfig):
        self.config = config
        self.source = StoreSource(config.db)
        self.texts = tokens.TokenText(config.model)
        live = self.source.collector()
        check_exposure(config.host, bool(live and self.source.read_tokens()) or config.insecure_no_auth,
                       "start the collector with a query token (--query-token or --token)")
        self.server = LocalServer((config.host, config.port), ViewerHandler, self, config.limits)
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{'[' + host + ']' if ':' in host else host}:{port}"

    def start(self) -> Viewer:
        self.thread = threading.Thread(target=self.server.serve_forever, name="viewer", daemon=True)
        self.thread.start()
        return self

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.source.close()

    def __enter__(self) -> Viewer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class ViewerHandler(KeepAliveHandler):
    server: LocalServer

    @property
    def viewer(self) -> Viewer:
        return self.server.owner

    def do_HEAD(self) -> None:  # noqa: N802 - stdlib naming
        self.do_GET()

    def do_GET(self) -> None:  # noqa: N802
        if not self._host_allowed():
            return
        parts = urlsplit(self.path)
        params = dict(parse_qsl(parts.query, keep_blank_values=True))
        if parts.path.startswith("/static/"):
            return self._static(parts.path[len("/static/"):])
        if parts.path == "/health":
            return self._send(HTTPStatus.OK, b'{"status": "ok"}', "application/json")
        if not self._authorised(params.pop("token", None), parts):
            return
        self._page(parts.path, params)

    def do_POST(self) -> None:  # noqa: N802
        if not self._host_allowed():
            return
        parts = urlsplit(self.path)
        if not (parts.path.startswith("/rollout/") and parts.path.endswith("/feedback")):
            return self._refuse(HTTPStatus.METHOD_NOT_ALLOWED, "the viewer is read-only: only the feedback form "
                                                               "(POST /rollout/<id>/feedback) writes")
        if self.body_length is None:
            return self._refuse(HTTPStatus.LENGTH_REQUIRED, "send the form with a Content-Length")
        if self.body_length > MAX_FORM_BYTES:
            self.discard_body(self.body_length, 0)
            return self._refuse(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"the form is over {MAX_FORM_BYTES} bytes")
        body = self.read_body()
        try:
            form = dict(parse_qsl(body.decode("utf-8"), keep_blank_values=True, strict_parsing=bool(body)))
        except (UnicodeDecodeError, ValueError):
            form = None
        token = (form or {}).pop("admin_token", None) or bearer_token(self.headers.get("Authorization"))
        if not self._authorised(token, parts):
            return
        if form is None:
            return self._refuse(HTTPStatus.BAD_REQUEST, "the form is not URL-encoded UTF-8 text")
        rollout_id = unquote(parts.path[len("/rollout/"):-len("/feedback")])
        try:
            score = Feedback(rollout_id=rollout_id, name=form.get("name", ""), value=form.get("value", ""),
                             span_id=form.get("span_id") or None, comment=form.get("comment") or None,
                             author=form.get("author") or None)
            row = self.viewer.source.write_feedback(score, token)
        except PermissionError as exc:
            status = HTTPStatus.UNAUTHORIZED if not token else HTTPStatus.FORBIDDEN
            return self._refuse(status, str(exc))
        except UserError as exc:
            return self._refuse(HTTPStatus.BAD_REQUEST, str(exc))
        notice = (f'<p class="notice" id="stored">stored {esc(row["name"])} = {esc(row["value"])} for '
                  f'{"span " + esc(row["span_id"]) if row.get("span_id") else "the rollout"}</p>')
        self._page(parts.path[:-len("/feedback")], {}, notice)

    # ---- pieces -------------------------------------------------------------------------------------------

    def _host_allowed(self) -> bool:
        """On a loopback address, only requests for a loopback name (DNS rebinding: another site's name that
        resolves to 127.0.0.1 would otherwise reach the viewer from that site's pages)."""
        if not _is_loopback(self.viewer.config.host):
            return True
        host = urlsplit("//" + (self.headers.get("Host") or "")).hostname or ""
        if host in LOOPBACK_NAMES or host.endswith(".localhost") or _is_loopback(host):
            return True
        if self.command == "POST":
            self.discard_body(self.body_length or 0, MAX_FORM_BYTES)
        self._refuse(HTTPStatus.FORBIDDEN, f"this viewer listens on {self.viewer.config.host} and answers requests "
                                           f"for localhost or 127.0.0.1 only, not for {host or 'no Host'}")
        return False

    def _authorised(self, query_token: str | None, parts) -> bool:
        wanted = self.viewer.source.read_tokens()
        if not wanted:
            return True
        cookie = SimpleCookie(self.headers.get("Cookie") or "")
        sent = [t for t in (bearer_token(self.headers.get("Authorization")), query_token,
                            cookie[COOKIE].value if COOKIE in cookie else None) if t]
        if any(hmac.compare_digest(s.encode(), w.encode()) for s in sent for w in wanted):
            if query_token and self.command in ("GET", "HEAD"):  # move the token from the address into a cookie
                rest = "&".join(p for p in parts.query.split("&") if not p.startswith("token="))
                self._send(HTTPStatus.SEE_OTHER, b"", "text/plain", {
                    "Location": parts.path + ("?" + rest if rest else ""),
                    "Set-Cookie": f"{COOKIE}={query_token}; HttpOnly; SameSite=Strict; Path=/"})
                return False
            return True
        self._refuse(HTTPStatus.UNAUTHORIZED if not sent else HTTPStatus.FORBIDDEN,
                     "this store is live: open the address `lightning-otel view` printed (it carries the collector's "
                     "query token), or send Authorization: Bearer <query token>")
        return False

    def _page(self, path: str, params: dict[str, str], notice: str = "") -> None:
        viewer, config = self.viewer, self.viewer.config
        started = time.perf_counter()
        try:
            if path == "/":
                title, body = "Rollouts", pages.rollouts_page(viewer.source, params, config.reward)
            elif path.startswith("/rollout/") and path.endswith("/transitions"):
                rollout_id = unquote(path[len("/rollout/"):-len("/transitions")])
                reward = pages.chosen_reward(viewer.source, params, config.reward)[0]
                title = f"Transitions of {rollout_id}"
                body = tokens.transitions_page(viewer.source, config.transitions, viewer.texts, rollout_id, reward)
            elif path.startswith("/rollout/"):
                rollout_id = unquote(path[len("/rollout/"):])
                title, body = f"Rollout {rollout_id}", pages.rollout_page(viewer.source, rollout_id, notice)
            elif path == "/group":
                title, body = f"Group of task {params.get('task', '')}", runs.group_page(viewer.source, params,
                                                                                         config.reward)
            elif path == "/runs":
                title, body = "Runs and rounds", runs.runs_page(config.run)
            elif path == "/compare":
                title, body = "Compare policy versions", runs.compare_page(viewer.source, params, config.reward)
            else:
                return self._refuse(HTTPStatus.NOT_FOUND, f"no page {path[:200]}: the pages are /, /rollout/<id>, "
                                                          f"/group, /runs and /compare")
        except queries.BadRequest as exc:
            return self._refuse(HTTPStatus.BAD_REQUEST, str(exc))
        except pages.NotFound as exc:
            return self._refuse(HTTPStatus.NOT_FOUND, str(exc))
        except UserError as exc:
            return self._refuse(HTTPStatus.BAD_REQUEST, str(exc))
        except Exception:  # noqa: BLE001 - a page that fails answers 500 and the server goes on
            log.exception("page %s failed", path)
            return self._refuse(HTTPStatus.INTERNAL_SERVER_ERROR, "this page failed; the viewer's log says why")
        log.debug("%s in %.3f s", path, time.perf_counter() - started)
        self._send(HTTPStatus.OK, page(title, body, str(config.db)).encode(), "text/html; charset=utf-8")

    def _static(self, name: str) -> None:
        suffix = Path(name).suffix
        if "/" in name or "\\" in name or name.startswith(".") or suffix not in STATIC_TYPES:
            return self._refuse(HTTPStatus.NOT_FOUND, "no such static file")
        try:
            data = resources.files("lightning_otel.view").joinpath("static", name).read_bytes()
        except (FileNotFoundError, IsADirectoryError, OSError):
            return self._refuse(HTTPStatus.NOT_FOUND, "no such static file")
        self._send(HTTPStatus.OK, data, STATIC_TYPES[suffix])

    def _refuse(self, status: HTTPStatus, message: str) -> None:
        body = page(f"{status.value} {status.phrase}", f'<p class="error" id="problem">{esc(message)}</p>'
                    f'<p><a href="/">rollouts</a></p>', str(self.viewer.config.db)).encode()
        self._send(status, body, "text/html; charset=utf-8")

    def _send(self, status: HTTPStatus, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in {**SECURITY_HEADERS, **(headers or {})}.items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


def link_to(viewer: Viewer, rollout_id: str | None = None) -> str:
    """The address to open: with the query token when the store needs one."""
    tokens_needed = viewer.source.read_tokens()
    path = rollout_url(rollout_id) if rollout_id else "/"
    return viewer.url + path + (f"?token={tokens_needed[0]}" if tokens_needed else "")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
