"""Credit and advantage functions against hand-computed numbers (DESIGN §4)."""
from __future__ import annotations

import math

import polars as pl
import pytest

from lightning_otel.train.transitions.credit import (ADVANTAGES, END, EPS, Call, Reward, advantage_per_rollout,
                                         advantage_per_transition, discounted_returns)

# Three calls of one rollout, the first two under agent span "A", the third under "B".
CALLS = [Call(0, 10, frozenset({"A", "root"})), Call(20, 30, frozenset({"A", "root"})),
         Call(40, 50, frozenset({"B", "root"}))]


def test_episode_reward_reaches_every_transition_with_gamma_one():
    assert discounted_returns(CALLS, [Reward(1.0)]) == [1.0, 1.0, 1.0]


def test_episode_reward_is_discounted_by_later_calls():
    # d = calls starting after t ends: 2, 1, 0.
    assert discounted_returns(CALLS, [Reward(1.0)], gamma=0.5) == [0.25, 0.5, 1.0]


def test_a_scoped_reward_applies_to_its_scope_before_it_was_received():
    # Received at 35 in scope A: applies to calls 0 and 1 (ended before 35, under A), not to call 2.
    scoped = Reward(-1.0, received_ns=35, scope="A")
    assert discounted_returns(CALLS, [scoped]) == [-1.0, -1.0, 0.0]
    # With gamma 0.5: call 0 has one call (20..30) starting after it and before 35 -> 0.5.
    assert discounted_returns(CALLS, [scoped], gamma=0.5) == [-0.5, -1.0, 0.0]
    # Received at 15: only call 0 had ended.
    assert discounted_returns(CALLS, [Reward(2.0, received_ns=15, scope="A")]) == [2.0, 0.0, 0.0]


def test_rewards_add_up():
    both = [Reward(1.0), Reward(-0.5, received_ns=35, scope="A")]
    assert discounted_returns(CALLS, both, gamma=0.5) == [0.25 - 0.25, 0.5 - 0.5, 1.0]


def frame(rows):
    return pl.DataFrame(rows, schema=["rollout_id", "task_id", "policy_version", "turn", "reward", "return"],
                        orient="row")


def test_per_rollout_advantage_counts_each_rollout_once():
    # Task t: rollout r1 (R=1, three turns), r2 (R=0, one turn). Rollout mean 0.5, sample std 0.7071.
    data = frame([("r1", "t", 0, 0, 1.0, 1.0), ("r1", "t", 0, 1, 1.0, 1.0), ("r1", "t", 0, 2, 1.0, 1.0),
                  ("r2", "t", 0, 0, 0.0, 0.0)])
    out, flat = advantage_per_rollout(data)
    std = math.sqrt(0.5)
    expected = {"r1": 0.5 / (std + EPS), "r2": -0.5 / (std + EPS)}
    assert flat == 0
    for row in out.to_dicts():
        assert row["advantage"] == pytest.approx(expected[row["rollout_id"]])


def test_per_transition_advantage_is_agent_lightnings_legacy():
    data = frame([("r1", "t", 0, 0, 1.0, 1.0), ("r1", "t", 0, 1, 1.0, 1.0), ("r1", "t", 0, 2, 1.0, 1.0),
                  ("r2", "t", 0, 0, 0.0, 0.0)])
    out, _ = advantage_per_transition(data)
    # Members 1, 1, 1, 0: mean 0.75, sample std 0.5.
    got = sorted(round(v, 6) for v in out["advantage"].to_list())
    assert got == sorted(round(v, 6) for v in [0.25 / (0.5 + EPS)] * 3 + [-0.75 / (0.5 + EPS)])


def test_groups_are_task_and_policy_version_and_flat_groups_are_dropped():
    data = frame([("a", "t", 0, 0, 1.0, 1.0), ("b", "t", 0, 0, 0.0, 0.0),
                  ("c", "t", 1, 0, 1.0, 1.0), ("d", "t", 1, 0, 1.0, 1.0),  # version 1: no variance
                  ("e", "u", 0, 0, 0.5, 0.5)])  # alone in its group
    for name, fn in ADVANTAGES.items():
        if name in ("none", "reinforce-pp", "ppo"):
            continue  # keep everything by definition (supervised selection; a batch baseline; the critic's
            # baseline, tests/test_ppo.py), tested below
        out, flat = fn(data)
        assert sorted(out["rollout_id"].to_list()) == ["a", "b"], name
        assert flat == 2, name


