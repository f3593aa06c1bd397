"""Credit assignment and advantages, as DESIGN §4 defines them. Pure functions with hand-checked tests.

Returns. A reward on span s is received when s ends and applies to the transitions of s's scope that
ended before it; scope = the subtree of s's nearest agent/task/node ancestor (the whole rollout when it
has none, or when s is the episode). For transition t,
    G_t = sum over rewards (s, r) that apply to t of gamma**d * r,
d = the number of LLM calls of the rollout that start after t ends and before s ends. The episode reward
is received at the end. With gamma = 1 and the episode reward only, every transition gets R.

Advantages (registry ADVANTAGES; the trainer never branches on the name):
  per-rollout     A = (R - mean) / (std + eps) over the rollouts of one group, the same A for each of a
                  rollout's transitions (the loss then weighs every rollout the same).
  per-transition  the same statistics taken over every transition of the group (Agent Lightning's legacy).
  reinforce_pp    REINFORCE++ (Hu et al. 2025): no groups, one baseline for the whole batch (the round):
                  A = (G - mean) / (std + eps), mean and std over every completion token of the frame (a
                  transition counts its tokens), nothing dropped. This is the sequence-level part, equal to
                  the trainer's per-token advantages with kl = 0; the trainer recomputes it per token with the
                  KL penalty in the rewards (losses.py, TOKEN_RETURNS).
  ppo             PPO with a learned critic: the trainer computes the advantages at update time, by GAE over
                  each rollout's turns with the critic's values (train/losses.py, CRITIC_ADVANTAGES); here the
                  advantage is the return G itself (no baseline), nothing dropped.
Group = (task id, policy version). std is the sample standard deviation (n - 1), as torch.std, TRL and
verl compute it. A group whose rewards do not vary gives no gradient: it is dropped and counted (not under
reinforce_pp, whose batch baseline gives such a group a non-zero advantage).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import polars as pl

EPS = 1e-6
END = math.inf


@dataclass(frozen=True)
class Call:
    """One LLM call of a rollout: when it ran, and the ids of the spans it sits under (its ancestors)."""

    start_ns: int
    end_ns: int
    ancestors: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Reward:
    """A reward: its value, when it was received (its span's end; END for the episode) and its scope
    (the span id of the target's nearest agent/task/node ancestor; None for the whole rollout)."""

    value: float
    received_ns: float = END
    scope: str | None = None


def discounted_returns(calls: list[Call], rewards: list[Reward], gamma: float = 1.0) -> list[float]:
    """G_t for each call, in the order given."""
    starts = sorted(c.start_ns for c in calls)
    out = []
    for call in calls:
        total = 0.0
        for reward in rewards:
            if call.end_ns > reward.received_ns:
                continue  # received before this call ended: it was about earlier work
            if reward.scope is not None and reward.scope not in call.ancestors:
                continue
            d = sum(1 for s in starts if call.end_ns < s < reward.received_ns)
            total += gamma ** d * reward.value
        out.append(total)
    return out


def _normalise(frame: pl.DataFrame, value: str, by_rollout: bool,
               group: tuple[str, ...] = ("task_id", "policy_version")) -> tuple[pl.DataFrame, int]:
    """Add `advantage` from column `value`, normalised within groups (default (task_id, policy_version))
    whose members are rollouts (by_rollout) or transitions. Drops zero-variance groups; returns how many."""
    group = list(group)
    members = frame.unique(subset=["rollout_id"], keep="first") if by_rollout else frame
    stats = members.group_by(group).agg(pl.col(value).mean().alias("_mean"), pl.col(value).std(ddof=1).alias("_std"))
    flat = stats.filter(pl.col("_std").is_null() | (pl.col("_std") == 0)).height
    kept = stats.filter(pl.col("_std") > 0)
    out = frame.join(kept, on=group, how="inner").with_columns(
        ((pl.col(value) - pl.col("_mean")) / (pl.col("_std") + EPS)).alias("advantage"))
    return out.drop(["_mean", "_std"]), flat


def advantage_per_rollout(frame: pl.DataFrame) -> tuple[pl.DataFrame, int]:
    """A from the episode reward R (column `reward`), each rollout one member of its group, whatever its
    number of turns; every transition of a rollout gets its rollout's A."""
    return _normalise(frame, "reward", by_rollout=True)


def advantage_per_transition(frame: pl.DataFrame) -> tuple[pl.DataFrame, int]:
    """Agent Lightning's legacy statistics: every transition (its return G_t) is a member of its group."""
    return _normalise(frame, "return", by_rollout=False)


def advantage_with_batch_baseline(frame: pl.DataFrame) -> tuple[pl.DataFrame, int]:
    """Offline data without task groups: rollouts that share a (task, policy version) group with others get
    the per-rollout advantage; a rollout alone in its group is normalised against all such lone rollouts
    (a batch baseline: (R - batch mean) / (batch std + eps))."""
    sizes = frame.group_by("task_id", "policy_version").agg(pl.col("rollout_id").n_unique().alias("_members"))
    sized = frame.join(sizes, on=["task_id", "policy_version"])
    grouped, flat = _normalise(sized.filter(pl.col("_members") > 1), "reward", by_rollout=True)
    alone, flat_alone = _normalise(sized.filter(pl.col("_members") == 1), "reward", by_rollout=True,
                                   group=("_members",))
    return pl.concat([grouped, alone]).drop("_members"), flat + flat_alone


def advantage_reinforce_pp(frame: pl.DataFrame) -> tuple[pl.DataFrame, int]:
    """REINFORCE++'s global batch baseline over the frame (the round), no groups: the mean and sample std of
    the return G over every completion token, each transition counting its `completion_len` tokens (one when
    the frame has no lengths), so that with kl = 0 this is the trainer's per-token advantage. None is dropped:
    a group whose rewards agree still differs from the batch mean."""
    tokens = pl.col("completion_len") if "completion_len" in frame.columns else pl.lit(1)
    weighted = frame.with_columns(tokens.cast(pl.Float64).alias("_w"))
    w, g = pl.col("_w"), pl.col("return")
    mean = (w * g).sum() / w.sum()
    spread = ((w * (g - mean) ** 2).sum() / (w.sum() - 1)).sqrt()
    std = pl.when(w.sum() > 1).then(spread).otherwise(0.0)  # one token: no spread, advantage 0
    return weighted.with_columns(((g - mean) / (std + EPS)).alias("advantage")).drop("_w"), 0


def advantage_return(frame: pl.DataFrame) -> tuple[pl.DataFrame, int]:
    """A = G: no baseline and no groups (PPO's critic supplies the baseline when the trainer updates)."""
    return frame.with_columns(pl.col("return").alias("advantage")), 0


def advantage_none(frame: pl.DataFrame) -> tuple[pl.DataFrame, int]:
    """No advantage (0) and no group filtering: for supervised selection of trajectories by reward."""
    return frame.with_columns(pl.lit(0.0).alias("advantage")), 0


ADVANTAGES: dict[str, Callable[[pl.DataFrame], tuple[pl.DataFrame, int]]] = {
    "per-rollout": advantage_per_rollout,
    "per-transition": advantage_per_transition,
    "batch-baseline": advantage_with_batch_baseline,
    "reinforce-pp": advantage_reinforce_pp,
    "ppo": advantage_return,
    "none": advantage_none,
}
# Spellings of earlier releases, accepted for one more release with a deprecation message.
ADVANTAGE_ALIASES = {"reinforce_pp": "reinforce-pp"}


def advantage_name(name: str, warn: Callable[[str], None] | None = None) -> str:
    """The registered spelling of an advantage name (an earlier release's spelling is mapped, with a warning)."""
    if name in ADVANTAGE_ALIASES:
        if warn is not None:
            warn(f"advantage {name!r} is spelled {ADVANTAGE_ALIASES[name]!r} now; the old spelling goes in the next "
                 f"release")
        return ADVANTAGE_ALIASES[name]
    return name
