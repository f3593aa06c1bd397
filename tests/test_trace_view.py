"""Tool calls read from a rollout's spans (lightning_otel.rollouts.trace_view): hand-built spans in each
instrumentation's convention, then the payloads recorded from the real instrumentations (tests/recorder/)."""
from __future__ import annotations

import json

import pytest

from conftest import FIXTURES
from lightning_otel.rollouts.trace_view import ToolCall, span_attributes, tool_calls

QUERY = "SELECT count(*) FROM singer"


def span(name: str, start_ns: int, attributes: dict, as_text: bool = True, **columns) -> dict:
    """A span as the store gives it to reward functions (attributes as JSON text, unless as_text is False)."""
    return {"name": name, "span_id": f"s{start_ns}", "start_ns": start_ns, "status_code": "UNSET",
            "attributes": json.dumps(attributes) if as_text else attributes, **columns}


def llm(start_ns: int, output: list[dict] | None = None, inputs: list[dict] | None = None, name="openai.chat"):
    attributes = {"gen_ai.operation.name": "chat"}
    if output is not None:
        attributes["gen_ai.output.messages"] = json.dumps([{"role": "assistant", "parts": output}])
    if inputs is not None:
        attributes["gen_ai.input.messages"] = json.dumps(inputs)
    return span(name, start_ns, attributes, operation_name="chat")


def asked(call_id: str | None, name: str, arguments) -> dict:
    part = {"type": "tool_call", "name": name, "arguments": arguments}
    return {**part, "id": call_id} if call_id else part


def answered(call_id: str, response: str) -> dict:
    return {"role": "tool", "parts": [{"type": "tool_call_response", "id": call_id, "response": response}]}


def test_genai_tool_spans_agents_sdk_and_agent_framework():
    spans = [
        span("execute_tool run_sql", 5, {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "run_sql",
                                         "gen_ai.tool.call.id": "c2", "gen_ai.tool.call.result": "[[2]]",
                                         "gen_ai.tool.call.arguments": '{"sql": "SELECT 2"}'},
             operation_name="execute_tool"),
        # The Agents SDK (Traceloop): `<tool>.tool`, no call id; attributes already parsed
        span("run_sql.tool", 3, {"traceloop.span.kind": "tool", "gen_ai.tool.name": "run_sql",
                                 "gen_ai.tool.call.arguments": json.dumps({"sql": QUERY}),
                                 "gen_ai.tool.call.result": "[[6]]"}, as_text=False),
    ]
    assert tool_calls(spans) == [
        ToolCall("run_sql", {"sql": QUERY}, "[[6]]", None, 3, span_id="s3"),
        ToolCall("run_sql", {"sql": "SELECT 2"}, "[[2]]", "c2", 5, span_id="s5"),
    ]
    assert tool_calls({"spans": spans}) == tool_calls(spans)  # the reward's rollout dict, or its spans
    assert tool_calls({"final_output": "x"}) == tool_calls([]) == []


def test_langchain_tool_spans_carry_the_callback_payload():
    payload = {"input_str": str({"query": QUERY}), "tags": [], "metadata": {"langgraph_node": "run_query"},
               "inputs": {"query": QUERY}, "kwargs": {"color": "green", "tool_call_id": "call_1"}}
    message = {"lc": 1, "type": "constructor", "id": ["langchain", "schema", "messages", "ToolMessage"],
               "kwargs": {"content": "[(6,)]", "type": "tool", "name": "sql_db_query", "tool_call_id": "call_1"}}
    current = span("execute_tool sql_db_query", 10, {
        "traceloop.span.kind": "tool", "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "sql_db_query",
        "traceloop.entity.input": json.dumps(payload), "gen_ai.tool.call.arguments": json.dumps(payload),
        "gen_ai.tool.call.result": json.dumps({"output": message, "kwargs": {"name": "sql_db_query"}})})
    # Older versions: `<tool>.tool`, traceloop.entity.* only; a tool invoked with a string has no inputs, and
    # one called outside a ToolNode returns plain text.
    older = span("sql_db_list_tables.tool", 20, {
        "traceloop.span.kind": "tool", "traceloop.entity.name": "sql_db_list_tables",
        "traceloop.entity.input": json.dumps({"input_str": "", "inputs": None, "kwargs": {}}),
        "traceloop.entity.output": json.dumps({"output": "singer, song", "kwargs": {}})})
    literal = span("sql_db_schema.tool", 30, {
        "traceloop.span.kind": "tool",
        "traceloop.entity.input": json.dumps({"input_str": "{'table_names': 'singer'}", "inputs": None})})
    calls = tool_calls([literal, older, current])
    assert [(c.name, c.arguments, c.result, c.call_id) for c in calls] == [
        ("sql_db_query", {"query": QUERY}, "[(6,)]", "call_1"),
        ("sql_db_list_tables", "", "singer, song", None),
        ("sql_db_schema", {"table_names": "singer"}, None, None),  # the name from the span name
    ]


