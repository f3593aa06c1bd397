"""The compiler over a real store: spans from the real OTel SDK through a collector, runner records and
rewards; every rollout ends in the output or in an exclusion with its reason."""
from __future__ import annotations

import math

import polars as pl
import pytest
from opentelemetry.trace import SpanKind

from lightning_otel.cli import main
from lightning_otel.errors import UserError
from lightning_otel.span_store import client
from lightning_otel.train.compile import CompileConfig, compile_transitions
from lightning_otel.train.credit import EPS
from sdk import tracer_provider

# rollout -> (task, status, reward, [(agent, has token record)] )
ROLLOUTS = {
    "r1": ("t1", "ok", 1.0, [("A", True), ("A", True)]),
    "r2": ("t1", "ok", 0.0, [("B", True)]),
    "r3": ("t2", "ok", 1.0, [("A", True)]),
    "r4": ("t2", "ok", 1.0, [("A", True)]),
    "r5": ("t3", "failed", 1.0, [("A", True)]),
    "r6": ("t3", "ok", None, [("A", True)]),
    "r7": ("t3", "ok", 0.0, [("A", True), ("A", False)]),
    "r8": ("t3", "ok", 1.0, []),
}


@pytest.fixture
def store(collector, db_path):
    provider = tracer_provider(collector.url)
    tracer = provider.get_tracer("agent")
    for rollout_id, (task, status, reward, calls) in ROLLOUTS.items():
        ids = {"lightning.rollout.id": rollout_id}
        with tracer.start_as_current_span("lightning.rollout", attributes=ids):
            for i, (agent, has_tokens) in enumerate(calls):
                with tracer.start_as_current_span(f"invoke_agent {agent}", attributes={
                        **ids, "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": agent}):
                    with tracer.start_as_current_span("openai.chat", kind=SpanKind.CLIENT, attributes={
                            **ids, "gen_ai.operation.name": "chat"}):
                        if has_tokens:
                            with tracer.start_as_current_span("lightning.generate", attributes={
                                    **ids, "lightning.choice.index": 0, "lightning.policy.version": 0,
                                    "lightning.prompt.token_ids": [1, 2, 3 + i],
                                    "lightning.completion.token_ids": [10 + i, 11],
                                    "lightning.completion.logprobs": [-0.5, -0.25]}):
                                pass
            if not calls:
                with tracer.start_as_current_span("execute_tool x", attributes=ids):
                    pass
        client.write_records(db_path, "rollout_runs", [{"rollout_id": rollout_id, "task_id": task, "attempt": 0,
                                                        "policy_version": 0, "status": status}])
        if reward is not None:
            client.write_records(db_path, "rewards", [{"rollout_id": rollout_id, "name": "exec", "value": reward,
                                                       "source": "function"}])
    provider.shutdown()
    return db_path


def test_transitions_and_accounting(store):
    out, account = compile_transitions(CompileConfig(db=store))
    assert sorted(out["rollout_id"].unique().to_list()) == ["r1", "r2"]
    assert account.rollouts == 8 and account.compiled_rollouts == 2 and account.transitions == 3
    assert dict(account.excluded) == {"rollout failed": 1, "no reward": 1, "LLM call without a token record": 1,
                                      "no LLM call": 1, "zero-variance group": 2}
    assert account.zero_variance_groups == 1  # t2 (t3 has no rollout left)
    assert account.transitions_per_episode == 1.5
    r1 = out.filter(pl.col("rollout_id") == "r1").sort("turn").to_dicts()
    assert [(t["turn"], t["agent"], t["prompt_ids"], t["completion_ids"], t["loss_mask"]) for t in r1] == \
        [(0, "A", [1, 2, 3], [10, 11], [1, 1]), (1, "A", [1, 2, 4], [11, 11], [1, 1])]
    assert r1[0]["completion_logprobs"] == [-0.5, -0.25]
    expected = 0.5 / (math.sqrt(0.5) + EPS)
    assert [t["advantage"] for t in r1] == pytest.approx([expected, expected])
    assert out.filter(pl.col("rollout_id") == "r2")["advantage"].to_list() == pytest.approx([-expected])
    assert out.schema["prompt_ids"] == pl.List(pl.Int32) and out.schema["loss_mask"] == pl.List(pl.Int8)
    assert set(out["token_source"]) == {"engine"}


def test_gamma_and_per_transition_advantage(store):
    out, _ = compile_transitions(CompileConfig(db=store, gamma=0.5, advantage="per-transition"))
    r1 = out.filter(pl.col("rollout_id") == "r1").sort("turn")
    assert r1["return"].to_list() == [0.5, 1.0] and r1["reward"].to_list() == [1.0, 1.0]
    # Members (returns) 0.5, 1.0, 0.0: mean 0.5, sample std 0.5.
    assert sorted(out["advantage"].to_list()) == pytest.approx([-0.5 / (0.5 + EPS), 0.0, 0.5 / (0.5 + EPS)])


def test_agent_selection(store):
    out, account = compile_transitions(CompileConfig(db=store, agents="^A$"))
    assert out.height == 0  # r2's only call is agent B, so t1 keeps one rollout: no variance left
    assert account.excluded["no LLM call of the selected agents"] == 2  # r2 and r8


