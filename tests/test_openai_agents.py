"""The OpenAI Agents SDK example (examples/openai_agents_math), unchanged, against the gateway over the real
engine (bundled SmolLM2-135M): traced by the SDK's own OpenTelemetry instrumentation, as an agent function in
the worker process and as a script under opentelemetry-instrument, run and streamed (Runner.run_streamed).

The agent uses the SDK's default model provider: Responses API calls (/v1/responses). The SDK's span around
each model call (openai.response, from the openai-agents instrumentation) and the OpenAI instrumentation's
(openai.response too, under it; none for a streamed call, which the SDK makes through with_streaming_response)
record one request: the trajectory has it once, joined to its one token record, whose parent is the SDK's span
(the distro adds the traceparent to Responses requests). The agent asks for tool_choice "required" with its one tool,
which the gateway keeps for a model without native tools by opening a call of that tool in the prompt.
The model is weak: the assertions hold whatever it answers.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_otel.eval.metrics import compute_metrics, outcomes_by_version
from lightning_otel.rollouts.runner import RolloutConfig, run_rollouts
from lightning_otel.span_store import client
from lightning_otel.tasks.math import last_number
from tests.helpers.examples import example_module

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "openai_agents_math"
problems = example_module("openai_agents_math", "problems")
math_reward = example_module("openai_agents_math", "reward")

FORCED = '<tool_call>\n{"name": "calculate", "arguments":'  # "required" with one tool offered: a call of it


def test_problems_keep_train_and_test_apart_and_are_reproducible():
    train, test = problems.make("train", 40, 0), problems.make("test", 40, 0)
    assert problems.make("train", 40, 0) == train and problems.make("train", 40, 1) != train
    assert {r["template"] for r in train}.isdisjoint(r["template"] for r in test)
    assert len({r["id"] for r in train + test}) == 80  # task ids: train and test never share one
    numbers = lambda rows: {int(x) for r in rows for x in r["expression"].replace("*", " ").replace("+", " ")
                            .replace("-", " ").split()}
    assert max(numbers(train)) <= 40 < min(numbers(test))
    for row in train + test:
        assert row["answer"] > 0 and eval(row["expression"], {"__builtins__": {}}) == row["answer"]
        assert all(str(int(n)) in row["question"] for n in row["expression"].split() if n.isdigit())
    with pytest.raises(ValueError, match="split"):
        problems.make("dev", 1)


def test_one_step_problems_have_one_operation_and_their_own_ids():
    one = problems.make("test", 30, 0, steps=1)
    assert {r["template"] for r in one} == {t[0] for t in problems.ONE_STEP_TEMPLATES}
    for row in one:
        operators = [c for c in row["expression"] if c in "+-*"]
        assert len(operators) == 1 and row["answer"] > 0
        assert eval(row["expression"], {"__builtins__": {}}) == row["answer"]
        assert all(str(int(n)) in row["question"] for n in row["expression"].split() if n.isdigit())
        assert all(41 <= int(n) <= 99 for n in row["expression"].split() if n.isdigit())
    assert {r["id"] for r in one}.isdisjoint(r["id"] for r in problems.make("test", 30, 0))
    with pytest.raises(ValueError, match="steps"):
        problems.make("test", 1, steps=3)


def test_the_shaped_reward_reads_the_tool_call_from_the_spans():
    task = {"answer": 55, "question": "Sam has 12 bags of 4 apples and 7 more apples. How many?"}

    def tool(arguments: str, result: str, as_text: bool = False) -> dict:
        attributes = {"gen_ai.tool.call.arguments": arguments, "gen_ai.tool.call.result": result}
        return {"operation_name": "execute_tool", "attributes": json.dumps(attributes) if as_text else attributes}

    right = tool('{"expression": "12 * 4 + 7"}', "55", as_text=True)
    assert math_reward.shaped(task, {"final_output": "It is 55.", "spans": []}) == 1.0
    assert math_reward.shaped(task, {"final_output": "done", "spans": [right]}) == 0.6
    assert math_reward.shaped(task, {"final_output": "54", "spans": [tool('{"expression": "12 * 4 + 6"}', "54")]}) \
        == pytest.approx(0.1 + 0.3 * 2 / 3)
    assert math_reward.shaped(task, {"final_output": "9", "spans": [tool('{"expression": "1 + 8"}', "9")]}) == 0.1
    assert math_reward.shaped(task, {"final_output": "?", "spans": [tool('{"x": 12}', "error: not arithmetic")]}) == 0.0
    assert math_reward.shaped(task, {"final_output": "?", "spans": []}) == 0.0
    assert math_reward.shaped({}, {"final_output": "55"}) is None


def check_rollout(db: Path, rollout_id: str, tokenizer, streamed: bool = False) -> list[dict]:
    """The rollout's spans and its trajectory: each request once, each with its token record, which names the
    SDK's LLM span through the traceparent."""
    names = set(client.query(f"SELECT DISTINCT name FROM spans WHERE rollout_id = '{rollout_id}'", db)["name"])
    assert {"Agent Workflow", "calculator.agent", "openai.response"} <= names and "openai.chat" not in names, names
    calls = client.query(f"SELECT t.*, s.status_code FROM trajectory_calls t JOIN spans s ON s.trace_id = t.trace_id "
                         f"AND s.span_id = t.span_id WHERE t.rollout_id = '{rollout_id}' ORDER BY turn", db).to_dicts()
    served = client.query(f"SELECT count(*) AS n, count(llm_span_id) AS named FROM generations "
                          f"WHERE rollout_id = '{rollout_id}'", db).to_dicts()[0]
    raw = client.query(f"SELECT count(*) AS n FROM llm_calls WHERE rollout_id = '{rollout_id}'", db)["n"][0]
    assert calls and len(calls) == served["n"] == served["named"], (len(calls), served)
    assert raw == sum(1 + c["duplicates"] for c in calls), (raw, calls)
    # The OpenAI instrumentation records a completed response only: an incomplete one (cut at max tokens, which
    # the SDK raises as an error on its own span) and a streamed one have the SDK's span alone.
    assert all(c["duplicates"] == (0 if streamed or c["status_code"] == "ERROR" else 1) for c in calls), calls
    assert all(c["record_span_id"] and c["agent"] == "calculator" for c in calls), calls
    first = tokenizer.decode(calls[0]["prompt_ids"])
    assert first.endswith(FORCED) and "<tools>" in first and '"calculate"' in first
    tools = client.query(f"SELECT attributes FROM spans WHERE rollout_id = '{rollout_id}' AND "
                         "operation_name = 'execute_tool'", db).to_dicts()
    if len(calls) > 1:  # the SDK ran the tool and sent its result back
        assert tools and "<tool_response>" in tokenizer.decode(calls[1]["prompt_ids"])
    return calls


