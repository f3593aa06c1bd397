"""The SQL endpoint cannot change the collector: no settings, no maintenance, no files (issue 23).

Every probe goes through a real collector on 127.0.0.1 and must be refused with 400 and a message; after
each one an OTLP batch must still commit and be readable, and the collector's settings must be unchanged.
"""
from __future__ import annotations

import json

import duckdb
import pytest

from conftest import post
from lightning_otel.cli import main
from lightning_otel.errors import UserError
from lightning_otel.span_store import client, readonly, store
from test_collector_http import sample_request

SETTINGS = "SELECT current_setting('memory_limit') AS m, current_setting('threads') AS t"

# What today's code let through (EXPLAIN ANALYZE ran what it wrapped; the store file is an allowed path).
REPORTED = ["EXPLAIN ANALYZE SET memory_limit='20MB'", "EXPLAIN ANALYZE SET lock_configuration=true",
            "EXPLAIN CHECKPOINT", "EXPLAIN ANALYZE CHECKPOINT", "EXPLAIN ANALYZE VACUUM",
            "EXPLAIN ANALYZE SET threads=1", "SELECT * FROM read_blob('{db}')", "SELECT * FROM read_text('{db}')"]
STATEMENTS = [
    "INSERT INTO tasks (task_id) VALUES ('x')", "UPDATE spans SET name = 'x'", "DELETE FROM spans",
    "CREATE TABLE t (a INT)", "CREATE MACRO m(x) AS x", "CREATE SECRET s (TYPE s3)", "DROP VIEW llm_calls",
    "ALTER TABLE spans ADD COLUMN z INT", "TRUNCATE spans", "ATTACH ':memory:' AS m", "DETACH m", "USE system",
    "COPY spans TO '{db}.csv'", "COPY spans FROM '{db}'", "EXPORT DATABASE '{db}.out'", "IMPORT DATABASE '{db}'",
    "INSTALL httpfs", "LOAD httpfs", "UPDATE EXTENSIONS", "PRAGMA enable_profiling", "PRAGMA memory_limit='20MB'",
    "PRAGMA force_checkpoint", "SET threads=1", "SET GLOBAL memory_limit='20MB'", "SET VARIABLE v = 1",
    "RESET memory_limit", "CALL checkpoint()", "CALL enable_logging()", "CALL force_checkpoint()", "CHECKPOINT",
    "FORCE CHECKPOINT", "VACUUM", "ANALYZE", "BEGIN TRANSACTION", "COMMIT", "ROLLBACK", "PREPARE p AS SELECT 1",
    "DEALLOCATE p",
]
FUNCTIONS = [
    "SELECT * FROM read_blob('{db}.wal')", "SELECT * FROM read_text('{db}.tmp/*')", "SELECT * FROM read_csv('{db}')",
    "SELECT * FROM read_csv_auto('{db}')", "SELECT * FROM read_parquet('{db}')", "SELECT * FROM parquet_scan('{db}')",
    "SELECT * FROM parquet_metadata('{db}')", "SELECT * FROM read_json('{db}')", "SELECT * FROM read_json_auto('{db}')",
    "SELECT * FROM read_ndjson_objects('{db}')", "SELECT * FROM sniff_csv('{db}')", "SELECT * FROM glob('{dir}/*')",
    "SELECT * FROM read_duckdb('{db}')", "SELECT * FROM '{db}'", "SELECT * FROM \"{db}\"", "DESCRIBE '{db}'",
    "SELECT * FROM query_table('{db}')", "SELECT * FROM query('SELECT 1')", "SELECT * FROM token_records_of('{db}')",
    "SELECT * FROM checkpoint()", "SELECT * FROM force_checkpoint()", "SELECT * FROM enable_logging()",
    "SELECT * FROM enable_profiling()", "SELECT * FROM truncate_duckdb_logs()",
    "SELECT * FROM json_execute_serialized_sql('{{}}')",
    # hidden deeper in the statement, or in another spelling
    "WITH f AS (SELECT * FROM read_blob('{db}')) SELECT size FROM f", "SELECT (SELECT size FROM READ_BLOB('{db}'))",
    "SELECT * FROM spans, LATERAL (SELECT * FROM main.read_text('{db}'))",
    "SELECT name FROM spans WHERE name IN (SELECT content FROM read_text('{db}'))",
    "SELECT * FROM spans UNION ALL BY NAME SELECT * FROM read_text('{db}')",
]
DISGUISED = [
    "explain analyze set threads = 1", "  EXPLAIN ANALYZE SET threads=1 ;  ", "EXPLAIN ANALYSE CHECKPOINT",
    "-- note\nEXPLAIN /* c */ ANALYZE\n-- x\nSET memory_limit='20MB'", "EXPLAIN (ANALYZE) SET threads=1",
    "EXPLAIN (ANALYZE, FORMAT json) CHECKPOINT", "EXPLAIN (FORMAT json) SET threads=1",
    "EXPLAIN ANALYZE SELECT * FROM read_blob('{db}')", "EXPLAIN SELECT * FROM read_text('{db}')",
    "EXPLAIN ANALYZE SELECT * FROM checkpoint()", "EXPLAIN (ANALYZE) (SELECT * FROM read_blob('{db}'))",
    "SELECT 1; EXPLAIN ANALYZE SET threads=1", "EXPLAIN ANALYZE", "EXPLAIN",
]
READS = ["SELECT count(*) FROM spans", "FROM llm_calls", "EXPLAIN SELECT * FROM spans",
         "EXPLAIN ANALYZE SELECT count(*) FROM spans", "explain /* c */ analyze (select name from spans)",
         "EXPLAIN (FORMAT json) SELECT 1", "EXPLAIN (SELECT 1) UNION ALL (SELECT 2)", "DESCRIBE spans", "SHOW TABLES",
         "SUMMARIZE tasks", "SELECT * FROM range(3)", "SELECT * FROM unnest([1, 2])",
         "SELECT table_name FROM duckdb_tables()", "SELECT * FROM information_schema.columns",
         "SELECT * FROM pragma_table_info('spans')", "SELECT attr('{\"a\": \"b\"}', 'a')",
         "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r WHERE n < 3) SELECT * FROM r"]


