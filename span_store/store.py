"""The one module that owns DuckDB connections to a store file.

A store is one DuckDB file. While a process holds it read-write, no other process can open it at all
(DuckDB's file lock), so the collector is the single owner while it runs and everybody else goes
through its HTTP endpoints (see client.py). Reads use a read-only transaction on a cursor of their own,
and readonly.check_read_only lets through only statements that read the store: not settings, not files.
"""
from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Callable, Iterator

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from lightning_otel.errors import UserError
from lightning_otel.span_store.readonly import check_read_only

log = logging.getLogger(__name__)
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

MIGRATION_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
SQL_CREATE_MIGRATIONS = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    version INTEGER PRIMARY KEY, name VARCHAR NOT NULL, applied_at TIMESTAMP DEFAULT current_timestamp)
"""
# Plain INSERT first: it is ~1.5x faster than OR IGNORE on a large table (measured at 1M spans). When a
# batch holds a row already stored (an exporter retry), the caller rolls back and inserts OR IGNORE.
SQL_INSERT = {"traces": "INSERT INTO spans BY NAME SELECT * FROM {source}",
              "logs": "INSERT INTO logs BY NAME SELECT * FROM batch"}
SQL_INSERT_IGNORING_DUPLICATES = {"traces": "INSERT OR IGNORE INTO spans BY NAME SELECT * FROM {source}",
                                  "logs": "INSERT OR IGNORE INTO logs BY NAME SELECT * FROM batch"}
# The gateway's token records as typed rows (a retried batch adds nothing).
GENERATE_SPAN = "lightning.generate"
SQL_INSERT_TOKEN_RECORDS = "INSERT OR IGNORE INTO token_records SELECT * FROM token_records_of('batch')"
SQL_INSERT_EMITTED_REWARDS = """
INSERT INTO rewards (rollout_id, trace_id, span_id, name, value, source, created_ns, reward_span_id)
SELECT DISTINCT ON (b.trace_id, b.span_id)
       b.rollout_id, b.trace_id, b.parent_span_id, attr(b.attributes, 'lightning.reward.name'),
       TRY_CAST(attr(b.attributes, 'lightning.reward.value') AS DOUBLE), 'emitted', b.received_ns, b.span_id
FROM batch b
WHERE b.name = 'lightning.reward' AND b.rollout_id IS NOT NULL
  AND attr(b.attributes, 'lightning.reward.name') IS NOT NULL
  AND TRY_CAST(attr(b.attributes, 'lightning.reward.value') AS DOUBLE) IS NOT NULL
  AND NOT EXISTS (SELECT 1 FROM rewards r WHERE r.trace_id = b.trace_id AND r.reward_span_id = b.span_id)
"""
SQL_PRUNE_SPANS = """
DELETE FROM spans WHERE trace_id IN (
    SELECT trace_id FROM spans GROUP BY trace_id HAVING max(greatest(start_ns, end_ns)) < $before)