@pytest.mark.heavy
def test_the_agent_function_runs_in_the_worker_with_one_record_per_request(engine, tmp_path, tokenizer):
    engine.use_base()
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(r) + "\n" for r in problems.make("train", 3, 0)))
    db = tmp_path / "traces.duckdb"
    summary = run_rollouts(RolloutConfig(tasks=tasks, agent=f"{EXAMPLE / 'agent.py'}:run", n=2, concurrency=6,
                                         db=db, reward=f"{EXAMPLE / 'reward.py'}:shaped", temperature=0.5,
                                         max_tokens=48, rollout_timeout_s=240), engine=engine)
    assert [r.status for r in summary.results] == ["ok"] * 6
    assert all(r.reward in (0.0, 0.6, 1.0) or 0.1 <= r.reward <= 0.4 for r in summary.results), summary.results
    for result in summary.results:
        check_rollout(db, result.rollout_id, tokenizer)
    # eval counts requests, not spans: the SDK's response span around each chat span does not double them
    served = client.query("SELECT count(*) AS n FROM generations", db)["n"][0]
    metrics = compute_metrics(db, [r.rollout_id for r in summary.results], f"{EXAMPLE / 'reward.py'}:shaped")
    assert metrics["task_pack"] == f"{EXAMPLE / 'reward.py'}:shaped"  # a reward without a pack: generic classes
    assert set(metrics["failure_classes"]) == {"correct", "wrong", "agent_error", "timeout", "unscored"}
    assert metrics["transitions_per_episode"]["mean"] == pytest.approx(served / 6)
    assert metrics["latency"]["llm_call_ms"]["calls"] == served
    # each problem's outcome per policy version, read back from the store by task id (the math benchmark's paired
    # test compares the base model's validation with the last one's this way)
    right = {r.task_id: max(float(x.reward == 1.0) for x in summary.results if x.task_id == r.task_id)
             for r in summary.results}
    assert outcomes_by_version(db, set(right)) == {0: right}
    assert sorted(right) == [f"train-0-000{i}" for i in range(3)]


