"""One LoRA adapter per agent (`adapters = {name: agent-pattern}`): the config, its checks and the routing rule."""
from __future__ import annotations

import json
import os
import subprocess
import tomllib
import urllib.request
from pathlib import Path

import pytest

from lightning_otel.errors import UserError
from lightning_otel.serve.adapters import AGENT_HEADER, adapter_for, adapter_of_agent, check_adapters
from lightning_otel.train.config import load_config
from lightning_otel.train.settings import render_toml

PAIR = {"writer": "generate_query", "checker": "check_query"}


def test_adapters_from_toml_and_key_value_and_back(tmp_path):
    toml = tmp_path / "train.toml"
    toml.write_text('adapters = {writer = "generate_query", checker = "check_query"}\n')
    assert load_config(toml).adapters == PAIR
    assert load_config(None, ["adapters=writer:generate_query, checker:check_query"]).adapters == PAIR
    assert load_config(None, ['adapters={"w": "a|b:c"}']).adapters == {"w": "a|b:c"}
    saved = render_toml(load_config(toml))
    assert tomllib.loads(saved)["adapters"] == PAIR  # the saved run config reads back (resume compares it)
    assert list(tomllib.loads(saved)["adapters"]) == ["writer", "checker"]  # order kept: the first match wins
    assert load_config().adapters == {}


@pytest.mark.parametrize("override, says", [
    ("adapters=../up:x", "cannot be a folder name"),
    ("adapters=a/b:x", "cannot be a folder name"),
    ("adapters=.hidden:x", "cannot be a folder name"),
    ("adapters=Writer:x,writer:y", "differ only in case"),
    ("adapters=writer:x,writer:y", "each name once"),
    ("adapters=base:x", "reserved"),
    ("adapters=writer:", "give a regular expression"),
    ("adapters=writer:(unclosed", "not a regular expression"),
    ("adapters=writer", "name:pattern pairs"),
    ('adapters={"writer": 3}', "object of texts"),
    ("adapters=writer:x full_finetune=true", "full_finetune"),
    ("adapters=writer:x serve_merged=true", "serve_merged"),
])
def test_bad_adapters_are_refused_with_what_to_do(override, says):
    with pytest.raises(UserError, match=says):
        load_config(None, override.split(" ", 1) if "full" in override or "merged" in override else [override])


def test_routing_rule_matches_whole_agent_names_first_pattern_first():
    adapters = check_adapters({"writer": "generate_query|rewrite", "any": ".*_query"})
    assert adapter_of_agent(adapters, "generate_query") == "writer"
    assert adapter_of_agent(adapters, "check_query") == "any"
    assert adapter_of_agent(adapters, "generate_query_2") is None  # whole names, as compile --agents matches
    assert adapter_of_agent(adapters, "rewrite") == "writer"
    assert adapter_of_agent(adapters, None) is None
    assert adapter_for(adapters, "any", "generate_query") == "any"  # the request's model names an adapter
    assert adapter_for(adapters, "gpt-4o", "list_tables") is None  # no adapter: the base model
    with pytest.raises(UserError, match="table of adapter names"):
        check_adapters(["writer"])


# ---- the agent names itself on each request (capture/agent_header.py) ------------------------------------

@pytest.mark.heavy
def test_each_request_names_the_agent_the_store_derives_for_its_call(tmp_path):
    """The LangGraph SQL tutorial, unchanged, against a scripted model: the x-lightning-agent header of every
    request (read from the agent process's live spans) is the agent the store derives afterwards for that
    call from the exported span tree."""
    from lightning_otel.rollouts.runner import RolloutConfig, run_rollouts
    from lightning_otel.span_store import client
    from test_inprocess import singer_tasks, write_tasks
    from test_langgraph_sql_tutorial import EXAMPLE, StubModel

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
    stored = client.query(f"SELECT agent FROM trajectory_calls WHERE rollout_id = '{result.rollout_id}' "
                          f"ORDER BY turn", db)["agent"].to_list()
    # The agent's requests reach the rollout's gateway, which forwards them to the stub (base_url) and records
    # the header's agent on each call; the header itself is not passed on to an outside endpoint.
    sent = client.query("SELECT json_extract_string(attributes, '$.\"lightning.agent\"') AS agent FROM spans "
                        "WHERE name = 'lightning.forward' ORDER BY start_ns", db)["agent"].to_list()
    assert sent == stored, (sent, stored)
    assert {"generate_query", "check_query"} <= set(sent)
    assert all(AGENT_HEADER not in h for h in stub.headers)