def test_cli_and_bad_options(store, tmp_path, capsys):
    target = tmp_path / "t.parquet"
    assert main(["compile", "--db", str(store), "--out", str(target)]) == 0
    assert pl.read_parquet(target).height == 3
    assert "3 transitions from 2 of 8 rollouts (1.50 per episode)" in capsys.readouterr().out
    for config, needle in [(dict(gamma=0), "--gamma"), (dict(advantage="x"), "--advantage"),
                           (dict(agents="("), "regular expression")]:
        with pytest.raises(UserError, match=needle):
            CompileConfig(db=store, **config)
    client.write_records(store, "rewards", [{"rollout_id": "r1", "name": "other", "value": 1.0, "source": "function"}])
    with pytest.raises(UserError, match="choose one with --reward"):
        compile_transitions(CompileConfig(db=store))


def test_rewards_on_inner_spans_feed_the_returns_of_their_scope(store):
    first_agent_span = client.query(
        "SELECT trace_id, span_id FROM spans WHERE rollout_id = 'r1' AND name = 'invoke_agent A' "
        "ORDER BY start_ns LIMIT 1", store).to_dicts()[0]
    client.write_records(store, "rewards", [{"rollout_id": "r1", "name": "tool_error", "value": -0.5,
                                             "source": "emitted", **first_agent_span}])
    out, _ = compile_transitions(CompileConfig(db=store, reward="exec", intermediate=["tool_error"]))
    r1 = out.filter(pl.col("rollout_id") == "r1").sort("turn")
    # Received when the first call's agent span ended: only that call is in its scope and before it.
    assert r1["return"].to_list() == [0.5, 1.0]
    # The advantage still comes from the episode reward: unchanged.
    plain, _ = compile_transitions(CompileConfig(db=store, reward="exec"))
    assert r1["advantage"].to_list() == plain.filter(pl.col("rollout_id") == "r1").sort("turn")["advantage"].to_list()


def test_turn_level_term_on_hand_computed_groups():
    from lightning_otel.train.compile import _add_turn_term
    frame = pl.DataFrame({"task_id": ["t"] * 3, "agent": ["A", "A", "B"], "turn": [0, 0, 0],
                          "intermediate": [-1.0, 1.0, 5.0], "advantage": [0.0, 0.0, 1.0]})
    out = _add_turn_term(frame, 0.5)
    # Group (t, A, 0): values -1, 1 -> mean 0, sample std 1.414; z = -0.7071, 0.7071. (t, B, 0) alone: z = 0.
    z = 1 / (math.sqrt(2) + EPS)
    assert out["advantage"].to_list() == pytest.approx([-0.5 * z, 0.5 * z, 1.0])


def test_turn_weight_needs_intermediate_rewards(store):
    with pytest.raises(UserError, match="--intermediate"):
        CompileConfig(db=store, turn_weight=0.1)


def test_merge_turns_on_hand_made_token_records():
    from collections import Counter

    from lightning_otel.train.compile import merge_turns
    base = {"task_id": "t", "attempt": 0, "policy_version": 0, "agent": "A", "reward": 1.0, "return": 1.0,
            "advantage": 0.5, "token_source": "engine"}
    rows = [
        # Turn 1's prompt = turn 0's prompt + completion + a tool result [7, 8]: merges.
        {**base, "rollout_id": "r", "turn": 0, "prompt_ids": [1, 2], "completion_ids": [3, 4],
         "completion_logprobs": [-0.1, -0.2], "loss_mask": [1, 1]},
        {**base, "rollout_id": "r", "turn": 1, "prompt_ids": [1, 2, 3, 4, 7, 8], "completion_ids": [5],
         "completion_logprobs": [-0.3], "loss_mask": [1], "advantage": 0.7},
        # Re-templated history: not an extension.
        {**base, "rollout_id": "r", "turn": 2, "prompt_ids": [1, 9, 9], "completion_ids": [6],
         "completion_logprobs": [-0.4], "loss_mask": [1]},
        # Another agent.
        {**base, "rollout_id": "r", "turn": 3, "agent": "B", "prompt_ids": [1, 9, 9, 6], "completion_ids": [2],
         "completion_logprobs": [-0.5], "loss_mask": [1]},
    ]
    frame = pl.DataFrame(rows).with_columns(pl.col("prompt_ids").cast(pl.List(pl.Int32)),
                                            pl.col("completion_ids").cast(pl.List(pl.Int32)),
                                            pl.col("completion_logprobs").cast(pl.List(pl.Float32)),
                                            pl.col("loss_mask").cast(pl.List(pl.Int8)))
    reasons: Counter = Counter()
    out = merge_turns(frame, reasons).to_dicts()
    assert [r["turn"] for r in out] == [0, 2, 3]
    first = out[0]
    assert first["prompt_ids"] == [1, 2] and first["completion_ids"] == [3, 4, 7, 8, 5]
    assert first["loss_mask"] == [1, 1, 0, 0, 1]
    assert first["completion_logprobs"] == pytest.approx([-0.1, -0.2, 0.0, 0.0, -0.3])
    assert first["advantage"] == 0.7
    assert reasons == {"prompt is not an extension of the previous turn": 1, "different agent": 1}


def test_merge_turns_through_compile_keeps_calls_per_episode(store):
    out, account = compile_transitions(CompileConfig(db=store, merge_turns=True))
    # r1's second prompt does not extend its first in this store ([1, 2, 3] + [10, 11] vs [1, 2, 4]).
    assert account.not_merged == {"prompt is not an extension of the previous turn": 1}
    assert account.llm_calls == 3 and account.transitions == 3 and out.height == 3
