"""Parquet export: spans and logs partitioned by UTC day (Hive layout, `day=YYYY-MM-DD`), the runner's
tables as single files. Other tools (DuckDB, Polars, Spark, an OpenTelemetry Collector pipeline's
storage) read the folder as it is.
"""
from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from lightning_otel.errors import UserError
from lightning_otel.span_store import client

DAY_OF = "strftime(make_timestamp_ns({col}), '%Y-%m-%d')"
# Read a page at a time, in key order, so each answer stays under a collector's --max-result-rows and
# --max-result-bytes (20,000 rows: 26 KB a row at the default bytes bound).
PAGE_ROWS = 20_000
SQL_PAGE = "SELECT *, {day} AS day FROM {table} WHERE {after} ORDER BY {keys} LIMIT {rows}"
PARTITIONED = {
    "spans": (DAY_OF.format(col="start_ns"), ("start_ns", "trace_id", "span_id")),
    "logs": (DAY_OF.format(col="coalesce(nullif(time_ns, 0), observed_ns)"), ("time_ns", "log_id")),
}
WHOLE = ("tasks", "rollout_runs", "rewards")


def export_parquet(db: Path | str, out_dir: Path | str, overwrite: bool = False) -> dict[str, int]:
    """Write every table under out_dir; returns rows written per table."""
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise UserError(f"{out} is not empty; choose an empty folder or pass --overwrite to replace it")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, int] = {}
    for table, (day, keys) in PARTITIONED.items():
        schema, batches = _pages(db, table, day, keys)
        counted = _counting(batches, written, table)
        ds.write_dataset(pa.RecordBatchReader.from_batches(schema, counted), out / table, format="parquet",
                         partitioning=ds.partitioning(pa.schema([("day", pa.string())]), flavor="hive"),
                         basename_template=f"part-{uuid.uuid4().hex[:8]}-{{i}}.parquet",
                         existing_data_behavior="overwrite_or_ignore")
        written.setdefault(table, 0)
    for table in WHOLE:
        data = client.query_arrow(f"SELECT * FROM {table}", db)
        pq.write_table(data, out / f"{table}.parquet")
        written[table] = data.num_rows
    return written


def _pages(db: Path | str, table: str, day: str, keys: tuple[str, ...]):
    """The table's rows with their day, as (schema, batches), fetched PAGE_ROWS at a time after the last key."""
    key_sql = ", ".join(f"coalesce({key}, 0)" if key.endswith("_ns") else key for key in keys)

    def page(after: str) -> pa.Table:
        return client.query_arrow(SQL_PAGE.format(day=day, table=table, after=after, keys=key_sql,
                                                  rows=PAGE_ROWS), db)

    first = page("true")

    def batches():
        current = first
        while True:
            yield from current.to_batches()
            if current.num_rows < PAGE_ROWS:
                return
            last = [current.column(key)[-1].as_py() for key in keys]
            values = ", ".join(str(v or 0) if key.endswith("_ns") else client.sql_literal(v)
                               for key, v in zip(keys, last))
            current = page(f"({key_sql}) > ({values})")

    return first.schema, batches()


def _counting(batches, written: dict[str, int], table: str):
    for batch in batches:
        written[table] = written.get(table, 0) + batch.num_rows
        yield batch
