"""The trace store tour: real traces recorded from LangGraph, CrewAI, AutoGen and the OpenAI SDK
(tests/recorder/), sent over OTLP/HTTP to a collector on a fresh DuckDB file, then queried."""
from __future__ import annotations

import gzip
import urllib.request
from importlib import resources
from pathlib import Path
from typing import Iterator

import orjson

from lightning_otel.span_store.collector import Collector, CollectorConfig

QUERIES = [
    ("Spans per framework", "SELECT service_name, count(*) AS spans, count(DISTINCT trace_id) AS traces "
                            "FROM spans GROUP BY ALL ORDER BY service_name"),
    ("LLM calls, the agent that made each one, in order",
     "SELECT service_name, turn, name, agent, input_tokens, output_tokens FROM llm_calls "
     "ORDER BY service_name, turn"),
    ("Tool calls", "SELECT service_name, tool_name, agent, arguments, result FROM tool_calls ORDER BY service_name"),
    ("Rollouts (every trace of a rollout grouped by lightning.rollout.id)",
     "SELECT rollout_id, task_id, traces, llm_calls, tool_calls, input_tokens + output_tokens AS tokens "
     "FROM rollouts ORDER BY rollout_id"),
]


def sample_requests() -> Iterator[tuple[str, bytes]]:
    """(signal path, OTLP/JSON body) of every bundled request."""
    data = (resources.files("lightning_otel.span_store") / "sample_traces.jsonl.gz").read_bytes()
    for line in gzip.decompress(data).splitlines():
        if line.strip():
            path = "/v1/logs" if "resourceLogs" in orjson.loads(line) else "/v1/traces"
            yield path, line


def load_samples(folder: Path) -> Collector:
    """Start a collector on folder/traces.duckdb and send it the bundled traces over HTTP."""
    folder.mkdir(parents=True, exist_ok=True)
    db = folder / "traces.duckdb"
    for leftover in (db, db.with_name(db.name + ".wal")):
        leftover.unlink(missing_ok=True)
    collector = Collector(CollectorConfig(db=db, port=0, decode_workers=0))
    collector.start()
    for path, body in sample_requests():
        request = urllib.request.Request(collector.url + path, data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()
    return collector
