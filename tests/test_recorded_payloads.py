"""Payloads recorded from the real instrumentations (tests/recorder/), replayed into a real collector:
both encodings store the same rows, and the views find the LLM calls, agents, tools and rollouts."""
from __future__ import annotations

import json

import pytest

from conftest import FIXTURES, post
from lightning_otel.span_store import client

OTLP = FIXTURES / "otlp"
SCENARIOS = ["openai_plain", "openai_stream", "langgraph", "autogen", "crewai", "genai_logs", "openai_agents",
             "agent_framework"]
# The framework's own LLM span (openai.response, chat <model>) wraps the openai SDK's for the same request.
WRAPPED = {"openai_agents", "agent_framework"}


def replay_protobuf(url: str, scenario: str) -> None:
    for body in sorted((OTLP / scenario).glob("*.pb")):
        path = "/v1/logs" if body.name.startswith("logs-") else "/v1/traces"
        status, _, _ = post(url + path, body.read_bytes())
        assert status == 200, body


@pytest.fixture
def loaded(collector, db_path):
    for scenario in SCENARIOS:
        replay_protobuf(collector.url, scenario)
    return db_path


def test_json_lines_and_protobuf_bodies_store_the_same_rows(loaded, tmp_path):
    other = tmp_path / "from-json.duckdb"
    report = client.ingest_files([OTLP / f"{s}.jsonl" for s in SCENARIOS], other)
    assert not report.errors
    columns = "trace_id, span_id, parent_span_id, name, kind, start_ns, end_ns, status_code, attributes, " \
              "resource, events, rollout_id, task_id, attempt, operation_name, input_tokens, output_tokens"
    sql = f"SELECT {columns} FROM spans ORDER BY trace_id, span_id"
    assert client.query(sql, loaded).to_dicts() == client.query(sql, other).to_dicts()
    logs = "SELECT log_id, body, attributes, span_id FROM logs ORDER BY log_id"
    assert client.query(logs, loaded).to_dicts() == client.query(logs, other).to_dicts()


def test_every_llm_call_is_found_with_its_agent(loaded):
    calls = client.query("SELECT service_name, name, agent, turn, input_tokens, output_tokens, streaming, "
                         "input_messages, output_messages FROM llm_calls ORDER BY service_name, turn", loaded)
    by_service = {}
    for row in calls.to_dicts():
        by_service.setdefault(row["service_name"], []).append(row)
    assert sorted(by_service) == sorted(SCENARIOS)
    for scenario, rows in by_service.items():
        if scenario in WRAPPED:
            assert [r["turn"] for r in rows] == [0, 1, 2, 3], scenario
            rows = [r for r in rows if r["name"] == "openai.chat"]
        assert len(rows) == 2, scenario
        assert all(r["input_tokens"] > 0 and r["output_tokens"] > 0 for r in rows), scenario
        assert all(json.loads(r["input_messages"]) and json.loads(r["output_messages"]) for r in rows), scenario
    assert [r["agent"] for r in by_service["langgraph"]] == ["write_query", "answer"]
    assert [r["agent"] for r in by_service["crewai"]] == ["SQL Analyst"] * 2
    assert [r["agent"] for r in by_service["autogen"]] == ["sql_agent"] * 2
    assert [r["agent"] for r in by_service["openai_plain"]] == [None, None]
    assert {r["agent"] for s in WRAPPED for r in by_service[s]} == {"sql_agent"}
    assert [r["streaming"] for r in by_service["openai_stream"]] == [True, True]
    assert by_service["langgraph"][0]["name"] == "ChatOpenAI.chat"
    # Content captured only in log records (official openai-v2, event_only) still shows up.
    answer = json.loads(by_service["genai_logs"][1]["output_messages"])
    assert answer[0]["parts"][0]["content"] == "There are 3 singers."


def test_llm_call_spans_are_the_ones_the_model_server_saw(loaded):
    for scenario in SCENARIOS:
        seen = json.loads((OTLP / f"{scenario}.traceparents.json").read_text())
        # Each request once, in order (trajectory_calls keeps the innermost of spans that wrap one request).
        calls = client.query(f"SELECT trace_id, span_id FROM trajectory_calls WHERE rollout_id = 'ro-{scenario}-1' "
                             "ORDER BY turn", loaded).to_dicts()
        assert len(calls) == len(seen) == 2, scenario
        for header, call in zip(seen, calls):
            if header is None:
                continue  # openai-v2 sends no traceparent
            _, trace_id, span_id, _ = header.split("-")
            assert (call["trace_id"], call["span_id"]) == (trace_id, span_id), scenario


def test_tool_calls(loaded):
    tools = {r["service_name"]: r for r in client.query("SELECT * FROM tool_calls", loaded).to_dicts()}
    assert sorted(tools) == ["agent_framework", "autogen", "langgraph", "openai_agents"]
    for scenario in WRAPPED:
        row = tools[scenario]
        assert (row["tool_name"], row["agent"], row["result"]) == ("execute_sql", "sql_agent", "[[3]]"), scenario
        assert json.loads(row["arguments"]) == {"query": "SELECT COUNT(*) FROM singer"}, scenario
    lg = tools["langgraph"]
    assert lg["tool_name"] == "execute_sql" and lg["agent"] == "execute_query"
    assert json.loads(lg["arguments"]) == {"query": "SELECT COUNT(*) FROM singer"}
    assert lg["result"] == "[[3]]" and lg["call_id"].startswith("call_")
    ag = tools["autogen"]
    assert ag["tool_name"] == "execute_sql" and ag["agent"] == "sql_agent" and ag["arguments"] is None
    first_output = client.query("SELECT output_messages FROM llm_calls WHERE service_name = 'autogen' AND turn = 0",
                                loaded)["output_messages"][0]
    parts = json.loads(first_output)[0]["parts"]
    assert ag["call_id"] in [p.get("id") for p in parts]


def test_framework_spans_around_sdk_calls_give_one_call_per_request(loaded):
    """The Agents SDK's openai.response and Agent Framework's `chat <model>` each wrap the openai SDK's
    openai.chat span of the same request: the trajectory has each request once, under the agent."""
    for scenario in WRAPPED:
        rows = client.query(f"SELECT turn, agent, agent_path, duplicates, span_id FROM trajectory_calls "
                            f"WHERE rollout_id = 'ro-{scenario}-1' ORDER BY turn", loaded).to_dicts()
        inner = client.query(f"SELECT span_id FROM llm_calls WHERE service_name = '{scenario}' "
                             "AND name = 'openai.chat' ORDER BY turn", loaded)["span_id"].to_list()
        assert [r["span_id"] for r in rows] == inner, scenario
        assert [(r["turn"], r["agent"], r["agent_path"], r["duplicates"]) for r in rows] == \
            [(0, "sql_agent", "sql_agent", 1), (1, "sql_agent", "sql_agent", 1)], scenario


def test_rollouts_view_groups_every_trace_of_a_rollout(loaded):
    rows = {r["rollout_id"]: r for r in client.query("SELECT * FROM rollouts", loaded).to_dicts()}
    assert sorted(rows) == sorted(f"ro-{s}-1" for s in SCENARIOS)
    autogen = rows["ro-autogen-1"]
    assert (autogen["traces"], autogen["llm_calls"], autogen["tool_calls"]) == (2, 2, 1)
    assert (autogen["task_id"], autogen["attempt"]) == ("task-7", 0)
    assert rows["ro-openai_plain-1"]["traces"] == 2  # plain SDK calls are separate traces
    assert rows["ro-langgraph-1"]["spans"] == 8
    assert all(r["status"] is None and r["rewards"] is None for r in rows.values())
