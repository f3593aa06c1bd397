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
PARTITIONED = {
    "spans": f"SELECT *, {DAY_OF.format(col='start_ns')} AS day FROM spans ORDER BY start_ns",
    "logs": f"SELECT *, {DAY_OF.format(col='coalesce(nullif(time_ns, 0), observed_ns)')} AS day "
            f"FROM logs ORDER BY time_ns",
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
    for table, sql in PARTITIONED.items():
        schema, batches = client.record_batches(sql, db)
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


def _counting(batches, written: dict[str, int], table: str):
    for batch in batches:
        written[table] = written.get(table, 0) + batch.num_rows
        yield batch