"""
SQL_PRUNE_LOGS = "DELETE FROM logs WHERE coalesce(nullif(time_ns, 0), observed_ns) < $before"
SQL_PRUNE_TOKEN_RECORDS = """
DELETE FROM token_records t
WHERE NOT EXISTS (SELECT 1 FROM spans s WHERE s.trace_id = t.trace_id AND s.span_id = t.span_id)
"""


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


def load_migrations() -> list[Migration]:
    """The numbered .sql files shipped in span_store/migrations, in order."""
    folder = resources.files("lightning_otel.span_store") / "migrations"
    found = []
    for entry in folder.iterdir():
        match = MIGRATION_NAME.match(entry.name)
        if match:
            found.append(Migration(int(match.group(1)), match.group(2), entry.read_text()))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if versions != list(range(1, len(found) + 1)):
        raise RuntimeError(f"migrations must be numbered 1..n without gaps, found {versions}")
    return found


def pending_migrations(con: duckdb.DuckDBPyConnection) -> list[Migration]:
    exists = con.execute(
        "SELECT count(*) FROM duckdb_tables() WHERE table_name = 'schema_migrations' AND schema_name = 'main'"
    ).fetchone()[0]
    applied = set()
    if exists:
        applied = {row[0] for row in con.execute("SELECT version FROM schema_migrations").fetchall()}
    known = load_migrations()
    newest_known = known[-1].version if known else 0
    if applied and max(applied) > newest_known:
        raise UserError(
            f"this store was written by a newer lightning-otel (schema version {max(applied)}, this one knows "
            f"up to {newest_known}); upgrade lightning-otel to read it")
    return [m for m in known if m.version not in applied]


def apply_migrations(con: duckdb.DuckDBPyConnection) -> int:
    """Apply pending migrations, each in its own transaction. Returns how many were applied."""
    todo = pending_migrations(con)
    for migration in todo:
        con.execute("BEGIN TRANSACTION")
        try:
            con.execute(SQL_CREATE_MIGRATIONS)
            con.execute(migration.sql)
            con.execute("INSERT INTO schema_migrations (version, name) VALUES (?, ?)",
                        [migration.version, migration.name])
            con.execute("COMMIT")
        except Exception:
            con.execute("ROLLBACK")
            raise
        log.info("applied migration %04d_%s", migration.version, migration.name)
    return len(todo)


def _lock_holder(message: str) -> str:
    match = re.search(r"held in (.+?) \(PID (\d+)\)", message)
    return f"process {match.group(2)} ({match.group(1)})" if match else "another process"


def connect(path: Path | str, read_only: bool = False, memory_limit: str | None = None,
            threads: int | None = None, checkpoint_threshold: str | None = None,
            max_temp_size: str | None = None) -> duckdb.DuckDBPyConnection:
    """Open a store file with external access disabled, migrating it when opened read-write, then lock
    its configuration (no SET, RESET or PRAGMA that sets works on it afterwards).

    Raises UserError (naming the holder) when another process holds the file.
    """
    path = Path(path)
    if read_only and not path.exists():
        raise UserError(f"no trace store at {path}: start `lightning-otel collect --db {path}` to create one")
    config = {"enable_external_access": False}
    if memory_limit:
        config["memory_limit"] = memory_limit
    if threads:
        config["threads"] = threads
    if checkpoint_threshold:
        config["checkpoint_threshold"] = checkpoint_threshold
    if max_temp_size:
        config["max_temp_directory_size"] = max_temp_size  # what a query may spill (DuckDB: 90% of the disk)
    try:
        if read_only:
            with duckdb.connect(str(path), read_only=True) as probe:
                needs_migration = bool(pending_migrations(probe))
            if needs_migration:
                # Bring an older file up to date once, then reopen read-only as asked.
                connect(path, read_only=False).close()
        con = duckdb.connect(str(path), read_only=read_only, config=config)
    except duckdb.IOException as exc:
        if "lock" in str(exc).lower():
            raise UserError(f"the trace store {path} is held by {_lock_holder(str(exc))}; "
                            f"stop that process or query it through its collector") from None
        raise UserError(f"cannot open trace store {path}: {exc}") from None
    if not read_only:
        apply_migrations(con)
    # Last, after every setting the writer needs: no statement on this connection or its cursors (the
    # collector's queries included) can change memory_limit, threads, profiling output and the like.
    con.execute("SET lock_configuration = true")
    return con


# One DuckDB vector per Arrow batch: the bounds below are checked between batches, so a bigger batch is
# more that is built before a check can stop it.
RESULT_BATCH_ROWS = 2048
GUARD_SAMPLE_S = 0.01
ABANDON_SAMPLE_S = 0.1  # how often a running query looks whether its client is still there
# The small batches are joined into ones of about this size for sending: per-batch overhead on the socket
# made a 4M-row answer of two integer columns 3x slower.
SEND_BATCH_BYTES = 16 * 2**20
SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """Bytes in a size as DuckDB writes memory_limit ('2GB' = 2e9 bytes, '2GiB' = 2**31)."""
    match = SIZE.match(str(text))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in SIZE_UNITS:
        raise UserError(f"{text!r} is not a size; write it like 512MB, 2GB or 2GiB")
    return int(float(match.group(1)) * SIZE_UNITS[unit])


@dataclass(frozen=True)
class QueryLimits:
    """What one query may build. DuckDB's memory_limit covers its buffer pool and operators, not every
    allocation: the strings a query makes and their Arrow copy are outside it, so the answer is bounded in
    rows and bytes, and a guard interrupts the query while the process's resident memory is over a bound."""
    max_rows: int | None = None
    max_bytes: int | None = None
    max_resident_bytes: int | None = None

    @property
    def bounds_result(self) -> bool:
        return bool(self.max_rows or self.max_bytes)


