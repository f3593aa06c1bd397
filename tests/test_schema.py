"""Schema: numbered migrations, an up-to-date reference page, and upgrades of older store files."""
from __future__ import annotations

import duckdb

from conftest import REPO
from lightning_otel.span_store import reference, store


def test_reference_page_is_generated_from_the_migrations():
    page = (REPO / "docs" / "schema.md").read_text()
    assert page == reference.schema_markdown(), \
        "docs/schema.md is stale: run `lightning-otel schema --markdown > docs/schema.md`"


def test_every_table_and_view_column_is_documented():
    assert reference.undocumented_columns() == []


def test_views_named_by_the_design_exist():
    con = duckdb.connect()
    store.apply_migrations(con)
    views = {row[0] for row in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()}
    tables = {row[0] for row in con.execute("SELECT table_name FROM duckdb_tables()").fetchall()}
    assert {"llm_calls", "tool_calls", "rollouts"} <= views
    assert {"spans", "logs", "tasks", "rollout_runs", "rewards", "schema_migrations"} <= tables


def test_an_older_store_is_migrated_on_open(tmp_path):
    path = tmp_path / "old.duckdb"
    first = store.load_migrations()[0]
    with duckdb.connect(str(path)) as con:
        con.execute(store.SQL_CREATE_MIGRATIONS)
        con.execute(first.sql)
        con.execute("INSERT INTO schema_migrations (version, name) VALUES (?, ?)", [first.version, first.name])
        con.execute("INSERT INTO spans (trace_id, span_id, name) "
                    "VALUES ('a' || repeat('0', 31), 'b' || repeat('0', 15), 'kept')")
    con = store.connect(path, read_only=True)
    versions = [r[0] for r in con.execute("SELECT version FROM schema_migrations ORDER BY 1").fetchall()]
    assert versions == [m.version for m in store.load_migrations()]
    assert con.execute("SELECT name FROM spans").fetchall() == [("kept",)]
    con.close()


def test_a_store_from_a_newer_version_is_refused(tmp_path):
    import pytest
    from lightning_otel.errors import UserError
    path = tmp_path / "new.duckdb"
    store.connect(path).close()
    with duckdb.connect(str(path)) as con:
        con.execute("INSERT INTO schema_migrations (version, name) VALUES (999, 'future')")
    with pytest.raises(UserError, match="newer lightning-otel"):
        store.connect(path)
