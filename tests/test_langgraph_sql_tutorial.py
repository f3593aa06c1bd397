"""LangGraph's SQL-agent tutorial (examples/langgraph_sql_tutorial), unchanged, through the rollout runner: it
ends in prose, so the Spider reward scores the SQL it ran through its `sql_db_query` tool, read from the
LangChain instrumentation's tool spans.

First against a scripted OpenAI-compatible stub (no engine: the runner, worker, instrumentation, store and
reward are real), then against the gateway over the real engine (bundled SmolLM2-135M), where the model is weak
and the assertions hold whatever it answers: its forced calls (tool_choice "any") name an offered tool, no
rollout fails on a call's arguments, and every rollout whose tools ran SQL is scored on that SQL.
"""
from __future__ import annotations

import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from lightning_otel.rollouts.runner import RolloutConfig, run_rollouts
from lightning_otel.span_store import client
from lightning_otel.tasks.spider.rewards import (SHAPED, bundled_data_dir, database_path, extract_sql, run_query,
                                                 spider_shaped)
from test_inprocess import singer_tasks, write_tasks

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "langgraph_sql_tutorial" / "agent.py"
FORCED_NODES = {"call_get_schema": {"sql_db_schema"}, "check_query": {"sql_db_query"}}  # node -> tools offered
COUNT = "SELECT count(*) FROM singer"


def scripted_answer(body: dict) -> dict:
    """The tutorial's path for a count question: schema of singer, one query, its check, then prose."""
    offered = {t["function"]["name"] for t in body.get("tools") or []}
    messages = body["messages"]
    if "sql_db_schema" in offered:
        return {"name": "sql_db_schema", "arguments": {"table_names": "singer"}}
    if body.get("tool_choice") == "required":  # check_query: the query under review is the user message
        return {"name": "sql_db_query", "arguments": {"query": messages[-1]["content"]}}
    called = [c["function"]["name"] for c in messages[-2].get("tool_calls") or []] if len(messages) > 1 else []
    if messages[-1]["role"] == "tool" and called == ["sql_db_query"]:
        return {"content": f"There are {messages[-1]['content'].strip('[(,)]')} singers."}
    return {"name": "sql_db_query", "arguments": {"query": COUNT}}