@pytest.mark.heavy
def test_eval_scores_the_math_agent_with_the_math_pack(engine, tmp_path):
    """`eval --reward number_match`: the same report as Spider's, with the math pack's outcome classes."""
    from lightning_otel.eval import EvalConfig, evaluate

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(r) + "\n" for r in problems.make("test", 3, 0)))
    result = evaluate(EvalConfig(tasks=tasks, agent=f"{EXAMPLE / 'agent.py'}:run", reward="number_match", n=1,
                                 report=tmp_path / "report", max_tokens=48, temperature=0.0, concurrency=3,
                                 rollout_timeout_s=240), engine=engine)
    summary = result.summary
    assert summary["reward"] == "number_match" and summary["task_pack"] == "math"
    assert summary["rollouts"] == 3 and summary["accuracy"]["overall"]["scored"] == 3
    assert summary["accuracy"]["group_field"] is None and summary["accuracy"]["by_group"] == {}
    assert list(summary["failure_classes"]) == ["correct", "wrong_number", "no_number", "agent_error", "timeout",
                                                "unscored"]
    assert sum(summary["failure_classes"].values()) == 3
    for episode in summary["episodes"]:
        expected = "correct" if episode["reward"] == 1.0 else (
            "no_number" if last_number(episode["final_output"]) is None else "wrong_number")
        assert episode["status"] != "ok" or episode["failure_class"] == expected, episode
    text = (tmp_path / "report" / "report.md").read_text()
    assert "## Accuracy" in text and "`number_match` (task pack `math`)" in text and "| wrong_number |" in text
    assert summary["transitions_per_episode"]["mean"] >= 1


# The example's agent, streamed: Runner.run_streamed, every event read (the SDK's default provider streams the
# Responses API events the gateway makes from the finished generation).
STREAMED = """
import asyncio, sys
sys.path.insert(0, {folder!r})
from agents import Runner
from agents.exceptions import AgentsException
from agent import MAX_TURNS, make_agent

async def main(question):
    result = Runner.run_streamed(make_agent("policy"), question, max_turns=MAX_TURNS)
    kinds = set()
    try:
        async for event in result.stream_events():
            kinds.add(event.type)
    except AgentsException as exc:  # a reply cut at max tokens (incomplete), or too many turns
        print(f"no answer: {{type(exc).__name__}}")
    print(sorted(kinds))
    print(" ".join(str(result.final_output).split()))

asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.heavy
@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_the_unchanged_script_under_opentelemetry_instrument(gateway, collector, db_path, tokenizer, tmp_path,
                                                             streamed):
    rollout_id = f"ro-agents-{int(streamed)}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LIGHTNING_OTEL_", "OPENAI_"))}
    env.update({"OPENAI_BASE_URL": gateway.base_url(rollout_id), "OPENAI_API_KEY": "k",
                "LIGHTNING_OTEL_ENDPOINT": collector.url,
                "OTEL_RESOURCE_ATTRIBUTES": f"lightning.rollout.id={rollout_id}"})
    question = problems.make("test", 1, 0)[0]["question"]
    script = EXAMPLE / "agent.py"
    if streamed:
        script = tmp_path / "streamed.py"
        script.write_text(STREAMED.format(folder=str(EXAMPLE)))
    args = [question] if streamed else ["--question", question, "--model", "policy"]
    result = subprocess.run([str(Path(sys.executable).parent / "opentelemetry-instrument"), sys.executable,
                             str(script), *args], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    if streamed:
        assert "'raw_response_event'" in result.stdout, result.stdout[-2000:]
    gateway.flush()
    check_rollout(db_path, rollout_id, tokenizer, streamed)
