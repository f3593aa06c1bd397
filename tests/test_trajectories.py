"""Trajectories in the store (view trajectory_calls, migration 0006): agent paths of the real framework
shapes, and one call per request when several LLM spans recorded it. Real OTel SDK spans and recorded
real payloads, through a real collector into a DuckDB file."""
from __future__ import annotations

import polars as pl
import pytest
from opentelemetry import context as otel_context
from opentelemetry.trace import SpanKind

from lightning_otel.span_store import client
from lightning_otel.train.transitions.compile import CompileConfig, compile_transitions
from tests.helpers.sdk import tracer_provider
from test_recorded_payloads import SCENARIOS, replay_protobuf

CALLS = "SELECT t.rollout_id, t.turn, s.name, t.agent, t.agent_path, t.duplicates, " \
        "t.record_span_id IS NOT NULL AS has_record, t.completion_ids " \
        "FROM trajectory_calls t JOIN spans s USING (trace_id, span_id) ORDER BY t.rollout_id, t.turn"


def test_agent_paths_of_the_recorded_frameworks(collector, db_path):
    for scenario in SCENARIOS:
        replay_protobuf(collector.url, scenario)
    rows = client.query(CALLS, db_path).to_dicts()
    paths = {}
    for row in rows:
        paths.setdefault(row["rollout_id"], []).append((row["turn"], row["agent"], row["agent_path"]))
    assert paths == {
        "ro-openai_plain-1": [(0, None, None), (1, None, None)],
        "ro-openai_stream-1": [(0, None, None), (1, None, None)],
        "ro-genai_logs-1": [(0, None, None), (1, None, None)],
        # invoke_agent LangGraph > LangGraph.workflow (both name the graph: counted once) > execute_task <node>
        "ro-langgraph-1": [(0, "write_query", "LangGraph/write_query"), (1, "answer", "LangGraph/answer")],
        # AutoGen: each turn its own trace under invoke_agent <agent>
        "ro-autogen-1": [(0, "sql_agent", "sql_agent"), (1, "sql_agent", "sql_agent")],
        # CrewAI: crewai.workflow > <task description>.task > <role>.agent > openai.chat
        "ro-crewai-1": [(0, "SQL Analyst", "crewai.workflow/How many singers are there?/SQL Analyst")] +
                       [(1, "SQL Analyst", "crewai.workflow/How many singers are there?/SQL Analyst")],
        # OpenAI Agents SDK: Agent Workflow > sql_agent.agent > openai.response > openai.chat
        "ro-openai_agents-1": [(0, "sql_agent", "sql_agent"), (1, "sql_agent", "sql_agent")],
        # Agent Framework: invoke_agent sql_agent > chat <model> > openai.chat
        "ro-agent_framework-1": [(0, "sql_agent", "sql_agent"), (1, "sql_agent", "sql_agent")],
    }
    # The two frameworks that wrap each openai SDK call in a span of their own record each request twice.
    duplicated = {"ro-openai_agents-1", "ro-agent_framework-1"}
    assert {row["duplicates"] for row in rows if row["rollout_id"] in duplicated} == {1}
    assert {row["duplicates"] for row in rows if row["rollout_id"] not in duplicated} == {0}
    assert {row["name"] for row in rows if row["rollout_id"] in duplicated} == {"openai.chat"}  # the innermost


def record(tracer, rollout_id: str, response_id: str, first_token: int, context=None) -> None:
    """A gateway token record (lightning.generate), under the current span or, with context=root, alone."""
    with tracer.start_as_current_span("lightning.generate", context=context, kind=SpanKind.SERVER, attributes={
            "lightning.rollout.id": rollout_id, "lightning.choice.index": 0, "lightning.policy.version": 0,
            "gen_ai.response.id": response_id, "lightning.prompt.token_ids": [1, 2, first_token],
            "lightning.completion.token_ids": [first_token, 2], "lightning.completion.logprobs": [-0.5, -0.1]}):
        pass


