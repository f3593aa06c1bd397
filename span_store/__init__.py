"""Span store: an OTLP/HTTP collector that writes into one DuckDB file, and SQL over it."""