class StubModel(ThreadingHTTPServer):
    """An OpenAI-compatible /v1/chat/completions on 127.0.0.1 answering scripted_answer; keeps the requests."""

    def __init__(self):
        self.requests: list[dict] = []
        self.headers: list[dict] = []  # each request's headers, lower-case names
        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - the http.server interface
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(body)
        self.server.headers.append({k.lower(): v for k, v in self.headers.items()})
        answer = scripted_answer(body)
        message = {"role": "assistant", "content": answer.get("content")}
        if "name" in answer:
            message["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function", "function": {
                "name": answer["name"], "arguments": json.dumps(answer["arguments"])}}]
        reply = json.dumps({"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": 0,
                            "model": body.get("model"), "choices": [{
                                "index": 0, "message": message,
                                "finish_reason": "tool_calls" if "name" in answer else "stop"}],
                            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


def tool_rows(db: Path, rollout_id: str) -> list[dict]:
    """The rollout's tool calls as the store's tool_calls view reads them (SQL, apart from trace_view)."""
    return client.query(f"SELECT tool_name, arguments, result FROM tool_calls WHERE rollout_id = "
                        f"'{rollout_id}' ORDER BY start_ns", db).to_dicts()


def ran_sql(rows: list[dict]) -> str | None:
    """The last query sql_db_query ran, from the tool_calls view."""
    queries = [json.loads(r["arguments"] or "{}").get("query") for r in rows if r["tool_name"] == "sql_db_query"]
    queries = [q for q in queries if isinstance(q, str) and q.strip()]
    return queries[-1] if queries else None


@pytest.mark.heavy
def test_the_tutorial_agent_is_scored_on_the_sql_its_tool_ran(tmp_path):
    stub = StubModel()
    try:
        tasks = write_tasks(tmp_path / "tasks.jsonl", singer_tasks(1))
        db = tmp_path / "traces.duckdb"
        summary = run_rollouts(RolloutConfig(tasks=tasks, agent=f"{EXAMPLE}:run", n=1, concurrency=1, db=db,
                                             base_url=stub.base_url, reward="spider_shaped", rollout_timeout_s=120))
    finally:
        stub.shutdown()
    (result,) = summary.results
    assert result.status == "ok", result
    (count,) = run_query(database_path(bundled_data_dir(), "singer"), COUNT, 10)[0]
    assert result.final_output == f"There are {count} singers." and result.reward == 1.0  # prose, scored 1
    rows = tool_rows(db, result.rollout_id)
    assert [r["tool_name"] for r in rows] == ["sql_db_list_tables", "sql_db_schema", "sql_db_query"], rows
    assert ran_sql(rows) == COUNT and rows[-1]["result"] == f"[({count},)]"
    # the forced calls asked for "required" (LangChain's "any") with the one tool of their node
    forced = [r for r in stub.requests if r.get("tool_choice") == "required"]
    assert [{t["function"]["name"] for t in r["tools"]} for r in forced] == [{"sql_db_schema"}, {"sql_db_query"}]


def forced_calls(db: Path, rollout_id: str) -> list[dict]:
    """The model calls of the forced nodes, with the tools they offered and the calls they answered."""
    rows = client.query(f"SELECT agent, tool_definitions, output_messages FROM llm_calls WHERE rollout_id = "
                        f"'{rollout_id}' ORDER BY turn", db).to_dicts()
    calls = []
    for row in rows:
        if row["agent"] not in FORCED_NODES:
            continue
        offered = {t.get("name") or (t.get("function") or {}).get("name")
                   for t in json.loads(row["tool_definitions"] or "[]")} or FORCED_NODES[row["agent"]]
        named = [p.get("name") for m in json.loads(row["output_messages"] or "[]") for p in m.get("parts") or []
                 if p.get("type") == "tool_call"]
        calls.append({"node": row["agent"], "offered": offered, "named": named})
    return calls


@pytest.mark.heavy
def test_the_tutorial_agent_on_the_engine(engine, tmp_path):
    engine.use_base()
    tasks = write_tasks(tmp_path / "tasks.jsonl", singer_tasks(2))
    db = tmp_path / "traces.duckdb"
    summary = run_rollouts(RolloutConfig(tasks=tasks, agent=f"{EXAMPLE}:run", n=2, concurrency=4, db=db,
                                         reward="spider_shaped", temperature=0.7, max_tokens=64,
                                         rollout_timeout_s=300), engine=engine)
    problems, seen = {}, []
    for result in summary.results:
        rows, forced = tool_rows(db, result.rollout_id), forced_calls(db, result.rollout_id)
        seen.append({"status": result.status, "tools": [r["tool_name"] for r in rows], "sql": ran_sql(rows),
                     "reward": result.reward, "final_output": result.final_output})
        stray = [c for c in forced if not set(c["named"]) <= c["offered"]]
        if stray:
            problems.setdefault("forced call names a tool not offered", []).append(stray)
        if result.status != "ok":
            problems.setdefault("rollout failed", []).append((result.error_class, result.stderr_tail[-600:]))
        sql = ran_sql(rows)
        task = {"id": result.task_id, "db_id": "singer", "query": COUNT}
        if sql is not None:
            expected = spider_shaped(task, {"final_output": sql, "data_dir": str(bundled_data_dir())})
            holds_sql = extract_sql(result.final_output or "") or ""
            if result.reward is None or (not holds_sql.upper().startswith(("SELECT", "WITH"))
                                         and result.reward != expected):
                problems.setdefault("reward not on the SQL the tools ran", []).append((sql, result.reward, expected))
        assert result.reward is None or result.reward in set(SHAPED.values()) | {1.0}
    assert not problems, json.dumps({"problems": problems, "rollouts": seen}, indent=1, default=str)