def llm_span(tracer, name: str, rollout_id: str, response_id: str, context=None):
    return tracer.start_as_current_span(name, context=context, kind=SpanKind.CLIENT, attributes={
        "lightning.rollout.id": rollout_id, "gen_ai.operation.name": "chat", "gen_ai.response.id": response_id})


@pytest.fixture
def duplicated(collector, db_path):
    """Requests recorded by two LLM spans, in the shapes two instrumentations produce."""
    provider = tracer_provider(collector.url)
    tracer = provider.get_tracer("agent")
    root = otel_context.Context()  # a new trace, as a process without the caller's context starts one
    # LangChain with openai suppression off: ChatOpenAI.chat > openai.chat > the record (traceparent of openai.chat).
    with tracer.start_as_current_span("invoke_agent LangGraph", attributes={
            "lightning.rollout.id": "nested", "gen_ai.operation.name": "invoke_agent",
            "gen_ai.agent.name": "LangGraph"}):
        with tracer.start_as_current_span("execute_task write_query", attributes={
                "lightning.rollout.id": "nested", "gen_ai.operation.name": "execute_task",
                "traceloop.span.kind": "task", "gen_ai.task.name": "write_query"}):
            with llm_span(tracer, "ChatOpenAI.chat", "nested", "R1"):
                with llm_span(tracer, "openai.chat", "nested", "R1"):
                    record(tracer, "nested", "R1", 11)
        with llm_span(tracer, "openai.chat", "nested", "R2"):
            record(tracer, "nested", "R2", 12)
    # Official openai-v2 (`chat <model>`, no traceparent) around Traceloop's openai.chat: the record names
    # the inner span.
    with llm_span(tracer, "chat gpt-4o", "two-sdks", "R3"):
        with llm_span(tracer, "openai.chat", "two-sdks", "R3"):
            record(tracer, "two-sdks", "R3", 13)
    # No traceparent at all: the record is a trace of its own, found through the response id, and two LLM
    # spans in different traces carry that id.
    with llm_span(tracer, "chat gpt-4o", "no-traceparent", "R4", context=root):
        pass
    with llm_span(tracer, "openai.chat", "no-traceparent", "R4", context=root):
        pass
    record(tracer, "no-traceparent", "R4", 14, context=root)
    # The gateway was not used: no records; nested spans, and two spans with one response id.
    with llm_span(tracer, "ChatOpenAI.chat", "no-gateway", "R5"):
        with llm_span(tracer, "openai.chat", "no-gateway", "R5"):
            pass
    with llm_span(tracer, "chat gpt-4o", "no-gateway", "R6", context=root):
        pass
    with llm_span(tracer, "openai.chat", "no-gateway", "R6", context=root):
        pass
    # The SDK retried inside one span (a timeout, say): two records name it; the agent got the second answer.
    with llm_span(tracer, "openai.chat", "retried", "R7"):
        record(tracer, "retried", "R7-lost", 21)
        record(tracer, "retried", "R7", 22)
    provider.shutdown()
    return db_path


def test_one_call_per_request(duplicated):
    rows = client.query(CALLS, duplicated).to_dicts()
    got = {}
    for row in rows:
        got.setdefault(row["rollout_id"], []).append(
            (row["turn"], row["name"], row["duplicates"], row["has_record"], row["completion_ids"]))
    assert got == {
        "nested": [(0, "openai.chat", 1, True, [11, 2]), (1, "openai.chat", 0, True, [12, 2])],
        "two-sdks": [(0, "openai.chat", 1, True, [13, 2])],
        "no-traceparent": [(0, "chat gpt-4o", 1, True, [14, 2])],  # the earlier of the two spans
        "no-gateway": [(0, "openai.chat", 1, False, None), (1, "chat gpt-4o", 1, False, None)],
        "retried": [(0, "openai.chat", 0, True, [22, 2])],
    }
    nested = client.query("SELECT agent, agent_path FROM trajectory_calls WHERE rollout_id = 'nested' ORDER BY turn",
                          duplicated).rows()
    assert nested == [("write_query", "LangGraph/write_query"), ("LangGraph", "LangGraph")]


