"""Faults and load on real collector processes: SIGKILL after 200, a second collector, 16 concurrent
SDK exporters, push-back that the real OTLP exporter retries through."""
from __future__ import annotations

import threading

import psutil
import pytest

from conftest import health, post
from lightning_otel.span_store import client, discovery
from tests.helpers.sdk import chat_span, tracer_provider
from test_collector_http import sample_request


@pytest.mark.heavy
def test_acknowledged_spans_survive_sigkill(collector_process, db_path):
    proc = collector_process()
    acked = 0
    for seed in range(5):
        status, _, _ = post(proc.url + "/v1/traces", sample_request(50, seed=100 + seed).SerializeToString())
        assert status == 200
        acked += 50
    workers = psutil.Process(proc.proc.pid).children(recursive=True)
    assert workers, "the collector decodes in worker processes by default"
    proc.kill()  # no chance to checkpoint or clean up
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, "decoder workers must not outlive a killed collector"
    assert discovery.info_path(db_path).exists()  # left behind by the kill ...
    assert client.query("SELECT count(*) AS n FROM spans", db_path)["n"][0] == acked
    assert not discovery.info_path(db_path).exists()  # ... and cleaned as stale by the next command
    again = collector_process()  # the file opens again read-write, with the rows
    assert post(again.url + "/v1/traces", sample_request(1, seed=999).SerializeToString())[0] == 200
    assert again.stop() == 0
    assert client.query("SELECT count(*) AS n FROM spans", db_path)["n"][0] == acked + 1
    assert not discovery.info_path(db_path).exists()


@pytest.mark.heavy
def test_second_collector_fails_naming_the_holder(collector_process, db_path):
    first = collector_process()
    with pytest.raises(RuntimeError, match=f"pid {first.proc.pid}"):
        collector_process()
    # Even without the discovery file, DuckDB's own lock names the holding process.
    discovery.info_path(db_path).unlink()
    with pytest.raises(RuntimeError, match=f"process {first.proc.pid}"):
        collector_process()


@pytest.mark.heavy
def test_sixteen_concurrent_sdk_exporters_lose_nothing(make_collector, db_path):
    collector = make_collector()
    n_exporters, spans_each = 16, 600
    errors: list[BaseException] = []

    def exporter(index: int) -> None:
        try:
            provider = tracer_provider(collector.url, {"service.name": f"agent-{index}"}, max_batch=128,
                                       schedule_delay_millis=50, max_queue_size=spans_each + 1)
            tracer = provider.get_tracer("load")
            for i in range(spans_each):
                chat_span(tracer, rollout_id=f"ro-{index}-{i // 10}", tokens=i)
            provider.shutdown()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=exporter, args=(i,)) for i in range(n_exporters)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    rows = client.query("SELECT service_name, count(*) AS n FROM spans GROUP BY 1", db_path)
    assert rows.height == n_exporters
    assert set(rows["n"].to_list()) == {spans_each}


@pytest.mark.heavy
def test_pushed_back_spans_arrive_on_retry(make_collector, db_path):
    """A tiny queue makes the collector answer 503 + Retry-After; the real exporter retries until stored."""
    collector = make_collector(max_pending_rows=1, max_inflight_requests=2, retry_after_s=1)
    n_exporters, spans_each = 8, 200
    done = threading.Barrier(n_exporters + 1)

    def exporter(index: int) -> None:
        provider = tracer_provider(collector.url, {"service.name": f"agent-{index}"}, max_batch=20,
                                   schedule_delay_millis=10, max_queue_size=spans_each + 1)
        tracer = provider.get_tracer("load")
        for i in range(spans_each):
            chat_span(tracer, rollout_id=f"ro-{index}", tokens=i)
        provider.shutdown()
        done.wait()

    threads = [threading.Thread(target=exporter, args=(i,)) for i in range(n_exporters)]
    for t in threads:
        t.start()
    done.wait()
    assert health(collector.url)["busy_answers"] > 0, "the test must actually provoke push-back"
    assert client.query("SELECT count(*) AS n FROM spans", db_path)["n"][0] == n_exporters * spans_each


@pytest.mark.heavy
def test_memory_stays_bounded_under_sustained_load(collector_process, db_path):
    """RSS after 60k spans stays close to RSS after 20k: nothing grows with the stream but DuckDB's index."""
    proc = collector_process("--memory-limit", "512MB")
    process = psutil.Process(proc.proc.pid)
    bodies = [sample_request(500, seed=1000 + i) for i in range(120)]

    def send(batch):
        for request in batch:
            assert post(proc.url + "/v1/traces", request.SerializeToString())[0] == 200

    send(bodies[:40])
    after_first = process.memory_info().rss
    send(bodies[40:])
    after_all = process.memory_info().rss
    assert client.query("SELECT count(*) AS n FROM spans", db_path)["n"][0] == 60_000
    assert after_all < after_first + 150 * 2**20, (after_first, after_all)