def test_end_is_after_everything():
    assert END > 2**63


def test_batch_baseline_normalises_lone_rollouts_against_each_other_and_groups_within_themselves():
    import polars as pl

    from lightning_otel.train.transitions.credit import ADVANTAGES

    frame = pl.DataFrame({
        "rollout_id": ["g1", "g2", "a", "b", "c", "c"],
        "task_id": ["t", "t", "x", "y", "z", "z"],
        "policy_version": [0, 0, 0, 0, 0, 0],
        "reward": [1.0, 0.0, 1.0, 0.0, 0.5, 0.5],
    })
    out, flat = ADVANTAGES["batch-baseline"](frame)
    adv = dict(zip(out["rollout_id"], out["advantage"]))
    # group t: mean 0.5, sample std 0.7071
    assert adv["g1"] == pytest.approx(0.5 / (0.5 ** 0.5 + 1e-6))
    # lone rollouts a, b, c (c has two turns, counted once): mean 0.5, sample std 0.5
    assert adv["a"] == pytest.approx(0.5 / (0.5 + 1e-6)) and adv["c"] == pytest.approx(0.0)
    assert out.filter(pl.col("rollout_id") == "c").height == 2 and flat == 0


def test_no_advantage_keeps_every_transition():
    import polars as pl

    from lightning_otel.train.transitions.credit import ADVANTAGES

    frame = pl.DataFrame({"rollout_id": ["a"], "task_id": ["t"], "policy_version": [0], "reward": [1.0]})
    out, flat = ADVANTAGES["none"](frame)
    assert out["advantage"].to_list() == [0.0] and flat == 0


def test_reinforce_pp_normalises_over_the_whole_batch_and_keeps_flat_groups():
    # Task t: a (1), b (0); task u: c and d both 1, a group without variance that GRPO would drop. No lengths:
    # every transition counts once. Returns 1, 0, 1, 1: mean 0.75, sample std sqrt(0.75 / 3) = 0.5.
    data = frame([("a", "t", 0, 0, 1.0, 1.0), ("b", "t", 0, 0, 0.0, 0.0),
                  ("c", "u", 0, 0, 1.0, 1.0), ("d", "u", 0, 0, 1.0, 1.0)])
    out, flat = ADVANTAGES["reinforce-pp"](data)
    assert flat == 0 and sorted(out["rollout_id"].to_list()) == ["a", "b", "c", "d"]
    adv = dict(zip(out["rollout_id"], out["advantage"]))
    assert [adv[k] for k in "abcd"] == pytest.approx([0.25 / (0.5 + EPS), -0.75 / (0.5 + EPS),
                                                      0.25 / (0.5 + EPS), 0.25 / (0.5 + EPS)])


def test_reinforce_pp_counts_each_transition_by_its_completion_tokens():
    # Returns 1, 0, 0.5 over 3, 1, 2 tokens: the tokens 1 1 1 0 .5 .5 have mean 2/3 and sample variance
    # (3 * (1/3)^2 + (2/3)^2 + 2 * (1/6)^2) / 5 = (5/6) / 5 = 1/6. The return column is used, not the reward.
    data = pl.DataFrame({"rollout_id": ["a", "b", "c"], "task_id": ["t", "t", "u"], "policy_version": [0, 0, 0],
                         "reward": [9.0, 9.0, 9.0], "return": [1.0, 0.0, 0.5], "completion_len": [3, 1, 2]})
    out, flat = ADVANTAGES["reinforce-pp"](data)
    std = math.sqrt(1 / 6)
    assert flat == 0
    assert out["advantage"].to_list() == pytest.approx([(1 / 3) / (std + EPS), (-2 / 3) / (std + EPS),
                                                        (-1 / 6) / (std + EPS)])
    alone, _ = ADVANTAGES["reinforce-pp"](data.head(1).with_columns(pl.lit(1).alias("completion_len")))
    assert alone["advantage"].to_list() == [0.0]  # one token: no spread
