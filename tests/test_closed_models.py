"""Closed models (lightning_otel/serve/forward.py): the gateway forwards chat and Responses calls to an outside
OpenAI-compatible endpoint with the prompt patch applied, and records them as text (`lightning.forward` spans: no
token ids), and `optimize --base-url` searches a prompt for an agent that runs on such an endpoint.

The outside endpoint is, for the answers, the bundled model behind the shared vLLM engine's own OpenAI server (it
plays the closed model: the gateway talks to it as to any endpoint, without asking for token ids); for what a
closed API does that vLLM cannot be made to do on demand (a 429, a 503, an answer too slow, a dropped connection,
a streamed tool call, checking the key it got), a tiny HTTP server on 127.0.0.1 that answers by the model name
the request gives. Everything else (gateway, collector, DuckDB store, runner, GEPA) is real.
"""
from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest

from lightning_otel.errors import UserError
from lightning_otel.lifetime import free_port
from lightning_otel.serve.prompts import load_patches
from tests.helpers.apo_agents import StandInReflector
from tests.helpers.examples import example_module
from tests.helpers.loopback import LoopbackServer, QuietHandler

TUTORIAL = example_module("langgraph_sql_tutorial")  # its two nodes' system messages: one patched, one not
GENERATE, CHECK = TUTORIAL.GENERATE_QUERY, TUTORIAL.CHECK_QUERY
APPEND = "Always name the columns you select; never SELECT *."
DEMO = {"user": "How many heads of departments are older than 56?", "assistant": "SELECT count(*) FROM head"}
PATCHES = {"agents": {"generate_query": {"system": GENERATE}, "check_query": {"system": CHECK}},
           "patches": [{"id": "gq-names", "version": "2", "target": {"agent": "generate_query"},
                        "action": {"append": APPEND, "demos": [DEMO]}}]}
REPO = Path(__file__).resolve().parent.parent
AGENT = f"{REPO / 'tests' / 'helpers' / 'apo_agents.py'}:answer"  # one call with its own system message
REWARD = "tests.helpers.apo_agents:says_banana"
STRONG = "You are a helpful assistant. Answer the question briefly. The secret word is BANANA."
TRAIN = ["What is the secret word?", "Tell me the secret word.", "What is the password?"]
VAL = ["Say the code word.", "I forgot the secret word. What is it?", "What is the secret word? Answer in one line."]

SECRET = "sk-outside-secret-7f3a"
TRACE, PARENT = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
SQL_FORWARDED = """
SELECT trace_id, parent_span_id, rollout_id, status_code, status_message, attributes,
       json_extract_string(attributes, '$."lightning.prompt.version"') AS version,
       json_extract_string(attributes, '$."lightning.prompt.patch_id"') AS patch_id,
       json_extract_string(attributes, '$."lightning.token_source"') AS token_source,
       json_extract_string(attributes, '$."error.type"') AS error_type,
       json_extract(attributes, '$."gen_ai.input.messages"')::VARCHAR AS input_messages,
       json_extract(attributes, '$."gen_ai.output.messages"')::VARCHAR AS output_messages,
       json_extract_string(attributes, '$."gen_ai.response.id"') AS response_id,
       TRY_CAST(json_extract_string(attributes, '$."gen_ai.usage.input_tokens"') AS INTEGER) AS input_tokens
FROM spans WHERE name = 'lightning.forward' ORDER BY start_ns
"""


def chat(system: str, question: str = "How many singers do we have?") -> dict:
    return {"model": "gpt-4o",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}


def write_tasks(path: Path, questions: list[str], prefix: str) -> Path:
    path.write_text("".join(json.dumps({"id": f"{prefix}{i}", "question": q}) + "\n" for i, q in enumerate(questions)))
    return path


def decoded(text: str | None):
    """A JSON attribute as stored (a JSON string holding JSON), decoded."""
    value = json.loads(text) if text is not None else None
    return json.loads(value) if isinstance(value, str) else value


