"""Group commit: one thread inserts every queued batch in one transaction and wakes their senders.

A request is answered 200 only after the transaction holding its rows has committed (DuckDB's WAL is
written at commit, so a process killed right after the answer keeps the rows). The queue is bounded
in spans, so a sender that outpaces the disk is told to come back later (503) instead of growing memory.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import duckdb
import pyarrow as pa

from lightning_otel.span_store import store

log = logging.getLogger(__name__)


class Busy(Exception):
    """The queue is full; the sender should retry after a short wait."""


@dataclass
class Pending:
    kind: str  # "traces", "logs" or "call"
    table: pa.Table
    call: Callable[[duckdb.DuckDBPyConnection], None] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class BatchWriter:
    def __init__(self, con: duckdb.DuckDBPyConnection, max_pending_rows: int = 200_000,
                 on_commit: Callable[[int, float], None] | None = None):
        self.con = con
        self.max_pending_rows = max_pending_rows
        self.on_commit = on_commit
        self._queue: deque[Pending] = deque()
        self._pending_rows = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="span-writer", daemon=True)
        self.committed_rows = 0
        self.commits = 0

    def start(self) -> None:
        self._thread.start()

    def submit(self, kind: str, table: pa.Table) -> Pending:
        """Queue rows for the next commit; raises Busy when the queue is full."""
        pending = Pending(kind, table)
        with self._cond:
            if self._stopping:
                raise Busy("the collector is shutting down")
            # An empty queue always takes a batch, so one request larger than the bound still goes through.
            if self._queue and self._pending_rows + table.num_rows > self.max_pending_rows:
                raise Busy(f"{self._pending_rows} rows are waiting to be written")
            self._queue.append(pending)
            self._pending_rows += table.num_rows
            self._cond.notify()
        return pending

    def write_now(self, kind: str, table: pa.Table, timeout: float | None = None) -> None:
        """Submit and wait for the commit; re-raises the writer's error."""
        pending = self.submit(kind, table)
        if not pending.done.wait(timeout):
            raise TimeoutError("the write did not commit in time")
        if pending.error is not None:
            raise pending.error

    def run_exclusive(self, fn: Callable[[duckdb.DuckDBPyConnection], object]) -> object:
        """Run fn on the write connection between two group commits (prune and other maintenance)."""
        result: dict[str, object] = {}

        def job(con: duckdb.DuckDBPyConnection) -> None:
            result["value"] = fn(con)

        pending = Pending("call", pa.table({}), call=job)
        with self._cond:
            self._queue.append(pending)
            self._cond.notify()
        pending.done.wait()
        if pending.error is not None:
            raise pending.error
        return result.get("value")

    def stop(self) -> None:
        """Write what is queued, then end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()

    def _take(self) -> list[Pending]:
        with self._cond:
            while not self._queue and not self._stopping:
                self._cond.wait()
            taken = list(self._queue)
            self._queue.clear()
            self._pending_rows = 0
            return taken

    def _run(self) -> None:
        while True:
            taken = self._take()
            if not taken:
                return  # stopping, nothing left
            calls = [p for p in taken if p.kind == "call"]
            rows = [p for p in taken if p.kind != "call"]
            if rows:
                self._commit(rows)
            for pending in calls:
                try:
                    pending.call(self.con)
                except BaseException as exc:  # noqa: BLE001 - handed back to the caller
                    pending.error = exc
                pending.done.set()

    def _commit(self, batch: list[Pending]) -> None:
        started = time.perf_counter()
        try:
            try:
                self._insert_all(batch, skip_duplicates=False)
            except duckdb.ConstraintException:
                # A row was already stored (an exporter retry): redo the group, skipping duplicates.
                self.con.execute("ROLLBACK")
                self._insert_all(batch, skip_duplicates=True)
        except BaseException as exc:  # noqa: BLE001 - every sender gets the error
            log.exception("writing %d batches failed", len(batch))
            try:
                self.con.execute("ROLLBACK")
            except duckdb.Error:
                pass
            for pending in batch:
                pending.error = exc
                pending.done.set()
            return
        n_rows = sum(p.table.num_rows for p in batch)
        self.committed_rows += n_rows
        self.commits += 1
        if self.on_commit:
            self.on_commit(n_rows, time.perf_counter() - started)
        for pending in batch:
            pending.done.set()

    def _insert_all(self, batch: list[Pending], skip_duplicates: bool) -> None:
        self.con.execute("BEGIN TRANSACTION")
        for kind in ("traces", "logs"):
            tables = [p.table for p in batch if p.kind == kind and p.table.num_rows]
            if tables:
                store.insert_batch(self.con, kind, pa.concat_tables(tables), skip_duplicates)
        self.con.execute("COMMIT")
