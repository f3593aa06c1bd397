"""What the command line shows people: tables of query results, and progress on stderr."""
from __future__ import annotations

import sys
from pathlib import Path

from lightning_otel.errors import UserError


def write_table(table, fmt: str, output: Path | None) -> None:
    """Render an Arrow table: a readable table for people, csv/json/parquet for scripts."""
    import polars as pl

    frame = pl.from_arrow(table)
    if fmt == "parquet":
        if output is None and sys.stdout.isatty():
            raise UserError("parquet is binary: give --output FILE, or redirect stdout to a file")
        frame.write_parquet(output or sys.stdout.buffer)
        return
    if fmt == "csv":
        nested = [name for name, dtype in frame.schema.items() if dtype.is_nested()]
        if nested:
            raise UserError(f"CSV cannot hold the nested column(s) {', '.join(nested)}: use --format json, "
                            f"or select scalar columns")
        text = frame.write_csv()
    elif fmt == "json":
        text = frame.write_json() + "\n"
    else:
        with pl.Config(tbl_rows=-1, tbl_cols=-1, fmt_str_lengths=120, tbl_width_chars=200,
                       tbl_hide_dataframe_shape=True, tbl_hide_column_data_types=True):
            text = f"{frame}\n"
    if output:
        output.write_text(text)
    else:
        sys.stdout.write(text)


class Progress:
    """A one-line progress bar on stderr (plain lines when stderr is not a terminal)."""

    def __init__(self, label: str):
        self.label = label
        self.counts: dict[str, int] = {}

    def update(self, result, done: int, total: int) -> None:
        self.counts[result.status] = self.counts.get(result.status, 0) + 1
        width = 30
        bar = "#" * (width * done // total) + "." * (width - width * done // total)
        detail = " ".join(f"{k}={v}" for k, v in sorted(self.counts.items()))
        end = "\n" if done == total or not sys.stderr.isatty() else ""
        sys.stderr.write(f"\r{self.label} [{bar}] {done}/{total} {detail}{end}")
        sys.stderr.flush()


class StepProgress:
    """Progress of named phases on stderr: one line per phase ("round 2/5 rollouts [####....] 6/16")."""

    def __init__(self) -> None:
        self.label: str | None = None

    def __call__(self, label: str, done: int, total: int) -> None:
        width = 30
        filled = width * done // max(total, 1)
        end = "\n" if done >= total or not sys.stderr.isatty() else ""
        sys.stderr.write(f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}{end}")
        sys.stderr.flush()