def test_compile_counts_removed_duplicates(duplicated):
    client.write_records(duplicated, "rollout_runs", [{"rollout_id": r, "task_id": "t", "attempt": i, "status": "ok"}
                                                      for i, r in enumerate(["nested", "two-sdks", "no-traceparent"])])
    client.write_records(duplicated, "rewards", [
        {"rollout_id": r, "name": "exec", "value": v, "source": "function"}
        for r, v in [("nested", 1.0), ("two-sdks", 0.0), ("no-traceparent", 1.0), ("no-gateway", 0.0)]])
    out, account = compile_transitions(CompileConfig(db=duplicated))
    assert account.duplicate_calls == 5
    assert account.llm_calls == 4  # nested (2), two-sdks, no-traceparent
    assert account.excluded["no task id (advantages compare rollouts of one task)"] == 2  # no-gateway, retried
    assert sorted(out.filter(pl.col("rollout_id") == "nested")["turn"].to_list()) == [0, 1]


def test_the_transitions_view_agrees_with_compile_on_recorded_rollouts(tmp_path):
    from test_retokenize import load_rollouts
    db = tmp_path / "recorded.duckdb"
    load_rollouts(db)
    view = client.query("SELECT * FROM transitions WHERE reward_name = 'sql_form' "
                        "ORDER BY task_id, rollout_id, turn", db).drop("reward_name")
    compiled, account = compile_transitions(CompileConfig(db=db, reward="sql_form"))
    compiled = compiled.sort(["task_id", "rollout_id", "turn"])
    assert view.height == compiled.height == 120 and account.compiled_rollouts == 48
    assert view.schema == compiled.schema
    assert view.drop("advantage").to_dicts() == compiled.drop("advantage").to_dicts()
    # DuckDB and Polars sum in different orders: equal up to rounding.
    assert view["advantage"].to_list() == pytest.approx(compiled["advantage"].to_list(), rel=1e-12)
    assert set(view["agent_path"].drop_nulls()) == {
        "LangGraph/write_query", "LangGraph/check_query", "LangGraph/rewrite_query", "sql_agent"} | {
        p for p in view["agent_path"].drop_nulls() if p.startswith("crewai.workflow/") and p.endswith("/SQL Analyst")}
    # spider_exec: the bundled model never matched, so every group is flat and nothing is trained.
    assert client.query("SELECT count(*) AS n FROM transitions WHERE reward_name = 'spider_exec'", db)["n"][0] == 0


def test_an_older_store_gets_the_extracted_columns_and_token_records(tmp_path):
    """A store written before migration 0006 (no extracted columns, no token_records) is brought up to
    date on open: the same names and records as spans stored afterwards."""
    import duckdb

    from lightning_otel.span_store import store
    path = tmp_path / "old.duckdb"
    with duckdb.connect(str(path)) as con:
        con.execute(store.SQL_CREATE_MIGRATIONS)
        for migration in store.load_migrations()[:5]:
            con.execute(migration.sql)
            con.execute("INSERT INTO schema_migrations (version, name) VALUES (?, ?)",
                        [migration.version, migration.name])
        con.execute("""
            INSERT INTO spans (trace_id, span_id, parent_span_id, name, operation_name, rollout_id, attributes)
            VALUES ('t', 'a', NULL, 'SQL Analyst.agent', 'invoke_agent', 'r',
                    '{"traceloop.span.kind": "agent", "gen_ai.agent.name": "SQL Analyst"}'),
                   ('t', 'c', 'a', 'openai.chat', 'chat', 'r', '{"gen_ai.response.id": "R1"}'),
                   ('t', 'g', 'c', 'lightning.generate', NULL, 'r',
                    '{"lightning.choice.index": 0, "lightning.prompt.token_ids": [1, 2], "lightning.policy.version": 3,
                      "lightning.completion.token_ids": [5], "lightning.completion.logprobs": [-0.5]}')""")
    client.query("SELECT 1", path)  # opening migrates
    assert client.query("SELECT span_id, agent_name, response_id FROM spans ORDER BY span_id", path).rows() == [
        ("a", "SQL Analyst", None), ("c", None, "R1"), ("g", None, None)]
    assert client.query("SELECT llm_span_id, policy_version, prompt_ids, completion_logprobs FROM generations",
                        path).rows() == [("c", 3, [1, 2], [-0.5])]
    assert client.query("SELECT agent_path, completion_ids FROM trajectory_calls", path).rows() == \
        [("SQL Analyst", [5])]