def test_the_agent_header_can_be_turned_off():
    import sys
    code = ("from lightning_otel.capture import agent_header as h, hooks; h.install(); "
            "print(hooks.registered(h.MODULE))")
    for value, installed in (("0", "False"), ("1", "True")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "LIGHTNING_OTEL_AGENT_HEADER": value})
        assert out.stdout.strip() == installed, out.stderr[-1000:]


# ---- the gateway serves each call by its agent's adapter (real engine, two LoRA adapters) -------------------

def _chat(url: str, body: dict, headers: dict[str, str] | None = None) -> dict:
    request = urllib.request.Request(url + "/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def _stream_text(url: str, body: dict, headers: dict[str, str]) -> str:
    request = urllib.request.Request(url + "/chat/completions", data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json", **headers})
    parts = []
    with urllib.request.urlopen(request, timeout=300) as response:
        for line in response:
            line = line.decode().strip()
            if line.startswith("data: {"):
                for choice in json.loads(line[6:]).get("choices") or []:
                    parts.append((choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


def make_adapters(engine, tmp_path: Path, seeds: dict[str, int]) -> dict[str, Path]:
    """LoRA adapters on the bundled model (random q_proj updates, one seed each), made with the engine's torch."""
    from test_gateway import MAKE_ADAPTER
    script = MAKE_ADAPTER.replace("torch.manual_seed(0)", "torch.manual_seed(int(sys.argv[3]))")
    folders = {}
    for name, seed in seeds.items():
        folders[name] = tmp_path / name
        made = subprocess.run([engine.config.python, "-c", script, str(folders[name]), str(engine.config.model_dir),
                               str(seed)], capture_output=True, text=True, timeout=300)
        assert made.returncode == 0, made.stderr[-2000:]
    return folders


def test_the_gateway_serves_each_call_by_its_agents_adapter_and_records_it(engine, collector, db_path, tmp_path):
    from lightning_otel.serve.gateway import Gateway, GatewayConfig
    from lightning_otel.span_store import client

    folders = make_adapters(engine, tmp_path, {"writer": 1, "checker": 2})
    body = {"model": "gpt-4o", "max_tokens": 10, "temperature": 0.0,
            "messages": [{"role": "user", "content": "Name three colors."}]}
    gateway = Gateway(engine, GatewayConfig(collector_url=collector.url, adapters=PAIR))
    gateway.start()
    try:
        engine.update_adapters(folders, version=1)
        direct = {name: engine.generate("/v1/chat/completions", body, model=engine.served_model(name))
                  ["choices"][0]["message"]["content"] for name in ("writer", "checker")}
        direct["base"] = engine.generate("/v1/chat/completions", body, model=engine.base_name)[
            "choices"][0]["message"]["content"]
        assert len(set(direct.values())) == 3, direct  # the two adapters and the base model answer differently
        answers = {}
        for rollout, agent, model in [("ro-w", "generate_query", "gpt-4o"), ("ro-c", "check_query", "gpt-4o"),
                                      ("ro-n", "list_tables", "gpt-4o"), ("ro-m", None, "checker"),
                                      ("ro-x", None, "gpt-4o")]:
            headers = {AGENT_HEADER: agent} if agent else {}
            answers[rollout] = _chat(gateway.base_url(rollout), {**body, "model": model},
                                     headers)["choices"][0]["message"]["content"]
        streamed = _stream_text(gateway.base_url("ro-ws"), body, {AGENT_HEADER: "generate_query"})
        with urllib.request.urlopen(gateway.url + "/v1/models") as response:
            listed = [m["id"] for m in json.loads(response.read())["data"]]
        gateway.flush()
    finally:
        gateway.close()
        engine.use_base()
    assert answers == {"ro-w": direct["writer"], "ro-c": direct["checker"], "ro-n": direct["base"],
                       "ro-m": direct["checker"], "ro-x": direct["base"]}
    assert streamed == direct["writer"]
    assert listed == [engine.base_name, "writer", "checker"]  # the adapters, by the names agents may ask for
    records = dict(client.query(
        "SELECT rollout_id, json_extract_string(attributes, '$.\"lightning.adapter\"') AS adapter FROM spans "
        "WHERE name = 'lightning.generate'", db_path).iter_rows())
    assert records == {"ro-w": "writer", "ro-c": "checker", "ro-n": None, "ro-m": "checker", "ro-x": None,
                       "ro-ws": "writer"}


# ---- the learner trains each adapter on its own rows only (train/learner.py) --------------------------------

def adapter_rows(learner, agent: str) -> list[dict]:
    encode = learner.tokenizer.encode
    answer = encode("SELECT count(*) FROM singer")
    rows = []
    for i, (prompt, advantage) in enumerate([("Count the singers.", 1.0), ("How many stadiums?", -1.0)]):
        rows.append({"rollout_id": f"{agent}-{i}", "task_id": "t", "turn": 0, "agent": agent,
                     "prompt_ids": encode(prompt), "completion_ids": answer[:5],
                     "completion_logprobs": [-1.0] * 5, "loss_mask": None, "advantage": advantage,
                     "return": advantage})
    return rows


@pytest.mark.heavy
def test_each_adapter_steps_on_its_own_rows_and_keeps_its_own_optimizer_state(tmp_path):
    import torch

    from lightning_otel.serve.model import bundled_model_dir
    from lightning_otel.train.config import TrainConfig
    from lightning_otel.train.learner import Learner
    from lightning_otel.train.optimize import optimize

    config = TrainConfig(lora_rank=4, lr=1e-3, batch_size=2, micro_batch=2, adapters=PAIR)
    learner = Learner(bundled_model_dir(), config)
    try:
        def params(name):
            return [p for n, p in learner.module.named_parameters() if f".lora_A.{name}." in n or
                    f".lora_B.{name}." in n]

        def snap(name):
            return [p.detach().clone() for p in params(name)]

        def moved(before, name):
            return any(not torch.equal(b, p.detach()) for b, p in zip(before, params(name)))

        base = [p.detach().clone() for n, p in learner.module.named_parameters() if ".lora_" not in n][:8]
        assert len(params("writer")) == len(params("checker")) > 0
        writer, checker = snap("writer"), snap("checker")
        with learner.training_adapter("writer"):
            stats = optimize(learner, adapter_rows(learner, "generate_query"), config, "grpo", seed=0)
        assert stats.steps == 1
        assert moved(writer, "writer") and not moved(checker, "checker")
        moments = {k: v.clone() for k, v in learner.base_optimizer().state[
            learner.optimizer.param_groups[0]["params"][0]].items() if torch.is_tensor(v)}
        writer = snap("writer")
        with learner.training_adapter("checker"):
            assert learner.learning_rate() == config.lr
            optimize(learner, adapter_rows(learner, "check_query"), config, "grpo", seed=0)
        assert moved(checker, "checker") and not moved(writer, "writer")
        after = learner.base_optimizer().state[learner.optimizer.param_groups[0]["params"][0]]
        assert all(torch.equal(after[k], v) for k, v in moments.items())  # the writer's Adam state untouched
        assert all(torch.equal(b, p.detach()) for b, p in zip(
            base, [p for n, p in learner.module.named_parameters() if ".lora_" not in n][:8]))
        learner.save_state(tmp_path / "state")  # resume: every adapter's weights come back
        saved = {name: snap(name) for name in PAIR}
        with learner.training_adapter("writer"):
            optimize(learner, adapter_rows(learner, "generate_query"), config, "grpo", seed=1)
        assert moved(saved["writer"], "writer")
        learner.load_state(tmp_path / "state")
        assert not moved(saved["writer"], "writer") and not moved(saved["checker"], "checker")
        folder = learner.save_policy(tmp_path / "checkpoint")
        assert folder == tmp_path / "checkpoint" / "adapters"
        for name in PAIR:
            assert (folder / name / "adapter_model.safetensors").is_file()
            assert (folder / name / "adapter_config.json").is_file()
        assert json.loads((tmp_path / "checkpoint" / "adapters.json").read_text())["adapters"] == PAIR
    finally:
        learner.close()


# ---- acceptance: one tiny round of the LangGraph SQL agent with a writer and a checker adapter ------------------
# examples/sql_agent: write_query -> execute -> check_query -> rewrite_query -> execute -> check_query ... (at most 3
# queries); the writer adapter serves write_query, the checker check_query, and rewrite_query (no adapter) is served
# the base model and not trained.

SQL_AGENT = Path(__file__).resolve().parent.parent / "examples" / "sql_agent" / "agent.py"
SQL_PAIR = {"writer": "write_query", "checker": "check_query"}

BY_ATTEMPT = """
def by_attempt(task, rollout):
    return float(rollout.get("attempt") or 0)  # the group's two samples differ: GRPO has a gradient
"""
SQL_SERVED = """
SELECT t.rollout_id, t.turn, t.agent, json_extract_string(s.attributes, '$."lightning.adapter"') AS adapter
FROM trajectory_calls t JOIN spans s ON s.trace_id = t.record_trace_id AND s.span_id = t.record_span_id
ORDER BY t.rollout_id, t.turn
"""


@pytest.mark.heavy
def test_a_round_of_the_langgraph_sql_agent_trains_the_writer_and_checker_adapters_on_their_own_calls(engine, tmp_path):
    import polars as pl
    from safetensors.torch import load_file

    from lightning_otel.serve.policy import resolve_policy
    from lightning_otel.span_store import client
    from lightning_otel.train.checkpoints import export_policy
    from lightning_otel.train.config import TrainConfig
    from lightning_otel.train.trainer import train
    from test_inprocess import singer_tasks, write_tasks

    (tmp_path / "reward.py").write_text(BY_ATTEMPT)
    run = tmp_path / "run"
    config = TrainConfig(tasks=str(write_tasks(tmp_path / "tasks.jsonl", singer_tasks(1))), agent=f"{SQL_AGENT}:run",
                         reward=f"{tmp_path / 'reward.py'}:by_attempt", task_pack="spider", n=2, tasks_per_round=1,
                         rounds=1, concurrency=2, max_tokens=24, lora_rank=4, lr=1e-3, batch_size=4, micro_batch=2,
                         adapters=SQL_PAIR, output_dir=str(run), report_to=[], rollout_timeout_s=300)
    engine.use_base()
    try:
        state = train(config, engine=engine)
        served_after = dict(engine.adapters)
    finally:
        engine.use_base()
    assert state.rounds_completed == 1 and state.policy_version == 1, state
    assert set(served_after) == set(SQL_PAIR)  # the engine serves both new adapters as policy version 1
    calls = client.query(SQL_SERVED, run / "traces.duckdb")
    # each call was served by the adapter of the agent that made it; agents with no adapter by the base model
    expected = calls["agent"].map_elements(lambda a: adapter_of_agent(SQL_PAIR, a), return_dtype=pl.String)
    assert calls["adapter"].to_list() == expected.to_list(), calls
    counts = {name: calls.filter(pl.col("adapter") == name).height for name in SQL_PAIR}
    assert counts["writer"] and counts["checker"], calls
    assert "rewrite_query" in calls.filter(pl.col("adapter").is_null())["agent"].to_list()  # the base model's
    # each adapter trained on its own agent's calls only; the other calls trained nothing
    record = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert {name: record["adapters"][name]["transitions"] for name in SQL_PAIR} == counts, record
    assert all(record["adapters"][name]["steps"] >= 1 for name in SQL_PAIR), record
    assert record["untrained_transitions"] == calls.height - sum(counts.values())
    # each adapter moved off its start (LoRA B = 0 at the start)
    checkpoint = run / state.last
    for name in SQL_PAIR:
        tensors = load_file(str(checkpoint / "adapters" / name / "adapter_model.safetensors"))
        assert any(float(t.abs().sum()) > 0 for key, t in tensors.items() if "lora_B" in key), name
    # the run, and its export, load as the set (serve and eval route by the same patterns)
    policy = resolve_policy(str(run))
    assert policy.routes == SQL_PAIR and set(policy.adapters) == set(SQL_PAIR) and policy.version == 1
    out = export_policy(str(run), tmp_path / "export")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "adapters.json", "checker", "writer"]
    exported = resolve_policy(str(out))
    assert exported.routes == SQL_PAIR and exported.adapters == {n: (out / n).resolve() for n in SQL_PAIR}
    with pytest.raises(UserError, match="cannot merge"):
        export_policy(str(run), tmp_path / "merged", merge=True)
