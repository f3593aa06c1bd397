"""Baseline for the ingest benchmark: the same collector (HTTP, decoding, group commit) except that rows
go into DuckDB one INSERT per row instead of one Arrow batch. Run like `lightning-otel collect`:

    python benchmarks/row_by_row_collector.py collect --db /tmp/base.duckdb --port 0
"""
from __future__ import annotations

import sys

import pyarrow as pa

from lightning_otel import cli
from lightning_otel.span_store import store


def insert_row_by_row(con, kind: str, batch: pa.Table, skip_duplicates: bool = True) -> None:
    table = "spans" if kind == "traces" else "logs"
    names = batch.column_names
    sql = f"INSERT OR IGNORE INTO {table} ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})"
    for row in batch.to_pylist():
        con.execute(sql, [row[name] for name in names])


if __name__ == "__main__":
    store.insert_batch = insert_row_by_row
    sys.exit(cli.main())
