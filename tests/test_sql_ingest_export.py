"""SQL through the collector and on the file, ingest of OTLP/JSON files, Parquet export, prune, CLI."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys

import duckdb
import polars as pl
import pyarrow.parquet as pq
import pytest

from conftest import post
from lightning_otel.cli import main
from lightning_otel.errors import UserError
from lightning_otel.span_store import client
from test_collector_http import sample_request
from tests.helpers.otlp_json import request_to_json

DAY = 86_400 * 10**9


def write_jsonl(path, requests):
    path.write_text("".join(json.dumps(request_to_json(r)) + "\n" for r in requests))
    return path


def at(request, start_ns: int):
    for span in request.resource_spans[0].scope_spans[0].spans:
        span.start_time_unix_nano, span.end_time_unix_nano = start_ns, start_ns + 1000
    return request


@pytest.mark.heavy
@pytest.mark.parametrize("live", [True, False], ids=["through-collector", "on-file"])
def test_sql_reads_and_refuses_everything_else(live, make_collector, db_path, capsys):
    collector = make_collector()
    post(collector.url + "/v1/traces", sample_request(3).SerializeToString())
    if not live:
        collector.close()
    frame = client.query("SELECT name, input_tokens FROM spans ORDER BY name", db_path)
    assert isinstance(frame, pl.DataFrame)
    assert frame.to_dicts() == [{"name": f"op{i}", "input_tokens": 7 + i} for i in range(3)]
    for sql, needle in [("DELETE FROM spans", "DELETE"), ("DROP TABLE spans", "DROP"),
                        ("INSERT INTO tasks VALUES ('x', '{}', NULL, NULL)", "INSERT"),
                        ("COPY spans TO 'x.csv'", "COPY"), ("ATTACH 'other.db'", "ATTACH"),
                        ("PRAGMA version", "PRAGMA"), ("SELECT 1; SELECT 2", "one statement"),
                        ("SELECT * FROM read_text('/etc/passwd')", "disabled"),
                        ("SELECT * FROM read_csv('/etc/passwd')", "disabled"),
                        ("SELEC nonsense", "parse")]:
        with pytest.raises(UserError, match=needle):
            client.query(sql, db_path)
    assert client.query("SELECT count(*) AS n FROM spans", db_path)["n"][0] == 3
    assert main(["sql", "SELECT name FROM spans ORDER BY name", "--db", str(db_path), "--format", "csv"]) == 0
    assert capsys.readouterr().out == "name\nop0\nop1\nop2\n"
    assert main(["sql", "SELECT count(*) AS n FROM spans", "--db", str(db_path), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"n": 3}]
    assert main(["sql", "DELETE FROM spans", "--db", str(db_path)]) == 2
    assert "only read statements" in capsys.readouterr().err


def test_sql_table_and_parquet_output(collector, db_path, tmp_path, capsys):
    post(collector.url + "/v1/traces", sample_request(2).SerializeToString())
    assert main(["sql", "SELECT name, kind FROM spans ORDER BY name", "--db", str(db_path)]) == 0
    out = capsys.readouterr().out
    assert "op0" in out and "CLIENT" in out and "shape" not in out
    target = tmp_path / "out.parquet"
    assert main(["sql", "SELECT * FROM spans", "--db", str(db_path), "--format", "parquet",
                 "--output", str(target)]) == 0
    assert pq.read_table(target).num_rows == 2


def test_sql_on_a_missing_store_says_how_to_create_one(tmp_path):
    with pytest.raises(UserError, match="lightning-otel collect"):
        client.query("SELECT 1", tmp_path / "none.duckdb")


@pytest.mark.parametrize("live", [True, False], ids=["through-collector", "on-file"])
def test_ingest_collector_file_exporter_lines(live, make_collector, db_path, tmp_path):
    good = write_jsonl(tmp_path / "a.jsonl", [sample_request(3, seed=10), sample_request(2, seed=11)])
    gz = tmp_path / "b.jsonl.gz"
    gz.write_bytes(gzip.compress(json.dumps(request_to_json(sample_request(4, seed=12))).encode() + b"\n"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([
        json.dumps(request_to_json(sample_request(1, seed=13))),
        "{oops",
        json.dumps({"resourceMetrics": []}),
        json.dumps({"something": 1}),
        json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": 7}]}]}]}),
    ]) + "\n")
    if live:
        make_collector()
    report = client.ingest_files([good, gz, bad], db_path)
    assert (report.spans, report.requests, report.skipped_metrics) == (3 + 2 + 4 + 1, 4, 1)
    assert [e.split(": ")[0] for e in report.errors] == [f"{bad}:2", f"{bad}:4", f"{bad}:5"]
    assert client.query("SELECT count(*) AS n FROM spans", db_path)["n"][0] == 10
    again = client.ingest_files([good], db_path)
    assert again.spans == 5
    assert client.query("SELECT count(*) AS n FROM spans", db_path)["n"][0] == 10


def test_ingest_cli_exit_code_names_bad_lines(db_path, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(request_to_json(sample_request(2))) + "\nnot json\n")
    assert main(["ingest", str(bad), "--db", str(db_path)]) == 1
    captured = capsys.readouterr()
    assert "stored 2 spans" in captured.out and f"{bad}:2" in captured.err
    assert main(["ingest", str(tmp_path / "missing.jsonl"), "--db", str(db_path)]) == 2


@pytest.mark.heavy
@pytest.mark.parametrize("live", [True, False], ids=["through-collector", "on-file"])
def test_export_parquet_by_day_and_prune(live, make_collector, db_path, tmp_path):
    collector = make_collector()
    day0 = 1_764_460_800 * 10**9  # 2025-11-30T00:00:00Z
    for i, start in enumerate([day0 + 3600 * 10**9, day0 + DAY + 60 * 10**9, day0 + 3 * DAY]):
        assert post(collector.url + "/v1/traces", at(sample_request(2, seed=20 + i), start)
                    .SerializeToString())[0] == 200
    if not live:
        collector.close()
    out = tmp_path / "export"
    written = client_export(db_path, out)
    assert written["spans"] == 6
    days = sorted(p.name for p in (out / "spans").iterdir())
    assert days == ["day=2025-11-30", "day=2025-12-01", "day=2025-12-03"]
    con = duckdb.connect()
    rows = con.execute(f"SELECT day, count(*) FROM read_parquet('{out}/spans/*/*.parquet', hive_partitioning=true) "
                       "GROUP BY day ORDER BY day").fetchall()
    assert [r[1] for r in rows] == [2, 2, 2]
    with pytest.raises(UserError, match="not empty"):
        client_export(db_path, out)
    assert client_export(db_path, out, overwrite=True)["spans"] == 6

    counts = client.prune(db_path, day0 + DAY + 3600 * 10**9)
    assert counts["spans"] == 4
    left = client.query("SELECT min(start_ns) AS s FROM spans", db_path)["s"][0]
    assert left == day0 + 3 * DAY
    assert main(["prune", "--db", str(db_path), "--before", "not-a-date"]) == 2


def test_prune_keeps_traces_that_are_still_going(collector, db_path):
    request = sample_request(2, seed=30)
    spans = request.resource_spans[0].scope_spans[0].spans
    spans[0].start_time_unix_nano, spans[0].end_time_unix_nano = 10, 20
    spans[1].start_time_unix_nano, spans[1].end_time_unix_nano = 10, 5000
    post(collector.url + "/v1/traces", request.SerializeToString())
    assert client.prune(db_path, 1000)["spans"] == 0
    assert client.prune(db_path, 6000)["spans"] == 2


def client_export(db, out, overwrite=False):
    from lightning_otel.span_store.export import export_parquet
    return export_parquet(db, out, overwrite=overwrite)


@pytest.mark.heavy
def test_every_command_has_help():
    from lightning_otel.cli import build_parser
    commands = build_parser()._subparsers._group_actions[0].choices  # noqa: SLF001
    for name in commands:
        result = subprocess.run([sys.executable, "-m", "lightning_otel.cli", name, "--help"],
                                capture_output=True, text=True)
        assert result.returncode == 0 and "usage: lightning-otel" in result.stdout, name


def test_train_and_eval_are_not_top_level_modules(tmp_path):
    code = ("import importlib.util, lightning_otel.train, lightning_otel.eval, lightning_otel.span_store;"
            "print(importlib.util.find_spec('train'), importlib.util.find_spec('eval'),"
            " importlib.util.find_spec('span_store'))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["None", "None", "None"]


def test_csv_rendering_of_nested_columns(collector, db_path, capsys):
    post(collector.url + "/v1/traces", sample_request(1).SerializeToString())
    assert main(["sql", "SELECT [1, 2] AS xs, {'a': 1} AS s", "--db", str(db_path), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"xs": [1, 2], "s": {"a": 1}}]
    assert main(["sql", "SELECT [1, 2] AS xs", "--db", str(db_path), "--format", "csv"]) == 2
    assert "--format json" in capsys.readouterr().err


def test_demo_tours_the_bundled_traces(tmp_path, capsys):
    assert main(["tour", "--folder", str(tmp_path / "demo")]) == 0
    out = capsys.readouterr().out
    for needle in ("SQL Analyst", "write_query", "sql_agent", "execute_sql", "ro-langgraph-1"):
        assert needle in out
    assert client.query("SELECT count(*) AS n FROM llm_calls", tmp_path / "demo" / "traces.duckdb")["n"][0] == 12
    assert list((tmp_path / "demo" / "parquet" / "spans").glob("day=*/*.parquet"))


def test_public_api_and_light_core(db_path, collector):
    from lightning_otel.span_store import query
    post(collector.url + "/v1/traces", sample_request(1).SerializeToString())
    assert isinstance(query("SELECT * FROM spans", db_path), pl.DataFrame)
    code = ("import sys, lightning_otel, lightning_otel.span_store;"
            "print(sorted(m for m in ('duckdb', 'polars', 'pyarrow', 'torch') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "[]", "the core an agent process imports must stay light"