def test_autogen_tool_spans_get_arguments_and_result_from_the_messages():
    spans = [
        llm(1, output=[asked("c1", "execute_sql", {"query": QUERY})]),
        span("execute_tool execute_sql", 2, {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "execute_sql",
                                             "gen_ai.tool.call.id": "c1"}),
        llm(3, inputs=[{"role": "user", "parts": [{"type": "text", "content": "q"}]}, answered("c1", "[[6]]")],
            output=[{"type": "text", "content": "There are 6."}]),
    ]
    (call,) = tool_calls(spans)
    assert (call.name, call.arguments, call.result, call.source, call.span_id) == \
        ("execute_sql", {"query": QUERY}, "[[6]]", "tool_span", "s2")


def test_without_tool_spans_the_calls_are_the_models_requests():
    spans = [
        # the plain SDK loop: the second call's prompt carries the first call's result back
        llm(1, output=[asked("c1", "execute_sql", '{"query": "SELECT 1"}')]),
        llm(1, output=[asked("c1", "execute_sql", {"query": "SELECT 1"})], name="chat gpt-4o"),  # a wrapping span
        llm(5, inputs=[answered("c1", "[[1]]")], output=[asked("c2", "execute_sql", "SELECT 2"),
                                                          asked(None, "note", {"text": "done"})]),
        span("lightning.generate", 6, {"gen_ai.output.messages": json.dumps([{"parts": [asked("c9", "x", {})]}])}),
    ]
    calls = tool_calls(spans)
    assert [(c.name, c.arguments, c.result, c.call_id, c.source) for c in calls] == [
        ("execute_sql", {"query": "SELECT 1"}, "[[1]]", "c1", "request"),
        ("execute_sql", "SELECT 2", None, "c2", "request"),  # arguments that are not an object stay text
        ("note", {"text": "done"}, None, None, "request"),
    ]
    assert calls[1].strings() == ["SELECT 2"] and calls[2].strings() == ["done"]


def test_failed_tool_spans_and_odd_attributes():
    failed = span("execute_tool run_sql", 1, {"gen_ai.tool.call.arguments": "not json"}, status_code="ERROR",
                  operation_name="execute_tool")
    (call,) = tool_calls([failed, {"name": "openai.chat", "attributes": "{broken"}])
    assert call.failed and call.arguments == "not json" and call.name == "run_sql"
    assert span_attributes({"attributes": None}) == {} and span_attributes({"attributes": "[1]"}) == {}


SCENARIOS = ["openai_plain", "openai_stream", "langgraph", "autogen", "crewai", "openai_agents", "agent_framework"]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """The recorded OTLP payloads of every framework, stored by the collector's own ingest."""
    from lightning_otel.span_store import client

    db = tmp_path_factory.mktemp("recorded") / "traces.duckdb"
    report = client.ingest_files([FIXTURES / "otlp" / f"{s}.jsonl" for s in SCENARIOS], db)
    assert not report.errors
    return {s: client.query(f"SELECT * FROM spans WHERE rollout_id = 'ro-{s}-1' ORDER BY start_ns", db).to_dicts()
            for s in SCENARIOS}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_recorded_frameworks_give_the_same_tool_call(recorded, scenario):
    """Each recorded agent ran execute_sql once with COUNT(*) over a 3-row table and answered in prose."""
    (call,) = tool_calls(recorded[scenario])
    assert (call.name, call.arguments, call.result) == ("execute_sql", {"query": "SELECT COUNT(*) FROM singer"},
                                                        "[[3]]")
    expected = "request" if scenario in ("openai_plain", "openai_stream", "crewai") else "tool_span"
    assert call.source == expected and not call.failed


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_spider_scores_the_sql_the_recorded_agents_ran(recorded, scenario):
    from lightning_otel.tasks.spider.rewards import final_sql, spider_exec, spider_shaped

    task = {"id": "t", "db_id": "singer", "query": "SELECT count(*) FROM singer"}
    rollout = {"final_output": "There are 3 singers.", "spans": recorded[scenario]}
    assert final_sql(rollout) == "SELECT COUNT(*) FROM singer"
    assert spider_exec(task, rollout) == 1.0 and spider_shaped(task, rollout) == 1.0
