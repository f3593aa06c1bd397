"""Query memory bounds on a real `lightning-otel collect` process: queries that build huge values or answers
get 413 with what to do, the process stays under a resident bound measured from outside, and ingest goes on."""
from __future__ import annotations

import http.client
import threading
import time
from contextlib import contextmanager
from urllib.parse import urlsplit

import orjson
import psutil
import pytest

from conftest import post
from lightning_otel.cli import build_parser
from lightning_otel.errors import UserError
from lightning_otel.span_store import client
from lightning_otel.span_store.collector import CollectorConfig, private_config
from lightning_otel.span_store.store import parse_size
from test_collector_http import sample_request

GB = 10**9
MEMORY_LIMIT = "1GB"
# Each builds about 4 GB of strings, a vector (2048 rows) at a time; before the bounds the collector held the
# whole answer as one Arrow batch: over 4 GB resident, then streamed it.
WIDE_QUERIES = [
    "SELECT repeat('x', 50000) || i AS a, repeat('y', 50000) || i AS b FROM range(40000) t(i)",
    "SELECT i, repeat('x', 100000) || i AS s FROM range(40000) t(i) ORDER BY i",
    "SELECT list(repeat('x', 1000) || i) AS l FROM range(4000000) t(i) GROUP BY i % 2",
    "SELECT string_agg(repeat('x', 1000), '') AS s FROM range(3000000)",
]


def status_of_query(url: str, sql: str, timeout: float = 120) -> tuple[int, str]:
    """POST a query and read only the status and, for an error, its message: a 200 answer (gigabytes on
    the code before the bounds) is left unread."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request("POST", "/v1/query", body=sql.encode(), headers={"Content-Type": "text/plain"})
        response = conn.getresponse()
        message = "" if response.status == 200 else orjson.loads(response.read())["message"]
        return response.status, message
    finally:
        conn.close()


@contextmanager
def peak_resident(pid: int):
    """Sample a process's resident memory every 5 ms; yields a list whose one item is the peak so far."""
    process, peak, done = psutil.Process(pid), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            try:
                peak[0] = max(peak[0], process.memory_info().rss)
            except psutil.Error:
                return
            time.sleep(0.005)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        done.set()
        thread.join()


def ingest_and_count(url: str, db_path, seed: int) -> int:
    status, _, _ = post(url + "/v1/traces", sample_request(5, seed=seed).SerializeToString())
    assert status == 200, "ingest must keep committing after a stopped query"
    return client.query("SELECT count(*) AS n FROM spans", db_path)["n"][0]


@pytest.mark.heavy
def test_wide_queries_get_413_and_memory_stays_bounded(collector_process, db_path):
    proc = collector_process("--memory-limit", MEMORY_LIMIT)
    bound = 1 * GB + 1 * GB  # memory_limit + 1 GB
    assert ingest_and_count(proc.url, db_path, seed=1) == 5
    with peak_resident(proc.proc.pid) as peak:
        for number, sql in enumerate(WIDE_QUERIES):
            status, message = status_of_query(proc.url, sql)
            assert status == 413, (sql, status, message)
            assert "add LIMIT" in message and ("--max-result-bytes" in message or "--memory-limit" in message)
            assert peak[0] < bound, f"{sql}: collector reached {peak[0] / GB:.2f} GB resident"
            assert proc.proc.poll() is None
            # previously acknowledged spans are still there, and a new batch commits
            assert ingest_and_count(proc.url, db_path, seed=10 + number) == 5 * (number + 2)


@pytest.mark.heavy
def test_memory_guard_stops_a_query_the_result_bounds_let_through(collector_process, db_path):
    proc = collector_process("--memory-limit", MEMORY_LIMIT, "--max-result-bytes", str(16 * GB),
                             "--max-query-memory", "1.5GB")
    with peak_resident(proc.proc.pid) as peak:
        status, message = status_of_query(proc.url, WIDE_QUERIES[0])
    assert status == 413 and "resident memory" in message and "--max-query-memory" in message, message
    assert peak[0] < 1.5 * GB + 1 * GB
    assert ingest_and_count(proc.url, db_path, seed=3) == 5
    # the memory went back: an ordinary query right after is answered
    assert client.query("SELECT count(*) AS n FROM range(1000)", db_path)["n"][0] == 1000


