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
from lightning_otel.train.transitions.compile import CompileConfig, compile_transitions
from lightning_otel.train.transitions.credit import EPS
from lightning_otel.train.transitions.trajectories import TOKEN_MISMATCH
from tests.helpers.sdk import tracer_provider

# rollout -> (task, status, reward, [(agent, has token record)] )
ROLLOUTS = {
    "r1": ("t1", "ok", 1.0, [("A", True), ("A", True)]),
    "r2": ("t1", "ok", 0.0, [("BA", True)]),
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
    assert dict(account.excluded) == {"rollout failed": 1, "no reward": 1, "no LLM call": 1, "zero-variance group": 2,
                                      "LLM call without a token record (no tokenizer to re-tokenise it with: give "
                                      "--tokenizer)": 1}
    assert account.zero_variance_groups == 1  # t2 (t3 has no rollout left)
    assert account.transitions_per_episode == 1.5
    r1 = out.filter(pl.col("rollout_id") == "r1").sort("turn").to_dicts()
    assert [(t["turn"], t["agent"], t["agent_path"], t["prompt_ids"], t["completion_ids"], t["loss_mask"])
            for t in r1] == [(0, "A", "A", [1, 2, 3], [10, 11], [1, 1]), (1, "A", "A", [1, 2, 4], [11, 11], [1, 1])]
    assert r1[0]["completion_logprobs"] == [-0.5, -0.25]
    expected = 0.5 / (math.sqrt(0.5) + EPS)
    assert [t["advantage"] for t in r1] == pytest.approx([expected, expected])
    assert out.filter(pl.col("rollout_id") == "r2")["advantage"].to_list() == pytest.approx([-expected])
    assert out.schema["prompt_ids"] == pl.List(pl.Int32) and out.schema["loss_mask"] == pl.List(pl.Int8)
    assert set(out["token_source"]) == {"engine"}


def test_compiling_chosen_rollouts_accounts_for_them_alone(store):
    out, account = compile_transitions(CompileConfig(db=store, rollout_ids=frozenset({"r1", "r2", "r5", "r6"})))
    assert sorted(out["rollout_id"].unique().to_list()) == ["r1", "r2"]
    assert account.rollouts == 4 and dict(account.excluded) == {"rollout failed": 1, "no reward": 1}
    everything, _ = compile_transitions(CompileConfig(db=store))
    assert out.sort("rollout_id", "turn")["advantage"].to_list() == \
        everything.sort("rollout_id", "turn")["advantage"].to_list()  # same groups, same credit
    assert compile_transitions(CompileConfig(db=store, rollout_ids=frozenset()))[0].height == 0


def test_reinforce_pp_keeps_the_zero_variance_group_and_uses_one_batch_baseline(store):
    out, account = compile_transitions(CompileConfig(db=store, advantage="reinforce-pp"))
    assert sorted(out["rollout_id"].unique().to_list()) == ["r1", "r2", "r3", "r4"]  # t2 (r3, r4 both 1) kept
    assert account.zero_variance_groups == 0 and "zero-variance group" not in account.excluded
    # Five transitions of two tokens, returns 1 1 0 1 1: tokens mean 0.8, sample variance (8 * 0.04 + 2 * 0.64) / 9.
    std = math.sqrt(1.6 / 9) + EPS
    by_rollout = {r["rollout_id"]: r["advantage"] for r in out.to_dicts()}
    assert by_rollout == pytest.approx({"r1": 0.2 / std, "r2": -0.8 / std, "r3": 0.2 / std, "r4": 0.2 / std})

def test_gamma_and_per_transition_advantage(store):
    out, _ = compile_transitions(CompileConfig(db=store, gamma=0.5, advantage="per-transition"))
    r1 = out.filter(pl.col("rollout_id") == "r1").sort("turn")
    assert r1["return"].to_list() == [0.5, 1.0] and r1["reward"].to_list() == [1.0, 1.0]
    # Members (returns) 0.5, 1.0, 0.0: mean 0.5, sample std 0.5.
    assert sorted(out["advantage"].to_list()) == pytest.approx([-0.5 / (0.5 + EPS), 0.0, 0.5 / (0.5 + EPS)])


@pytest.mark.parametrize("pattern", ["A", "^A$", "A|C"])
def test_agent_selection(store, pattern):
    # The pattern matches whole agent names: "A" is not "BA" (as write_query is not rewrite_query).
    out, account = compile_transitions(CompileConfig(db=store, agents=pattern))
    assert out.height == 0  # r2's only call is agent BA, so t1 keeps one rollout: no variance left
    assert account.excluded["no LLM call of the selected agents"] == 2  # r2 and r8


def test_agent_selection_pattern_can_match_several_agents(store):
    out, _ = compile_transitions(CompileConfig(db=store, agents=".*A"))  # A and BA
    assert sorted(out["rollout_id"].unique().to_list()) == ["r1", "r2"]


def test_cli_and_bad_options(store, tmp_path, capsys):
    target = tmp_path / "t.parquet"
    assert main(["compile", "--db", str(store), "--out", str(target)]) == 0  # the bundled tokenizer by default
    assert pl.read_parquet(target).height == 3
    printed = capsys.readouterr().out
    assert "3 transitions from 2 of 8 rollouts (1.50 per episode)" in printed
    # r7's second call has neither a token record nor recorded messages to re-tokenise.
    assert "excluded: 1 rollout(s): LLM call without a token record and no recorded messages to re-tokenise" \
        in printed
    assert main(["compile", "--db", str(store), "--out", str(target), "--tokenizer", "none"]) == 0
    assert "LLM call without a token record (no tokenizer to re-tokenise it with: give --tokenizer)" in \
        capsys.readouterr().out
    for config, needle in [(dict(gamma=0), "gamma = 0"), (dict(advantage="x"), "advantage 'x'"),
                           (dict(agents="("), "regular expression"), (dict(max_length=1), "max_length = 1"),
                           (dict(model=tmp_path), "no tokenizer there"), (dict(drift=True), "drift needs")]:
        with pytest.raises(UserError, match=needle):
            CompileConfig(db=store, **config)
    client.write_records(store, "rewards", [{"rollout_id": "r1", "name": "other", "value": 1.0, "source": "function"}])
    with pytest.raises(UserError, match="choose one"):
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
    from lightning_otel.train.transitions.compile import _add_turn_term
    frame = pl.DataFrame({"task_id": ["t"] * 3, "agent": ["A", "A", "B"], "turn": [0, 0, 0],
                          "intermediate": [-1.0, 1.0, 5.0], "advantage": [0.0, 0.0, 1.0]})
    out = _add_turn_term(frame, 0.5)
    # Group (t, A, 0): values -1, 1 -> mean 0, sample std 1.414; z = -0.7071, 0.7071. (t, B, 0) alone: z = 0.
    z = 1 / (math.sqrt(2) + EPS)
    assert out["advantage"].to_list() == pytest.approx([-0.5 * z, 0.5 * z, 1.0])


def test_turn_weight_needs_intermediate_rewards(store):
    with pytest.raises(UserError, match="intermediate"):
        CompileConfig(db=store, turn_weight=0.1)


def test_merge_turns_on_hand_made_token_records():
    from collections import Counter

    from lightning_otel.train.transitions.compile import merge_turns
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


def test_the_transitions_view_agrees_with_compile(store):
    client.write_records(store, "rewards", [{"rollout_id": r, "name": "fmt", "value": v, "source": "function"}
                                            for r, v in [("r1", 0.5), ("r2", 0.5), ("r3", 0.0), ("r4", 1.0)]])
    view = client.query("SELECT * FROM transitions ORDER BY reward_name, task_id, rollout_id, turn", store)
    assert sorted(set(view["reward_name"])) == ["exec", "fmt"]
    for name in ("exec", "fmt"):
        compiled, _ = compile_transitions(CompileConfig(db=store, reward=name))
        compiled = compiled.sort(["task_id", "rollout_id", "turn"])  # rows come in the store's record order
        mine = view.filter(pl.col("reward_name") == name).drop("reward_name")
        assert mine.schema == compiled.schema
        assert mine.to_dicts() == compiled.to_dicts(), name
    # fmt: t1 (r1, r2) has no variance, t2 (r3, r4) has.
    assert sorted(view.filter(pl.col("reward_name") == "fmt")["rollout_id"].unique()) == ["r3", "r4"]


def test_over_length_and_inconsistent_token_records(store, collector):
    _, account = compile_transitions(CompileConfig(db=store, max_length=4))  # every call has 3 + 2 tokens
    assert account.excluded["over length (a call has more than 4 prompt + completion tokens)"] == 4
    assert account.compiled_rollouts == 0
    provider = tracer_provider(collector.url)
    tracer = provider.get_tracer("agent")
    ids = {"lightning.rollout.id": "r9"}
    with tracer.start_as_current_span("openai.chat", attributes={**ids, "gen_ai.operation.name": "chat"}):
        with tracer.start_as_current_span("lightning.generate", attributes={
                **ids, "lightning.choice.index": 0, "lightning.prompt.token_ids": [1, 2],
                "lightning.completion.token_ids": [3, 4], "lightning.completion.logprobs": [-0.5]}):
            pass
    provider.shutdown()
    client.write_records(store, "rollout_runs", [{"rollout_id": "r9", "task_id": "t1", "attempt": 1, "status": "ok"}])
    client.write_records(store, "rewards", [{"rollout_id": "r9", "name": "exec", "value": 1.0, "source": "function"}])
    out, account = compile_transitions(CompileConfig(db=store))
    assert account.excluded[TOKEN_MISMATCH] == 1 and "r9" not in out["rollout_id"].to_list()
    assert "r9" not in client.query("SELECT rollout_id FROM transitions", store)["rollout_id"].to_list()


@pytest.mark.parametrize("chosen, says", [
    ({"r3", "r4"}, "every rollout excluded for: zero-variance group. Each task's rollouts all got the same reward"),
    ({"r6"}, "every rollout excluded for: no reward. No rollout has a 'exec' reward"),
    ({"r3", "r4", "r6"}, "the most common, for 2 of 3 rollouts, is: zero-variance group. Each task's"),
    ({"r8"}, "every rollout excluded for: no LLM call. No LLM call spans were recorded"),
    ({"nothing"}, "the store holds no rollouts"),
])
@pytest.mark.heavy
def test_no_transitions_says_why_and_what_to_try(store, chosen, says):
    out, account = compile_transitions(CompileConfig(db=store, reward="exec", rollout_ids=frozenset(chosen)))
    assert out.height == 0
    assert says in account.why_none("exec")


def test_compile_without_transitions_prints_no_nan(store, tmp_path, capsys):
    assert main(["compile", "--db", str(store), "--reward", "other", "--tokenizer", "none",
                 "--out", str(tmp_path / "t.parquet")]) == 0
    printed = capsys.readouterr().out
    assert "0 transitions from 0 of 8 rollouts ->" in printed and "nan" not in printed
    assert ("no transitions: the exclusions are above; the most common, for 7 of 8 rollouts, is: no reward. No "
            "rollout has a 'other' reward") in printed
