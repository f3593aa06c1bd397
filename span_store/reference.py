"""The schema reference page, generated from the migrations (their COMMENT ON statements), so the page
cannot drift from the schema. `lightning-otel schema --markdown > docs/schema.md` regenerates it."""
from __future__ import annotations

import duckdb

from lightning_otel.span_store import store

SQL_OBJECTS = """
SELECT table_name AS name, 'table' AS kind, comment FROM duckdb_tables()
WHERE schema_name = 'main' AND table_name <> 'schema_migrations'
UNION ALL
SELECT view_name, 'view', comment FROM duckdb_views() WHERE schema_name = 'main' AND NOT internal
ORDER BY kind, name
"""
SQL_COLUMNS = """
SELECT column_name, data_type, comment FROM duckdb_columns()
WHERE schema_name = 'main' AND table_name = ? ORDER BY column_index
"""
SQL_MACROS = """
SELECT DISTINCT function_name, comment FROM duckdb_functions()
WHERE schema_name = 'main' AND function_type = 'macro' AND NOT internal ORDER BY function_name
"""


def schema_markdown() -> str:
    con = duckdb.connect()
    store.apply_migrations(con)
    lines = ["# Trace store schema", "",
             "Generated from `span_store/migrations/` by `lightning-otel schema --markdown`; do not edit by hand.",
             "", "Migrations:", ""]
    lines += [f"- `{m.version:04d}_{m.name}.sql`" for m in store.load_migrations()]
    for name, kind, comment in con.execute(SQL_OBJECTS).fetchall():
        lines += ["", f"## {kind} `{name}`", "", comment or "(undocumented)", "",
                  "| column | type | meaning |", "| --- | --- | --- |"]
        for column, data_type, col_comment in con.execute(SQL_COLUMNS, [name]).fetchall():
            text = (col_comment or "").replace("|", "\\|")
            lines.append(f"| `{column}` | {data_type} | {text} |")
    macros = con.execute(SQL_MACROS).fetchall()
    if macros:
        lines += ["", "## SQL macros", ""]
        lines += [f"- `{name}`: {comment or ''}" for name, comment in macros]
    con.close()
    return "\n".join(lines) + "\n"


def undocumented_columns() -> list[str]:
    """Every table or view column without a comment; the tests keep this empty."""
    con = duckdb.connect()
    store.apply_migrations(con)
    missing = [f"{t}.{c}" for t, c in con.execute(
        "SELECT table_name, column_name FROM duckdb_columns() WHERE schema_name = 'main' "
        "AND NOT internal AND table_name <> 'schema_migrations' AND comment IS NULL").fetchall()]
    con.close()
    return missing