@pytest.mark.heavy
def test_one_huge_value_gets_413(collector_process, db_path):
    """A single value is built (and copied once into Arrow) before any check can stop it: the collector then
    peaks near twice or three times the value, and answers 413 instead of sending it."""
    proc = collector_process("--memory-limit", MEMORY_LIMIT)
    with peak_resident(proc.proc.pid) as peak:
        status, message = status_of_query(proc.url, "SELECT repeat('x', 600000000) AS s")
    assert status == 413, message
    assert peak[0] < 1 * GB + 2 * GB
    assert ingest_and_count(proc.url, db_path, seed=4) == 5


def test_row_bound_and_a_large_allowed_answer(collector_process, db_path):
    proc = collector_process("--max-result-rows", "1000000")
    status, message = status_of_query(proc.url, "SELECT * FROM range(1000001)")
    assert status == 413 and "more than 1000000 rows" in message and "--max-result-rows" in message
    with pytest.raises(UserError, match="more than 1000000 rows"):  # the Python client says why
        client.query("SELECT * FROM range(2000000)", db_path)
    # up to the bounds the whole answer comes back: a million rows, about 300 MB of strings
    table = client.query_arrow("SELECT i, repeat('x', 300) || i AS s FROM range(1000000) t(i)", db_path)
    assert table.num_rows == 1_000_000 and table.column("s")[999_999].as_py().endswith("999999")
    assert ingest_and_count(proc.url, db_path, seed=5) == 5


def test_export_reads_pages_under_the_row_bound(collector_process, db_path, tmp_path, monkeypatch):
    from lightning_otel.span_store import export

    proc = collector_process("--max-result-rows", "1000")
    for seed in range(5):
        assert post(proc.url + "/v1/traces", sample_request(500, seed=40 + seed).SerializeToString())[0] == 200
    monkeypatch.setattr(export, "PAGE_ROWS", 700, raising=False)  # several pages, the last partial
    written = export.export_parquet(db_path, tmp_path / "out")
    assert written["spans"] == 2500
    import duckdb
    ids = duckdb.connect().execute(f"SELECT count(DISTINCT span_id) FROM '{tmp_path}/out/spans/*/*.parquet'")
    assert ids.fetchone()[0] == 2500


@pytest.mark.heavy
def test_spilling_past_the_temp_bound_gets_413(collector_process, db_path):
    proc = collector_process("--memory-limit", "200MB", "--max-temp-size", "100MB")
    sorted_strings = ("SELECT count(*) FROM (SELECT i, md5(i::VARCHAR) || repeat('x', 100) AS s "
                      "FROM range(20000000) t(i) ORDER BY s)")
    status, message = status_of_query(proc.url, sorted_strings)
    assert status == 413 and "--max-temp-size" in message, message
    assert ingest_and_count(proc.url, db_path, seed=6) == 5


def test_the_memory_bound_is_collects_not_that_of_a_collector_inside_another_process(tmp_path):
    """`collect` owns its process, so its resident memory bounds queries (auto: memory_limit + 1GB). A collector a
    command starts inside its own process (the trainer's, beside a model of several GB) has no such bound: that
    memory is not the collector's, and every query of the run was refused when it had one."""
    db = tmp_path / "t.duckdb"
    assert CollectorConfig(db=db, memory_limit="1GB").query_limits().max_resident_bytes is None
    assert private_config(db, memory_limit="1GB").query_limits().max_resident_bytes is None
    auto = CollectorConfig(db=db, memory_limit="1GB", max_query_memory="auto").query_limits()
    assert auto.max_resident_bytes == parse_size("1GB") + 10**9
    assert build_parser().parse_args(["collect"]).max_query_memory == "auto"
