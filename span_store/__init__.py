"""Span store: an OTLP/HTTP collector that writes into one DuckDB file, and SQL over it.

    from lightning_otel.span_store import query
    frame = query("SELECT agent, count(*) AS calls FROM llm_calls GROUP BY agent", db="traces.duckdb")
"""
from __future__ import annotations

from typing import Any

__all__ = ["query", "query_arrow", "record_batches", "ingest_files", "prune", "write_records"]


def __getattr__(name: str) -> Any:
    # Lazy, so decoder workers and the collector do not pay for Polars when they import a submodule.
    if name in __all__:
        from lightning_otel.span_store import client
        return getattr(client, name)
    raise AttributeError(f"module 'lightning_otel.span_store' has no attribute {name!r}")
