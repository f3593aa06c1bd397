"""The collector: OTLP/HTTP in, DuckDB out, and read-only SQL for everybody else.

Endpoints                                                                                        role
  POST /v1/traces, /v1/logs   OTLP/HTTP, protobuf or JSON, optionally gzip/deflate (OTLP spec)  ingest
  POST /v1/query              body: one read statement; answer: Arrow IPC stream              query
  POST /v1/prune              body: {"before_ns": int}; answer: JSON counts                    admin
  POST /v1/records            body: {"table": "tasks"|"rollout_runs"|"rewards", "rows": [...]} admin
  POST /v1/feedback           body: {"rollout_id", "name", "value", ["span_id", "comment",     admin
                              "author"]}: a person's score, stored as a reward (feedback.py)
  GET  /health                JSON: pid, db, rows written, which roles need a token (never the tokens),
                              forwarding's counts (sent, retried, dropped) when --forward is set

Each role has its own bearer token (`ingest_token`, `query_token`, `admin_token`; `token` is the one for every
role not given its own) and the admin token grants every route. A role without a token is open. Agents are
handed the ingest token only: they can send spans, but not read the store (their tasks' answers are in it)
nor write records (their own rewards). A request without a known token gets 401, one with another role's 403;
both before the collector reads its body or gives it a slot, and the connection is then closed.

Capacity is per role, so that no other role can starve ingest: `max_inflight_requests` ingest requests,
`max_concurrent_queries` queries (at most `max_queries_per_token` of one token: 429 past it) and
`max_admin_requests` admin ones at a time; past a role's slots, 503 with Retry-After. A query runs at most
`query_timeout_s` (less when its client hangs up first: it is then stopped), and each piece of its answer must be
taken by the client within `query_send_timeout_s`.

With `forward` (`--forward URL`), every committed body is also sent on to another OTLP/HTTP endpoint, in the
background: forwarding never delays or fails ingest (forwarding.py).

Run it with `lightning-otel collect --db traces.duckdb`. It is the only process that holds the file.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from http import HTTPStatus
from typing import Any

import duckdb
import orjson
import pyarrow as pa
from google.rpc import status_pb2
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceResponse
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

import lightning_otel
from lightning_otel.errors import UserError
from lightning_otel.httpserver import KeepAliveHandler, LocalServer, bearer_token
from lightning_otel.lifetime import lower_thread_priority
from lightning_otel.span_store import discovery, feedback, otlp, store
from lightning_otel.span_store.collector_config import CollectorConfig, private_config
from lightning_otel.span_store.collector_http import RequestError, decompress, grpc_code, media_type, roles_holding
from lightning_otel.span_store.decoding import DecoderPool
from lightning_otel.span_store.forwarding import Forwarder
from lightning_otel.span_store.writer import BatchWriter, Busy

__all__ = ["Collector", "CollectorConfig", "RequestError", "private_config", "run_collector"]

log = logging.getLogger(__name__)

ARROW_STREAM = "application/vnd.apache.arrow.stream"
QUERY_NICENESS = 10  # queries' threads: nice 10 has about a tenth of the CPU share of nice 0 when cores are short
SIGNALS = {"/v1/traces": "traces", "/v1/logs": "logs"}
CONTENT_TYPES = {"protobuf": "application/x-protobuf", "json": "application/json"}


class Collector:
    """Owns the DuckDB file, the writer thread and the HTTP server."""

    def __init__(self, config: CollectorConfig):
        self.config = config
        self.db = config.db.absolute()
        self._claim_discovery_file()
        self.con = store.connect(self.db, memory_limit=config.memory_limit, threads=config.threads,
                                 checkpoint_threshold=config.checkpoint_threshold, max_temp_size=config.max_temp_size)
        self.writer = BatchWriter(self.con, config.max_pending_rows)
        self.reader = store.Reader(self.con, timeout_s=config.query_timeout_s, limits=config.query_limits())
        self._slots = {"ingest": threading.BoundedSemaphore(config.max_inflight_requests),
                       "query": threading.BoundedSemaphore(config.max_concurrent_queries),
                       "admin": threading.BoundedSemaphore(config.max_admin_requests)}
        self._queries_per_token: dict[str, int] = {}
        self._queries_lock = threading.Lock()
        try:
            self.server = _Server((config.host, config.port), _Handler, self, config.connection_limits)
        except OSError as exc:
            self.con.close()
            raise UserError(f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}; "
                            f"pick another --port (0 picks a free one)") from None
        self.decoders = DecoderPool(config.decode_workers)
        # Queries run on threads of lower CPU priority (QUERY_NICENESS): ingest's request threads and the writer
        # come first when the cores are short, so however many queries run, ingest keeps its latency.
        self.query_threads = ThreadPoolExecutor(config.max_concurrent_queries, thread_name_prefix="query",
                                                initializer=lower_thread_priority, initargs=(QUERY_NICENESS,))
        self.port = self.server.server_address[1]
        self.info = discovery.CollectorInfo(pid=os.getpid(), host=config.host, port=self.port, db=str(self.db),
                                            version=lightning_otel.__version__, tokens=config.role_tokens())
        self.forwarder = Forwarder(config.forward) if config.forward is not None else None
        self._serving = threading.Event()
        self.busy_answers = 0
        self._closed = False

    def _claim_discovery_file(self) -> None:
        holder = discovery.find_collector(self.db)
        if holder is not None:
            raise UserError(f"a collector (pid {holder.pid}, {holder.url}) already holds {self.db}; "
                            f"send to that one, or stop it first")

    @property
    def url(self) -> str:
        return self.info.url

    def start(self) -> None:
        """Serve in a background thread (tests, and commands that host the collector in-process)."""
        self.writer.start()
        if self.forwarder is not None:
            self.forwarder.start()
        discovery.write_info(self.db, self.info)
        thread = threading.Thread(target=self.server.serve_forever, name="collector-http", daemon=True)
        thread.start()
        self._serving.set()

    def serve_forever(self) -> None:
        """Serve until SIGINT/SIGTERM, then write what is queued and release the file."""
        stop = threading.Event()

        def on_signal(signum: int, frame: Any) -> None:
            stop.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        self.start()
        log.info("collector listening on %s, writing %s", self.url, self.db)
        while not stop.wait(0.5):
            pass
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._serving.is_set():
            self.server.shutdown()
        self.server.server_close()
        self.decoders.close()
        self.query_threads.shutdown(wait=False, cancel_futures=True)
        if self.forwarder is not None:
            self.forwarder.close()
        self.writer.stop()
        try:
            self.con.execute("CHECKPOINT")
        finally:
            try:
                self.con.close()
            except duckdb.ResourceInUseException:
                # A query thread was still inside a call on one of the connection's cursors (a query held by a
                # client that reads slowly): each ends within its query and send timeouts; close after them.
                self.query_threads.shutdown(wait=True)
                self.con.close()
            discovery.remove_info(self.db, os.getpid())

    # ---- request handling (called from handler threads) --------------------------------------------

    def authorize(self, path: str, header: str | None) -> None:
        """Let the request through when its token's role may POST `path`, or that role needs no token: 401 when
        the header carries no token of this collector, 403 when it carries another role's."""
        tokens = self.info.tokens
        role = discovery.ROUTE_ROLES.get(path)  # None: no such route (any known token then gets the 404)
        if not tokens or (role is not None and role not in tokens):
            return
        held = roles_holding(tokens, header)
        if "admin" in held or role in held or (role is None and held):
            return
        needed = "a token" if role is None else f"the {role} token" + ("" if role == "admin" else " or the admin one")
        if not held:
            how = ("exporters send it with OTEL_EXPORTER_OTLP_HEADERS=Authorization=Bearer%20<token>"
                   if role == "ingest" else "lightning-otel commands read it from <db>.collector.json")
            raise RequestError(HTTPStatus.UNAUTHORIZED, f"missing or unknown token: POST {path} needs {needed}; "
                                                        f"send the header 'Authorization: Bearer <token>' ({how})")
        raise RequestError(HTTPStatus.FORBIDDEN,
                           f"this is the {' and '.join(sorted(held))} token, which may not POST {path}: that needs "
                           f"{needed}, which only whoever started the collector holds (agents get the ingest token)")

    def take_slot(self, path: str, header: str | None) -> Any:
        """A slot of the route's role (released by calling what this returns), or RequestError: 429 when the
        token runs max_queries_per_token queries already, 503 when the role's slots are all taken."""
        role = discovery.ROUTE_ROLES.get(path)
        if role is None:
            return lambda: None  # no such route: answered 404 at once
        key = None
        if role == "query":
            key = bearer_token(header) or ""  # queries without a token (an open role) share one count
            with self._queries_lock:
                running = self._queries_per_token.get(key, 0)
                if running >= self.config.max_queries_per_token:
                    raise RequestError(HTTPStatus.TOO_MANY_REQUESTS,
                                       f"this token runs {running} queries already (max_queries_per_token); "
                                       f"wait for one to finish", retry_after=self.config.retry_after_s)
                self._queries_per_token[key] = running + 1
        slots = self._slots[role]
        if not slots.acquire(blocking=False):
            self._end_query(key)
            self.busy_answers += 1
            limit = {"ingest": "max_inflight_requests", "query": "max_concurrent_queries",
                     "admin": "max_admin_requests"}[role]
            raise RequestError(HTTPStatus.SERVICE_UNAVAILABLE, f"too many {role} requests in flight ({limit}); "
                                                               f"retry shortly", retry_after=self.config.retry_after_s)

        released = threading.Lock()

        def release() -> None:  # at most once, from whichever comes first: the answer's last write or the end
            if released.acquire(blocking=False):
                slots.release()
                self._end_query(key)
        return release

    def _end_query(self, key: str | None) -> None:
        if key is None:
            return
        with self._queries_lock:
            left = self._queries_per_token[key] - 1
            if left:
                self._queries_per_token[key] = left
            else:
                del self._queries_per_token[key]

    def ingest(self, signal_name: str, encoding: str, body: bytes) -> otlp.Decoded:
        try:
            decoded = self.decoders.decode(signal_name, encoding, body)
        except otlp.DecodeFailure as exc:
            raise RequestError(HTTPStatus.BAD_REQUEST, str(exc)) from None
        except RuntimeError as exc:
            raise RequestError(HTTPStatus.SERVICE_UNAVAILABLE, f"{exc}; retry",
                               retry_after=self.config.retry_after_s) from None
        if decoded.table.num_rows:
            try:
                pending = self.writer.submit(signal_name, decoded.table)
            except Busy as exc:
                self.busy_answers += 1
                raise RequestError(HTTPStatus.SERVICE_UNAVAILABLE, f"collector is busy ({exc}); retry shortly",
                                   retry_after=self.config.retry_after_s) from None
            pending.done.wait()
            if pending.error is not None:
                raise RequestError(HTTPStatus.SERVICE_UNAVAILABLE,
                                   f"the store could not commit this batch ({pending.error}); retry",
                                   retry_after=self.config.retry_after_s)
            if self.forwarder is not None:  # committed: only what the store holds is sent on
                self.forwarder.offer(signal_name, CONTENT_TYPES[encoding], body, decoded.table.num_rows)
        return decoded

    def prune(self, before_ns: int) -> dict[str, int]:
        return self.writer.run_exclusive(lambda con: store.prune(con, before_ns))  # type: ignore[return-value]

    def health(self) -> dict[str, Any]:
        return {"status": "ok", **asdict(self.info), "tokens": None,
                "token_required": {role: role in self.info.tokens for role in discovery.ROLES},
                "committed_rows": self.writer.committed_rows, "commits": self.writer.commits,
                "busy_answers": self.busy_answers,
                "forwarding": None if self.forwarder is None else self.forwarder.stats()}