class Outside:
    """A tiny OpenAI-shaped server on 127.0.0.1 that fails or answers by the request's model name."""

    def __init__(self):
        seen = self.seen = []

        class Handler(QuietHandler):
            def do_POST(self):  # noqa: N802
                body = self.json_body()
                seen.append({"authorization": self.headers.get("Authorization"), "body": body})
                model = body.get("model")
                if model == "err-429":
                    return self.answer(429, {"error": {"message": "Rate limit reached", "type": "rate_limit"}})
                if model == "err-503":
                    return self.answer(503, b"upstream overloaded")
                if model == "slow":
                    time.sleep(2)
                if model == "drop":
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if model == "tool-stream":
                    return self.tool_stream()
                text = "Banana, of course." if model == "banana-bot" else "The answer is 5."
                self.answer(200, {"id": "chatcmpl-1", "object": "chat.completion", "model": model, "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}})

            def tool_stream(self):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                base = {"id": "chatcmpl-t", "object": "chat.completion.chunk", "model": "tool-stream"}
                deltas = [{"role": "assistant", "content": None},
                          {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                           "function": {"name": "add", "arguments": ""}}]},
                          {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 2, '}}]},
                          {"tool_calls": [{"index": 0, "function": {"arguments": '"b": 3}'}}]}]
                events = [{**base, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
                events.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
                events.append({**base, "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4,
                                                                 "total_tokens": 13}})
                for event in events:
                    self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")

        self.server = LoopbackServer(Handler, "/v1")
        self.url = self.server.url

    def close(self):
        self.server.close()


@pytest.fixture
def outside():
    server = Outside()
    yield server
    server.close()


def forwarding_gateway(collector, url: str, **config):
    from lightning_otel.serve.gateway import Gateway, GatewayConfig

    gateway = Gateway(None, GatewayConfig(collector_url=collector.url, forward_url=url, **config))
    gateway.start()
    return gateway


def test_outside_errors_reach_the_agent_in_openais_shape_and_are_recorded(collector, db_path, outside, monkeypatch):
    import openai

    from lightning_otel.span_store import client

    monkeypatch.setenv("OUTSIDE_KEY", SECRET)
    refused = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    gateway = forwarding_gateway(collector, outside.url, forward_api_key_env="OUTSIDE_KEY", forward_timeout_s=0.5)
    nowhere = forwarding_gateway(collector, refused)
    got = {}
    try:
        sdk = openai.OpenAI(base_url=gateway.base_url("ro-errors"), api_key="agent-key", max_retries=0)
        for model in ("err-429", "err-503", "slow", "drop"):
            with pytest.raises(openai.APIStatusError) as caught:
                sdk.chat.completions.create(model=model, messages=chat(GENERATE)["messages"])
            got[model] = (caught.value.status_code, caught.value.body)
        with pytest.raises(openai.APIStatusError) as caught:
            openai.OpenAI(base_url=nowhere.base_url("ro-errors"), api_key="k", max_retries=0).chat.completions.create(
                model="any", messages=chat(CHECK)["messages"])
        got["refused"] = (caught.value.status_code, caught.value.body)
        # the key: the configured variable's, never the agent's; a stream of tool-call pieces is put together
        assert sdk.chat.completions.create(model="ok", messages=chat(CHECK)["messages"]).choices[0].message.content \
            == "The answer is 5."
        assert {seen["authorization"] for seen in outside.seen} == {f"Bearer {SECRET}"}
        own = forwarding_gateway(collector, outside.url)  # no key configured: the agent's own goes through
        try:
            openai.OpenAI(base_url=own.base_url("ro-errors"), api_key="agent-key").chat.completions.create(
                model="ok", messages=chat(CHECK)["messages"])
        finally:
            own.close()
        assert outside.seen[-1]["authorization"] == "Bearer agent-key"
        pieces = list(sdk.chat.completions.create(model="tool-stream", messages=chat(CHECK)["messages"], stream=True,
                                                  tools=[{"type": "function", "function": {"name": "add"}}]))
        assert [p.choices[0].delta.tool_calls[0].function.arguments for p in pieces[2:4]] == ['{"a": 2, ', '"b": 3}']
        assert not any(p.usage for p in pieces)  # the usage the gateway asked for is not the client's
        with pytest.raises(openai.BadRequestError, match="legacy /v1/completions are not forwarded"):
            sdk.completions.create(model="ok", prompt="hi")
    finally:
        gateway.close()
        nowhere.close()
    assert got["err-429"][0] == 429 and got["err-429"][1]["message"] == "Rate limit reached"
    assert got["err-503"][0] == 503 and "answered 503: upstream overloaded" in got["err-503"][1]["message"]
    assert got["slow"][0] == 504 and "did not answer within 0.5 s" in got["slow"][1]["message"]
    assert got["drop"][0] == 502 and "closed the connection" in got["drop"][1]["message"]
    assert got["refused"][0] == 502 and "could not be reached" in got["refused"][1]["message"]
    rows = client.query(SQL_FORWARDED, db_path).to_dicts()
    assert [(r["error_type"], r["status_code"]) for r in rows[:5]] == [
        ("http_429", "ERROR"), ("http_503", "ERROR"), ("http_504", "ERROR"), ("http_502", "ERROR"),
        ("http_502", "ERROR")]
    assert all(r["rollout_id"] == "ro-errors" and r["token_source"] == "none" for r in rows)
    tool = decoded(rows[-1]["output_messages"])[0]
    assert tool["tool_calls"] == [{"id": "call_1", "type": "function",
                                   "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]
    assert tool["finish_reason"] == "tool_calls" and rows[-1]["input_tokens"] == 9
    stored = client.query("SELECT attributes::VARCHAR AS a, resource::VARCHAR AS r FROM spans", db_path).to_dicts()
    assert not any(SECRET in row["a"] or "agent-key" in row["a"] or SECRET in row["r"] for row in stored)


def test_a_gateway_with_its_own_key_forwards_only_a_configured_one(monkeypatch):
    from lightning_otel.serve.gateway import GatewayConfig

    with pytest.raises(UserError, match="never sent on"):
        GatewayConfig(api_key="gateway-key", forward_url="http://127.0.0.1:9/v1")
    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    with pytest.raises(UserError, match="NO_SUCH_KEY_VAR .* is not set"):
        GatewayConfig(forward_url="http://127.0.0.1:9/v1", forward_api_key_env="NO_SUCH_KEY_VAR")
    with pytest.raises(UserError, match="base URL"):
        GatewayConfig(forward_url="api.openai.com/v1")


def test_the_outside_model_gets_the_patched_prompt_and_the_records_are_text(engine, collector, db_path, tmp_path):
    import openai

    from lightning_otel.span_store import client

    engine.use_base()
    (tmp_path / "p.json").write_text(json.dumps(PATCHES))
    patches = load_patches(tmp_path / "p.json")
    gateway = forwarding_gateway(collector, f"{engine.url}/v1", prompts=patches, forward_model=engine.model_name,
                                 temperature=0.0, max_tokens_cap=8)
    question = "How many singers do we have?"
    traceparent = {"traceparent": f"00-{TRACE}-{PARENT}-01"}
    try:
        sdk = openai.OpenAI(base_url=gateway.base_url("ro-closed"), api_key="k", max_retries=0)
        generate = sdk.chat.completions.create(model="gpt-4o", messages=chat(GENERATE, question)["messages"],
                                               extra_headers=traceparent)
        check = sdk.chat.completions.create(model="gpt-4o", messages=chat(CHECK, question)["messages"])
        streamed = list(sdk.chat.completions.create(model="gpt-4o", messages=chat(GENERATE, question)["messages"],
                                                    stream=True, stream_options={"include_usage": True}))
        response = sdk.responses.create(model="gpt-4o", instructions=GENERATE, input=question)
    finally:
        gateway.close()
    rows = client.query(SQL_FORWARDED, db_path).to_dicts()
    assert len(rows) == 4 and all(r["rollout_id"] == "ro-closed" and r["token_source"] == "none" for r in rows)
    assert client.query("SELECT count(*) AS n FROM generations", db_path).to_dicts()[0]["n"] == 0  # no token records
    patched = patches.apply(chat(GENERATE, question))[0]["messages"]
    assert APPEND in patched[0]["content"] and patched[1]["content"] == DEMO["user"]
    for row in (rows[0], rows[2], rows[3]):
        assert (row["version"], row["patch_id"]) == ("2", "gq-names")
        assert decoded(row["input_messages"])[-1]["content"] == question
    assert decoded(rows[0]["input_messages"]) == patched
    # the endpoint got the patched conversation: its prompt is the patched one's length in tokens
    assert rows[0]["input_tokens"] == len(engine.tokenize_chat({"messages": patched,
                                                                "add_generation_prompt": True})["tokens"])
    assert (rows[1]["version"], rows[1]["patch_id"]) == (None, None)
    assert decoded(rows[1]["input_messages"]) == chat(CHECK, question)["messages"]
    # what each client got is what was recorded; the call's span is under the client's (its traceparent)
    assert decoded(rows[0]["output_messages"])[0]["content"] == generate.choices[0].message.content
    assert (rows[0]["trace_id"], rows[0]["parent_span_id"]) == (TRACE, PARENT)
    assert decoded(rows[1]["output_messages"])[0]["content"] == check.choices[0].message.content
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text and decoded(rows[2]["output_messages"])[0]["content"] == text and streamed[-1].usage.total_tokens
    assert rows[3]["response_id"] == response.id and response.output_text \
        and decoded(rows[3]["output_messages"])[0]["content"] == response.output_text
    attributes = json.loads(rows[0]["attributes"])
    assert attributes["lightning.engine"] == "outside" and "lightning.prompt.token_ids" not in attributes


def test_serve_base_url_patches_and_records_production_traffic_to_an_outside_model(outside, db_path, tmp_path):
    """`lightning-otel serve --base-url URL --prompt FILE --db DB`: a proxy in front of a closed model, no engine."""
    import openai

    from lightning_otel.serve.serving import serve_policy
    from lightning_otel.span_store import client

    (tmp_path / "p.json").write_text(json.dumps(PATCHES))
    with pytest.raises(UserError, match="give no policy, engine or --tool-format"):
        serve_policy("base", port=0, base_url=outside.url)
    with pytest.raises(UserError, match="or --base-url for an outside endpoint"):
        serve_policy(None, port=0)
    with pytest.raises(UserError, match="give --base-url with them"):
        serve_policy("base", port=0, base_model="gpt-4o")
    ready, stop = [], threading.Event()
    server = threading.Thread(target=serve_policy, args=(None,), daemon=True, kwargs=dict(
        port=free_port(), db=db_path, ready=ready.append, stop=stop, base_url=outside.url, base_model="closed-1",
        prompt=tmp_path / "p.json"))
    server.start()
    deadline = time.monotonic() + 60
    while not ready and time.monotonic() < deadline and server.is_alive():
        time.sleep(0.1)
    try:
        sdk = openai.OpenAI(base_url=ready[0], api_key="agent-key", max_retries=0)
        answer = sdk.chat.completions.create(model="gpt-4o", messages=chat(GENERATE)["messages"])
    finally:
        stop.set()
        server.join(60)
    assert answer.choices[0].message.content == "The answer is 5." and not server.is_alive()
    (sent,) = outside.seen
    assert sent["body"]["model"] == "closed-1" and APPEND in sent["body"]["messages"][0]["content"]
    assert sent["authorization"] == "Bearer agent-key"  # no api_key_env: the agent's own key goes through
    (row,) = client.query(SQL_FORWARDED, db_path).to_dicts()
    assert (row["version"], row["patch_id"], row["token_source"]) == ("2", "gq-names", "none")
    assert "agent-key" not in json.dumps(client.query("SELECT * FROM spans", db_path).to_dicts(), default=str)


@pytest.mark.heavy
def test_eval_base_url_reports_a_closed_model_against_a_baseline(outside, tmp_path):
    from lightning_otel.eval import EvalConfig, evaluate

    tasks = write_tasks(tmp_path / "tasks.jsonl", TRAIN[:2], "t")
    common = dict(tasks=tasks, agent=AGENT, reward=REWARD, n=1, base_url=outside.url)
    with pytest.raises(UserError, match="an evaluation runs on one of them"):
        EvalConfig(**common, report=tmp_path / "x", model="runs/sql")
    with pytest.raises(UserError, match="give base_url with them"):
        EvalConfig(**{**common, "base_url": None}, report=tmp_path / "x", base_model="gpt-4o")
    before = evaluate(EvalConfig(**common, report=tmp_path / "before", base_model="plain")).summary
    after = evaluate(EvalConfig(**common, report=tmp_path / "after", base_model="banana-bot",
                                baseline=tmp_path / "before")).summary
    assert [s["body"]["model"] for s in outside.seen] == ["plain"] * 2 + ["banana-bot"] * 2
    assert before["accuracy"]["overall"]["accuracy"] == 0.0 and after["accuracy"]["overall"]["accuracy"] == 1.0
    assert after["policy"]["label"] == "banana-bot" and after["policy"]["outside_url"] == outside.url
    assert after["baseline"]["paired"]["better"] == 2
    report = (tmp_path / "after" / "report.md").read_text()
    assert f"banana-bot at the outside endpoint `{outside.url}`" in report


# ---- optimize --base-url --------------------------------------------------------------------------------------

def test_optimize_on_an_outside_endpoint_finds_a_winner_and_train_refuses_its_rollouts(engine, tmp_path):
    from lightning_otel.cli import main
    from lightning_otel.span_store import client
    from lightning_otel.train.transitions.compile import CompileConfig, compile_transitions
    from lightning_otel.train.transitions.trajectories import FORWARDED

    engine.use_base()
    reflector = StandInReflector(STRONG)
    run = tmp_path / "run"
    try:
        assert main(["optimize", f"tasks={write_tasks(tmp_path / 'train.jsonl', TRAIN, 'train')}",
                     f"val_tasks={write_tasks(tmp_path / 'val.jsonl', VAL, 'val')}", f"agent={AGENT}",
                     f"reward={REWARD}", f"base_url={engine.url}/v1", f"base_model={engine.model_name}",
                     f"reflection_url={reflector.url}", "reflection_model=stand-in", "proposer=reflection",
                     "max_metric_calls=4", "minibatch=3", "max_tokens=16", f"output_dir={run}"]) == 0
    finally:
        reflector.close()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["best_val"] > summary["seed_val"] and summary["best_prompt"] == str(run / "best_prompt.json")
    db = run / "traces.duckdb"
    rows = client.query(SQL_FORWARDED, db).to_dicts()
    assert len(rows) == summary["rollouts"] and {r["token_source"] for r in rows} == {"none"}
    assert summary["best_key"] in {r["version"] for r in rows} and None in {r["version"] for r in rows}
    assert client.query("SELECT count(*) AS n FROM generations", db).to_dicts()[0]["n"] == 0
    # nothing to train on: every rollout is excluded, saying why, even with a tokenizer to re-tokenise with
    frame, account = compile_transitions(CompileConfig(db=db, reward=REWARD, model="bundled"))
    assert frame.height == 0 and account.excluded[FORWARDED] == summary["rollouts"]
    assert "outside endpoint (base_url) serve prompt optimisation" in account.why_none(REWARD)


def test_optimize_refuses_engine_settings_with_an_outside_endpoint(tmp_path):
    from lightning_otel.train.apo.config import OptimizeConfig

    tasks = str(write_tasks(tmp_path / "t.jsonl", TRAIN + VAL, "t"))

    def config(**values) -> OptimizeConfig:
        return OptimizeConfig(tasks=tasks, agent=AGENT, reward=REWARD, **values)

    with pytest.raises(UserError, match="engine_url, chat_template and tool_format are for a policy served here"):
        config(base_url="https://api.example.com/v1", engine_url="http://127.0.0.1:9")
    with pytest.raises(UserError, match="give base_url too"):
        config(base_model="gpt-x")
    assert config(base_url="https://api.example.com/v1", base_model="gpt-x").base_model == "gpt-x"
