"""Reading and feeding a store from outside the collector.

Every function takes the DuckDB file path. When a live collector holds the file (found through
`<db>.collector.json`) the work goes over its HTTP endpoints; otherwise the file is opened directly.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import orjson
import polars as pl
import pyarrow as pa

from lightning_otel.errors import UserError
from lightning_otel.span_store import discovery, feedback, otlp, otlp_files, store

DEFAULT_TIMEOUT_S = 300.0
BUSY_WAIT_S = 120.0  # how long a command keeps retrying while the collector answers busy (429/503 + Retry-After)


def _request(info: discovery.CollectorInfo, path: str, body: bytes, content_type: str,
             timeout: float = DEFAULT_TIMEOUT_S):
    headers = {"Content-Type": content_type}
    token = info.token_for(path)
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(info.url + path, data=body, headers=headers, method="POST")
    give_up = time.monotonic() + BUSY_WAIT_S
    try:
        while True:
            try:
                return urllib.request.urlopen(req, timeout=timeout)
            except urllib.error.HTTPError as exc:
                # The collector's slots for this role (or this token's share of queries) are taken: wait as told.
                wait = _retry_after(exc)
                if wait is None or time.monotonic() + wait > give_up:
                    raise
                exc.read()
                time.sleep(wait)
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode("utf-8", errors="replace")
        try:
            detail = json.loads(detail).get("message", detail)
        except (ValueError, AttributeError):
            pass
        raise UserError(f"collector at {info.url} refused {path}: {detail}") from None
    except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
        raise UserError(f"cannot reach the collector at {info.url} (pid {info.pid}): {exc}") from None


def _retry_after(exc: urllib.error.HTTPError) -> float | None:
    """Seconds to wait before sending again, for a busy answer (429, 503) that says how long; else None."""
    if exc.code not in (429, 503):
        return None
    try:
        return max(0.05, float(exc.headers.get("Retry-After", "")))
    except ValueError:
        return None


def sql_literal(value: str) -> str:
    """A SQL string literal: the query endpoint takes one statement of text, without parameters."""
    return "'" + value.replace("'", "''") + "'"


def record_batches(sql: str, db: Path | str) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    """Stream a read query's result as Arrow record batches, from the live collector or the file."""
    info = discovery.find_collector(db)
    if info is not None:
        response = _request(info, "/v1/query", sql.encode(), "text/plain")
        reader = pa.ipc.open_stream(response)
        return reader.schema, iter(reader)
    return _local_batches(sql, db)


def _local_batches(sql: str, db: Path | str) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    con = store.connect(db, read_only=True)
    schema, batches = store.Reader(con).schema_and_batches(sql)

    def closing() -> Iterator[pa.RecordBatch]:
        try:
            yield from batches
        finally:
            con.close()

    return schema, closing()


def query_arrow(sql: str, db: Path | str) -> pa.Table:
    """Run one read statement and return an Arrow table."""
    schema, batches = record_batches(sql, db)
    return pa.Table.from_batches(list(batches), schema=schema)


@contextmanager
def reading(db: Path | str) -> Iterator[Callable[[str], pl.DataFrame]]:
    """Several read statements on one store, each returning a Polars DataFrame: through the live collector,
    or on one read-only connection to the file (opening a large file costs tens of milliseconds)."""
    if discovery.find_collector(db) is not None:
        yield lambda sql: query(sql, db)
        return
    con = store.connect(db, read_only=True)
    reader = store.Reader(con)
    try:
        yield lambda sql: pl.from_arrow(reader.arrow(sql))  # type: ignore[return-value]
    finally:
        con.close()


def query(sql: str, db: Path | str) -> pl.DataFrame:
    """Run one read statement and return a Polars DataFrame.

    >>> query("SELECT name, count(*) AS n FROM spans GROUP BY name", db="traces.duckdb")
    """
    return pl.from_arrow(query_arrow(sql, db))  # type: ignore[return-value]


@contextmanager
def _writable(db: Path | str):
    """A read-write connection for commands that run with no collector on the file."""
    con = store.connect(db)
    try:
        yield con
    finally:
        con.close()


# ---- ingest the OpenTelemetry Collector's file exports (span_store/otlp_files.py reads them) --------------

@dataclass
class IngestReport:
    requests: int = 0
    spans: int = 0
    logs: int = 0
    rejected: int = 0
    skipped_metrics: int = 0
    errors: list[str] = field(default_factory=list)


CONTENT_TYPES = {"json": "application/json", "protobuf": "application/x-protobuf"}


def ingest_files(paths: list[Path], db: Path | str) -> IngestReport:
    """Load Collector file exports: files, folders of rotated files, globs (see otlp_files for the formats).

    Every path is checked before anything is loaded. Each request is stored (committed) on its own, so a bad
    line, message or file is reported by file and line or byte offset and everything else is kept."""
    files = otlp_files.expand_paths(paths)
    report = IngestReport()
    info = discovery.find_collector(db)
    if info is None:
        with _writable(db) as con:
            _ingest(files, report, lambda message, table: _insert_local(con, message.signal, table))
    else:
        _ingest(files, report, lambda message, table: _post_message(info, message))
    return report


def _insert_local(con, kind: str, table: pa.Table) -> None:
    con.execute("BEGIN TRANSACTION")
    store.insert_batch(con, kind, table)
    con.execute("COMMIT")


def _post_message(info: discovery.CollectorInfo, message: otlp_files.Message) -> None:
    _request(info, f"/v1/{message.signal}", message.body, CONTENT_TYPES[message.encoding]).read()


def _ingest(files: list[Path], report: IngestReport, send) -> None:
    for path in files:
        for item in otlp_files.read_messages(path):
            if isinstance(item, otlp_files.Unreadable):
                report.errors.append(f"{item.where}: {item.reason}")
                continue
            if item.signal == "metrics":
                report.skipped_metrics += 1
                continue
            try:
                decoded = otlp.DECODERS[(item.signal, item.encoding)](item.doc if item.doc is not None else item.body)
            except otlp.DecodeFailure as exc:
                report.errors.append(f"{item.where}: {exc}")
                continue
            send(item, decoded.table)
            report.requests += 1
            report.rejected += decoded.rejected
            if item.signal == "traces":
                report.spans += decoded.table.num_rows
            else:
                report.logs += decoded.table.num_rows


# ---- records of the runner (tasks, rollout_runs, computed rewards) ---------------------------------------

def write_records(db: Path | str, table: str, rows: list[dict]) -> int:
    info = discovery.find_collector(db)
    if info is not None:
        body = orjson.dumps({"table": table, "rows": rows})
        return orjson.loads(_request(info, "/v1/records", body, "application/json").read())["written"]
    with _writable(db) as con:
        return store.write_records(con, table, rows)


def write_feedback(db: Path | str, score: feedback.Feedback) -> dict:
    """Store a person's score (feedback.py) through the live collector's admin route, or into the file."""
    info = discovery.find_collector(db)
    if info is not None:
        body = orjson.dumps({key: getattr(score, key) for key in feedback.FIELDS})
        return orjson.loads(_request(info, "/v1/feedback", body, "application/json").read())
    with _writable(db) as con:
        return feedback.write_feedback(con, score)


# ---- prune ------------------------------------------------------------------------------------------

def prune(db: Path | str, before_ns: int) -> dict[str, int]:
    info = discovery.find_collector(db)
    if info is not None:
        response = _request(info, "/v1/prune", orjson.dumps({"before_ns": before_ns}), "application/json")
        return orjson.loads(response.read())
    with _writable(db) as con:
        counts = store.prune(con, before_ns)
        con.execute("CHECKPOINT")
        return counts