class _Server(LocalServer):
    @property
    def collector(self) -> Collector:
        return self.owner


class _Handler(KeepAliveHandler):
    server: _Server
    server_version = f"lightning-otel/{lightning_otel.__version__}"

    def answer_timeout_s(self) -> float:
        return self.server.collector.config.query_send_timeout_s

    # -- plumbing --
    def _send(self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        getattr(self, "_release_slot", lambda: None)()  # the work is done: the slot is free before the client knows
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _send_error(self, err: RequestError, as_protobuf: bool) -> None:
        headers = {"Retry-After": str(err.retry_after)} if err.retry_after is not None else None
        if as_protobuf:
            body = status_pb2.Status(code=grpc_code(err.status), message=err.message).SerializeToString()
            self._send(err.status, body, "application/x-protobuf", headers)
        else:
            body = orjson.dumps({"code": grpc_code(err.status), "message": err.message})
            self._send(err.status, body, "application/json", headers)

    def _read_body(self) -> bytes:
        length = self.body_length  # framing checked by KeepAliveHandler: one plain Content-Length, or none
        if length is None:
            self.close_connection = True
            raise RequestError(HTTPStatus.LENGTH_REQUIRED, "Content-Length header is required")
        limit = self.server.collector.config.max_body_bytes
        if length > limit:
            # Not reading a huge body means the connection cannot be reused.
            self.close_connection = True
            raise RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                               f"body of {length} bytes is over the {limit}-byte limit; send smaller batches "
                               f"(BatchSpanProcessor max_export_batch_size) or raise --max-body-bytes")
        body = self.read_body()
        if len(body) != length:
            self.close_connection = True
            raise RequestError(HTTPStatus.BAD_REQUEST, "body ended before Content-Length bytes arrived")
        return decompress(body, self.headers.get("Content-Encoding", ""), limit)

    # -- routes --
    def do_POST(self) -> None:  # noqa: N802 - stdlib naming
        path = self.path.split("?", 1)[0]
        as_protobuf = media_type(self.headers.get("Content-Type")) == "application/x-protobuf"
        collector = self.server.collector
        authorization = self.headers.get("Authorization")
        try:
            # Credentials first, before a slot is taken or a byte of the body read: a client without them gets
            # its answer and the connection closes, whatever it still sends.
            collector.authorize(path, authorization)
            release = collector.take_slot(path, authorization)
        except RequestError as err:
            self.close_connection = True
            try:
                self._send_error(err, as_protobuf)
            except OSError:
                return  # the client went away
            return self.refuse_and_close()
        # Given back before the answer's last bytes go out: a client that sends its next request as soon as it
        # has read an answer must find the slot free (a sequential caller never gets 429 from its own past query).
        self._release_slot = release
        try:
            self._route_post(path, as_protobuf)
        finally:
            release()

    def _route_post(self, path: str, as_protobuf: bool) -> None:
        try:
            if path in SIGNALS:
                return self._post_signal(SIGNALS[path], as_protobuf)
            if path == "/v1/query":
                return self._post_query()
            if path == "/v1/prune":
                return self._post_prune()
            if path == "/v1/records":
                return self._post_records()
            if path == "/v1/feedback":
                return self._post_feedback()
            raise RequestError(HTTPStatus.NOT_FOUND,
                               f"no endpoint POST {path}; OTLP goes to /v1/traces or /v1/logs")
        except RequestError as err:
            self._drain()
            self._send_error(err, as_protobuf)
        except UserError as err:
            self._drain()
            self._send_error(RequestError(HTTPStatus.BAD_REQUEST, str(err)), as_protobuf)
        except Exception as exc:  # noqa: BLE001 - a handler bug must not take the server down
            log.exception("unexpected error on POST %s", path)
            self.close_connection = True
            self._send_error(RequestError(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error: {exc}"), as_protobuf)

    def _drain(self) -> None:
        """Read an unread body so the connection stays usable (never more than the limit)."""
        if not self._body_read:
            self.discard_body(self.body_length or 0, self.server.collector.config.max_body_bytes)

    def do_GET(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0]
        if path == "/health":
            return self._send(200, orjson.dumps(self.server.collector.health()), "application/json")
        self._send_error(RequestError(HTTPStatus.NOT_FOUND if path not in SIGNALS else HTTPStatus.METHOD_NOT_ALLOWED,
                                      f"no endpoint GET {path}"), False)

    def do_PUT(self) -> None:  # noqa: N802
        self._drain()
        self._send_error(RequestError(HTTPStatus.METHOD_NOT_ALLOWED, "use POST"), False)

    do_DELETE = do_PATCH = do_PUT  # noqa: N815

    def _post_signal(self, signal_name: str, as_protobuf: bool) -> None:
        media = media_type(self.headers.get("Content-Type"))
        if media not in ("application/x-protobuf", "application/json"):
            raise RequestError(HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                               f"Content-Type {media or '(none)'!r} is not OTLP; "
                               f"use application/x-protobuf or application/json")
        body = self._read_body()
        decoded = self.server.collector.ingest(signal_name, "protobuf" if as_protobuf else "json", body)
        self._send_ok(signal_name, as_protobuf, decoded)

    def _send_ok(self, signal_name: str, as_protobuf: bool, decoded: otlp.Decoded) -> None:
        response_type = ExportTraceServiceResponse if signal_name == "traces" else ExportLogsServiceResponse
        response = response_type()
        if decoded.rejected:
            partial = response.partial_success
            if signal_name == "traces":
                partial.rejected_spans = decoded.rejected
            else:
                partial.rejected_log_records = decoded.rejected
            partial.error_message = decoded.error_message
        if as_protobuf:
            return self._send(200, response.SerializeToString(), "application/x-protobuf")
        payload: dict[str, Any] = {}
        if decoded.rejected:
            key = "rejectedSpans" if signal_name == "traces" else "rejectedLogRecords"
            payload["partialSuccess"] = {key: str(decoded.rejected), "errorMessage": decoded.error_message}
        self._send(200, orjson.dumps(payload), "application/json")

    def _post_query(self) -> None:
        sql = self._read_body().decode("utf-8", errors="replace")
        if media_type(self.headers.get("Content-Type")) == "application/json":
            try:
                sql = orjson.loads(sql)["sql"]
            except (orjson.JSONDecodeError, KeyError, TypeError):
                raise RequestError(HTTPStatus.BAD_REQUEST, 'a JSON query body must be {"sql": "SELECT ..."}') from None
        collector = self.server.collector
        try:
            schema, batches = collector.query_threads.submit(collector.reader.schema_and_batches, sql,
                                                              self.peer_closed).result()
        except store.QueryTooLarge as exc:
            raise RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, str(exc)) from None
        # Streamed: the length is unknown up front, so the connection ends with the result.
        self.close_connection = True
        self.send_response(200)
        self.send_header("Content-Type", ARROW_STREAM)
        self.send_header("Connection", "close")
        self.end_headers()
        # Each write must be taken within query_send_timeout_s (answer_timeout_s): a client that stops reading is
        # cut off and its query slot freed, instead of holding it for as long as it likes.
        timeout_s = self.answer_timeout_s()
        try:
            writer = pa.ipc.new_stream(self.wfile, schema)  # no `with`: its end-of-stream write would wait again
            for batch in batches:
                writer.write_batch(batch)
            self._release_slot()  # the query is done; only the end-of-stream marker is left to send
            writer.close()
        except (TimeoutError, OSError) as exc:
            log.info("%s: cutting off a query answer: %s", self.address_string(),
                     f"the client took none of it for {timeout_s:g} s" if isinstance(exc, TimeoutError) else exc)
            close = getattr(batches, "close", None)
            if close is not None:
                close()  # ends the query and its read transaction now, not when the generator is collected

    def _post_prune(self) -> None:
        try:
            before_ns = int(orjson.loads(self._read_body())["before_ns"])
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            raise RequestError(HTTPStatus.BAD_REQUEST, 'prune body must be {"before_ns": <int>}') from None
        self._send(200, orjson.dumps(self.server.collector.prune(before_ns)), "application/json")

    def _post_records(self) -> None:
        try:
            doc = orjson.loads(self._read_body())
            table, rows = doc["table"], doc["rows"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            raise RequestError(HTTPStatus.BAD_REQUEST, 'records body must be {"table": ..., "rows": [...]}') from None
        written = self.server.collector.writer.run_exclusive(lambda con: store.write_records(con, table, rows))
        self._send(200, orjson.dumps({"written": written}), "application/json")

    def _post_feedback(self) -> None:
        try:
            doc = orjson.loads(self._read_body())
        except orjson.JSONDecodeError:
            raise RequestError(HTTPStatus.BAD_REQUEST, 'feedback body must be JSON: {"rollout_id": ..., "name": ..., '
                                                       '"value": ...}') from None
        score = feedback.Feedback.from_json(doc)  # a UserError is answered 400
        row = self.server.collector.writer.run_exclusive(lambda con: feedback.write_feedback(con, score))
        self._send(200, orjson.dumps(row), "application/json")


def run_collector(config: CollectorConfig) -> None:
    collector = Collector(config)
    print(f"lightning-otel collector on {collector.url} -> {collector.db} (pid {os.getpid()})", flush=True)
    started = time.monotonic()
    collector.serve_forever()
    log.info("collector stopped after %.0f s, %d rows written", time.monotonic() - started,
             collector.writer.committed_rows)