def test_prune_removes_the_token_records_of_pruned_traces(duplicated):
    assert client.query("SELECT count(*) AS n FROM token_records", duplicated)["n"][0] == 6
    client.prune(duplicated, 2**62)  # every trace ended before then
    assert client.query("SELECT count(*) AS n FROM token_records", duplicated)["n"][0] == 0


# Span shapes around every branch of agent_name_from, and the recorded real ones: (name, attributes).
AGENT_SHAPES = [
    ("invoke_agent planner", {"gen_ai.operation.name": "invoke_agent"}),
    ("invoke-agent x", {}),  # SQL LIKE 'invoke_agent %': '_' is any character
    ("execute_task", {"gen_ai.operation.name": "execute_task", "traceloop.entity.name": "node"}),
    ("create_agent helper", {"gen_ai.operation.name": "create_agent"}),
    ("Writer.agent", {"traceloop.span.kind": "agent"}),
    ("Q?.task", {"traceloop.span.kind": "task", "crewai.agent.role": "R"}),
    ("x.agent.task", {"traceloop.span.kind": "task"}),
    ("chat gpt-4o", {"gen_ai.operation.name": "chat", "gen_ai.agent.name": "A"}),  # an LLM call is no agent
    ("anything", {"gen_ai.agent.name": "B"}),
    ("wf", {"traceloop.span.kind": "workflow", "gen_ai.agent.name": ""}),
    ("execute_tool t", {"gen_ai.operation.name": "execute_tool", "gen_ai.agent.name": "C"}),
    ("plain", {"gen_ai.task.name": "T"}),
]


def test_the_decoders_name_agents_as_the_sql_rule_does(tmp_path):
    """Both decoders compute agent_name at ingest (no JSON parsed when storing); the SQL macro
    agent_name_of is the definition. Same answers on every branch and on the recorded frameworks."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from conftest import FIXTURES
    from lightning_otel.span_store import otlp, store
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    for name, attributes in AGENT_SHAPES:
        provider.get_tracer("t").start_span(name, attributes=attributes).end()
    bodies = [encode_spans(memory.get_finished_spans()).SerializeToString()]
    bodies += [p.read_bytes() for s in SCENARIOS for p in sorted((FIXTURES / "otlp" / s).glob("[0-9]*.pb"))]
    con = store.connect(tmp_path / "names.duckdb")
    named = set()
    for decode in (otlp.decode_traces_protobuf, otlp.decode_traces_protobuf_python):
        for body in bodies:
            con.register("batch", decode(body).table)
            rows = con.execute("SELECT name, agent_name, agent_name_of(name, attributes, operation_name) FROM batch"
                               ).fetchall()
            assert [(n, a) for n, a, _ in rows] == [(n, rule) for n, _, rule in rows], decode.__name__
            named |= {a for _, a, _ in rows if a}
    assert {"LangGraph", "write_query", "sql_agent", "SQL Analyst", "How many singers are there?"} <= named
    first = otlp.decode_traces_protobuf(bodies[0]).table.to_pydict()
    assert dict(zip(first["name"], first["agent_name"])) == {
        "invoke_agent planner": "planner", "invoke-agent x": "invoke-agent x", "execute_task": "node",
        "create_agent helper": "helper", "Writer.agent": "Writer", "Q?.task": "R", "x.agent.task": "x.agent",
        "chat gpt-4o": None, "anything": "B", "wf": "", "execute_tool t": None, "plain": None}