class QueryTooLarge(UserError):
    """A query went past one of its QueryLimits (the collector answers 413)."""


class Reader:
    """Runs read-only queries on a connection, each on its own cursor in a read-only transaction."""

    def __init__(self, con: duckdb.DuckDBPyConnection, timeout_s: float | None = None,
                 limits: QueryLimits | None = None):
        self.con = con
        self.timeout_s = timeout_s
        self.limits = limits or QueryLimits()

    def record_batches(self, sql: str, batch_rows: int = RESULT_BATCH_ROWS,
                       abandoned: Callable[[], bool] | None = None) -> Iterator:
        """The schema, then the result of one read statement as record batches: streamed, so a big result
        never sits in memory whole, and stopped (QueryTooLarge) before a batch past the limits is yielded.
        `abandoned`: polled while the query runs; when it answers True (the client left) the query stops."""
        check_read_only(sql)
        cursor = self.con.cursor()
        guard = _QueryGuard(cursor, self.timeout_s, self.limits.max_resident_bytes, abandoned)
        try:
            cursor.execute("BEGIN TRANSACTION READ ONLY")
            try:
                reader = cursor.sql(sql).to_arrow_reader(batch_rows)
                yield reader.schema
                yield from _within_limits(reader, self.limits)
            except duckdb.OutOfMemoryException as exc:
                raise guard.stopped() or _out_of_memory(exc) from None
            except (duckdb.Error, pa.ArrowException, OSError) as exc:
                # An interrupt inside the Arrow stream surfaces as an Arrow error, not InterruptException.
                raise guard.stopped() or UserError(f"query failed: {exc}") from None
            finally:
                try:
                    cursor.execute("ROLLBACK")
                except duckdb.Error:
                    pass  # an interrupted or failed statement has already ended the transaction
        finally:
            guard.finish()
            cursor.close()

    def schema_and_batches(self, sql: str, abandoned: Callable[[], bool] | None = None
                           ) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
        """With result limits, the whole answer (at most those limits) is fetched before this returns, so a
        caller answering over HTTP learns of a bound before it sends anything; without, it streams."""
        batches = self.record_batches(sql, abandoned=abandoned)
        schema = next(batches)  # first item is the schema, so errors surface before any byte is sent
        if self.limits.bounds_result:
            return schema, iter(list(_joined(batches, SEND_BATCH_BYTES)))
        return schema, batches

    def arrow(self, sql: str) -> pa.Table:
        schema, batches = self.schema_and_batches(sql)
        return pa.Table.from_batches(list(batches), schema=schema)


def _joined(batches: Iterator[pa.RecordBatch], target_bytes: int) -> Iterator[pa.RecordBatch]:
    group: list[pa.RecordBatch] = []
    size = 0
    for batch in batches:
        group.append(batch)
        size += batch.nbytes
        if size >= target_bytes:
            yield from _concatenated(group)
            group, size = [], 0
    if group:
        yield from _concatenated(group)


def _concatenated(group: list[pa.RecordBatch]) -> list[pa.RecordBatch]:
    """One batch of the group's rows (pa.concat_batches, which does this, needs pyarrow 19; the floor is 18)."""
    return pa.Table.from_batches(group).combine_chunks().to_batches()