def probes(db) -> list[str]:
    return [p.format(db=db, dir=db.parent) for p in REPORTED + STATEMENTS + [f"EXPLAIN {s}" for s in STATEMENTS]
            + [f"EXPLAIN ANALYZE {s}" for s in STATEMENTS] + FUNCTIONS + DISGUISED]


def query(url: str, sql: str) -> tuple[int, str]:
    status, _, body = post(url + "/v1/query", sql.encode(), "text/plain")
    return status, (json.loads(body)["message"] if status != 200 else "")


@pytest.mark.heavy
def test_probes_are_refused_and_ingest_keeps_working(collector, db_path):
    assert post(collector.url + "/v1/traces", sample_request(1, seed=0).SerializeToString())[0] == 200
    settings = client.query(SETTINGS, db_path).to_dicts()
    for number, sql in enumerate(probes(collector.db), start=1):
        status, message = query(collector.url, sql)
        assert status == 400 and message, (sql, status)
        status, _, _ = post(collector.url + "/v1/traces", sample_request(1, seed=number).SerializeToString())
        assert status == 200, f"ingest failed after {sql!r}"
        assert client.query("SELECT count(*) AS n FROM spans", db_path)["n"][0] == number + 1, sql
    assert client.query(SETTINGS, db_path).to_dicts() == settings
    assert collector.health()["committed_rows"] == len(probes(collector.db)) + 1


@pytest.mark.parametrize("sql, needle", [
    ("EXPLAIN ANALYZE SET memory_limit='20MB'", "EXPLAIN only wraps a read statement"),
    ("EXPLAIN (ANALYZE) VACUUM", "got VACUUM"),
    ("UPDATE EXTENSIONS", "only read statements"),
    ("SELECT * FROM read_blob('{db}')", "read_blob() is disabled"),
    ("SELECT * FROM '{db}'", "is a file path"),
    ("SELECT * FROM checkpoint()", "checkpoint() is disabled"),
    ("SET threads=1", "only read statements"),
])
@pytest.mark.heavy
def test_refusals_say_what_is_wrong_and_what_to_do(collector, sql, needle):
    status, message = query(collector.url, sql.format(db=collector.db))
    assert status == 400 and needle in message, message


def test_reads_still_work(collector, db_path):
    post(collector.url + "/v1/traces", sample_request(2).SerializeToString())
    for sql in READS:
        assert query(collector.url, sql) == (200, ""), sql
    assert client.query("EXPLAIN ANALYZE SELECT count(*) FROM spans", db_path)["explain_key"][0] == "analyzed_plan"
    assert client.query("SELECT count(*) AS n FROM spans", db_path)["n"][0] == 2


def test_the_file_path_follows_the_same_rules(make_collector, db_path, capsys):
    collector = make_collector()
    post(collector.url + "/v1/traces", sample_request(2).SerializeToString())
    collector.close()
    for sql in ["EXPLAIN ANALYZE SET threads=1", f"SELECT * FROM read_blob('{db_path}')", "EXPLAIN CHECKPOINT"]:
        with pytest.raises(UserError):
            client.query(sql, db_path)
    assert client.query("EXPLAIN ANALYZE SELECT count(*) FROM spans", db_path)["explain_key"][0] == "analyzed_plan"
    assert main(["sql", "SELECT count(*) AS n FROM llm_calls", "--db", str(db_path), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"n": 0}]
    assert main(["sql", f"SELECT * FROM read_text('{db_path}')", "--db", str(db_path)]) == 2
    assert "read_text() is disabled" in capsys.readouterr().err


def test_store_connections_have_their_configuration_locked(tmp_path):
    con = store.connect(tmp_path / "s.duckdb", memory_limit="1GB", checkpoint_threshold="64MB")
    with pytest.raises(duckdb.InvalidInputException, match="locked"):
        con.execute("SET threads=1")
    assert store.write_records(con, "tasks", [{"task_id": "t", "fields": {"q": 1}}]) == 1
    assert store.prune(con, 0) == {"spans": 0, "logs": 0}
    con.execute("CHECKPOINT")
    con.close()
    reader = store.connect(tmp_path / "s.duckdb", read_only=True)
    with pytest.raises(duckdb.InvalidInputException, match="locked"):
        reader.execute("SET memory_limit='20MB'")
    reader.close()


@pytest.mark.parametrize("sql, wrapped", [
    ("EXPLAIN SELECT 1", ["SELECT 1"]),
    ("explain analyze (select 1)", ["(select 1)"]),
    ("EXPLAIN /* c */ ANALYZE -- x\n SELECT 1;", ["SELECT 1;"]),
    ("EXPLAIN (ANALYZE, FORMAT json) SELECT 1", ["SELECT 1"]),
    ("EXPLAIN (SELECT 1) UNION (SELECT 2)", ["(SELECT 1) UNION (SELECT 2)"]),
])
def test_the_statement_an_explain_wraps(sql, wrapped):
    assert readonly.explained_statements(sql) == wrapped