def _out_of_memory(exc: duckdb.OutOfMemoryException) -> QueryTooLarge:
    bound = ("spilled more to disk than --max-temp-size allows" if "max_temp_directory_size" in str(exc)
             else f"ran out of memory ({str(exc).splitlines()[0]})")
    return QueryTooLarge(f"query {bound}; add LIMIT, aggregate, select fewer or narrower columns, or raise "
                         f"--memory-limit or --max-temp-size")


def _within_limits(reader: pa.RecordBatchReader, limits: QueryLimits) -> Iterator[pa.RecordBatch]:
    rows = size = 0
    for batch in reader:
        rows += batch.num_rows
        size += batch.nbytes
        if limits.max_rows and rows > limits.max_rows:
            raise QueryTooLarge(f"the result has more than {limits.max_rows} rows (--max-result-rows); add LIMIT "
                                f"or aggregate, or raise --max-result-rows")
        if limits.max_bytes and size > limits.max_bytes:
            raise QueryTooLarge(f"the result is over {limits.max_bytes} bytes (--max-result-bytes) after "
                                f"{rows} rows; add LIMIT, select fewer or narrower columns (attributes and "
                                f"message columns are the wide ones), or raise --max-result-bytes")
        yield batch


class _QueryGuard:
    """Interrupts one query past its time limit, while the process's resident memory is over a bound, or once
    its client has left (`abandoned`): checked every GUARD_SAMPLE_S (the client every ABANDON_SAMPLE_S), and
    DuckDB stops at its next vector, so one vector's values can pass it."""

    def __init__(self, cursor: duckdb.DuckDBPyConnection, timeout_s: float | None, max_resident: int | None,
                 abandoned: Callable[[], bool] | None = None):
        self.cursor = cursor
        self.abandoned = abandoned
        self.deadline = time.monotonic() + timeout_s if timeout_s else None
        self.timeout_s = timeout_s
        self.max_resident = max_resident if max_resident and resident_bytes() is not None else None
        self.reason: UserError | None = None
        self._done = threading.Event()
        self._thread = None
        if self.deadline or self.max_resident or self.abandoned:
            self._thread = threading.Thread(target=self._watch, name="query-guard", daemon=True)
            self._thread.start()

    def _watch(self) -> None:
        interval = (GUARD_SAMPLE_S if self.max_resident else ABANDON_SAMPLE_S if self.abandoned
                    else self.timeout_s)
        next_look = time.monotonic()
        while not self._done.wait(interval):
            if self.abandoned and time.monotonic() >= next_look:
                next_look = time.monotonic() + ABANDON_SAMPLE_S
                if self.abandoned():
                    self.reason = UserError("query stopped: the client closed its connection before the answer")
                    self.cursor.interrupt()
                    return
            if self.deadline and time.monotonic() >= self.deadline:
                self.reason = UserError(f"query stopped after the {self.timeout_s:g} s limit")
            elif self.max_resident and (resident := resident_bytes() or 0) > self.max_resident:
                self.reason = QueryTooLarge(
                    f"query stopped: the collector's resident memory reached {resident / 2**20:.0f} MiB, over "
                    f"the {self.max_resident / 2**20:.0f} MiB bound for queries (--max-query-memory); the query "
                    f"builds more than fits: add LIMIT, select fewer or narrower columns or smaller values "
                    f"(repeat, string_agg and list build large ones), or raise --memory-limit")
            else:
                continue
            self.cursor.interrupt()
            return

    def stopped(self) -> UserError | None:
        return self.reason

    def finish(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()


def resident_bytes() -> int | None:
    """This process's resident memory (Linux /proc), or None where that cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return None


def insert_batch(con: duckdb.DuckDBPyConnection, kind: str, batch: pa.Table, skip_duplicates: bool = True) -> None:
    """Insert decoded rows inside the caller's transaction. With skip_duplicates, rows already stored (same
    trace and span id, same log content) are skipped; without, a duplicate raises duckdb.ConstraintException
    (the caller then rolls back and retries with skip_duplicates)."""
    con.register("batch", batch)
    # Decoded spans carry agent_name and response_id (migration 0006); rows in the table's own older shape
    # get them from their JSON.
    source = "batch" if kind != "traces" or "agent_name" in batch.schema.names else "spans_from_rows('batch')"
    try:
        con.execute((SQL_INSERT_IGNORING_DUPLICATES if skip_duplicates else SQL_INSERT)[kind].format(source=source))
        if kind == "traces":
            con.execute(SQL_INSERT_EMITTED_REWARDS)
            if pc.any(pc.equal(batch.column("name"), GENERATE_SPAN)).as_py():  # a statement less per commit
                con.execute(SQL_INSERT_TOKEN_RECORDS)
    finally:
        try:
            con.unregister("batch")
        except duckdb.Error:
            pass  # the transaction was aborted; the next register replaces the view anyway


# Tables other programs write through the collector (runner records, computed rewards).
RECORD_TABLES = {"tasks": "task_id", "rollout_runs": "rollout_id", "rewards": None}
SQL_DELETE_FUNCTION_REWARDS = """
DELETE FROM rewards WHERE source = 'function' AND (rollout_id, name) IN (SELECT rollout_id, name FROM batch)
"""


def write_records(con: duckdb.DuckDBPyConnection, table: str, rows: list[dict]) -> int:
    """Insert or replace rows of tasks / rollout_runs (by key), or add computed rewards (replacing an
    earlier value of the same rollout and name). Raises UserError naming what is wrong."""
    if table not in RECORD_TABLES:
        raise UserError(f"table {table!r} cannot be written; writable: {sorted(RECORD_TABLES)}")
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise UserError("rows must be a list of objects")
    if not rows:
        return 0
    columns = {name for (name,) in con.execute(
        "SELECT column_name FROM duckdb_columns() WHERE table_name = ?", [table]).fetchall()}
    for number, row in enumerate(rows):
        unknown = set(row) - columns
        if unknown:
            raise UserError(f"row {number}: {table} has no column(s) {sorted(unknown)}; columns: {sorted(columns)}")
        key = RECORD_TABLES[table]
        if key and not row.get(key):
            raise UserError(f"row {number}: {key} is required")
    try:
        batch = pa.Table.from_pylist([{k: (orjson_text(v) if k == "fields" else v) for k, v in row.items()}
                                      for row in rows])
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise UserError(f"rows do not have consistent types: {exc}") from None
    con.register("batch", batch)
    con.execute("BEGIN TRANSACTION")
    try:
        if table == "rewards":
            con.execute(SQL_DELETE_FUNCTION_REWARDS)
            con.execute("INSERT INTO rewards BY NAME SELECT * FROM batch")
        else:
            con.execute(f"INSERT OR REPLACE INTO {table} BY NAME SELECT * FROM batch")
        con.execute("COMMIT")
    except duckdb.Error as exc:
        con.execute("ROLLBACK")
        raise UserError(f"cannot store {table} rows: {exc}") from None
    finally:
        con.unregister("batch")
    return len(rows)


def orjson_text(value) -> str:
    import orjson
    return value if isinstance(value, str) else orjson.dumps(value).decode()


def prune(con: duckdb.DuckDBPyConnection, before_ns: int) -> dict[str, int]:
    """Delete whole traces whose last span ended before `before_ns`, and older log records."""
    con.execute("BEGIN TRANSACTION")
    try:
        spans = con.execute(SQL_PRUNE_SPANS, {"before": before_ns}).fetchone()[0]
        logs = con.execute(SQL_PRUNE_LOGS, {"before": before_ns}).fetchone()[0]
        con.execute(SQL_PRUNE_TOKEN_RECORDS)
        con.execute("COMMIT")
    except Exception:
        con.execute("ROLLBACK")
        raise
    return {"spans": int(spans), "logs": int(logs)}
