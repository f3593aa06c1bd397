"""Spans -> transitions: per rollout, its LLM calls in order with their gateway token records, a reward,
a return and an advantage (DESIGN §4, §7). Vectorised: SQL in the store, then Polars.

    lightning-otel compile --db traces.duckdb --out transitions.parquet --reward spider_exec

Every rollout ends in the output or in `Accounting.excluded` with its reason; a rollout without a reward
is never given 0. The episode reward (`--reward`) drives the advantage. Rewards on inner spans
(`--intermediate NAME`, e.g. emitted on a failed tool call) add to the returns G_t of the transitions in
their scope (credit.discounted_returns), and with `--turn-weight` lambda > 0 give the turn-level term
A_t = A + lambda * z_t, z_t their return normalised within (task, agent, turn) groups.

Trajectories come from trajectories.py (the store's trajectory_calls view: duplicated LLM spans removed,
agent paths, token records). Calls without a token record are re-tokenised from their recorded messages
when a tokenizer is given (`--model`; token_source='retokenized', completion_logprobs = [], so the trainer
must compute their old logprobs itself: retokenize.py), else their rollouts are excluded with the reason.
With the defaults the result equals the store's `transitions` view for the chosen reward name. Rows come
in the order the store holds the token records (deterministic; not sorted: reordering the token lists
would copy them, benchmarks/RESULTS.md), so sort by (task_id, rollout_id, turn) when order matters.
"""
from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from lightning_otel.errors import UserError
from lightning_otel.serve.adapters import agent_regex
from lightning_otel.serve.chat_tools import read_chat_template
from lightning_otel.serve.toolcalls import tool_format
from lightning_otel.span_store import client
from lightning_otel.train.transitions import trajectories
from lightning_otel.train.transitions.credit import ADVANTAGES, EPS, Call, Reward, advantage_name, discounted_returns
from lightning_otel.train.transitions.record import check_transitions
from lightning_otel.train.transitions.retokenize import Drift
from lightning_otel.train.transitions.trajectories import (SQL_CALLS, SQL_COMPUTED_EPISODE_REWARDS, SQL_EPISODE_REWARDS,
                                                           SQL_REWARD_NAMES, SQL_ROLLOUTS, attach_tokens)

# Rewards on inner spans: when each was received (its target's end) and its scope, the target's nearest
# agent/task/node span, the target itself included (a reward on a sub-agent's span is about that sub-agent).
SQL_INTERMEDIATE = """
WITH RECURSIVE targets AS (
    SELECT r.rollout_id, r.value, r.trace_id, r.span_id FROM rewards r JOIN spans s
        ON s.trace_id = r.trace_id AND s.span_id = r.span_id
    WHERE r.name IN ($names) AND s.name <> 'lightning.rollout' AND s.parent_span_id IS NOT NULL
),
up(rollout_id, value, trace_id, target, span_id, depth) AS (
    SELECT rollout_id, value, trace_id, span_id, span_id, 0 FROM targets
    UNION ALL
    SELECT up.rollout_id, up.value, up.trace_id, up.target, s.parent_span_id, up.depth + 1
    FROM up JOIN spans s ON s.trace_id = up.trace_id AND s.span_id = up.span_id
    WHERE s.parent_span_id IS NOT NULL AND up.depth < 64
)
SELECT up.rollout_id, up.target, any_value(up.value) AS value, any_value(t.end_ns) AS received_ns,
       arg_min(up.span_id, up.depth) FILTER (WHERE s.agent_name IS NOT NULL) AS scope
FROM up JOIN spans s ON s.trace_id = up.trace_id AND s.span_id = up.span_id
JOIN spans t ON t.trace_id = up.trace_id AND t.span_id = up.target
GROUP BY up.rollout_id, up.target
"""
SQL_CALL_ANCESTORS = "SELECT trace_id, call_span_id AS span_id, list(ancestor_span_id) AS ancestors " \
                     "FROM call_ancestors GROUP BY ALL"

log = logging.getLogger(__name__)


@dataclass
class CompileConfig:
    db: Path
    reward: str | None = None
    # False: the episode reward is only ever one a reward function computed (the trainer's setting), never one
    # the agent emitted under that name, so an agent cannot reward itself.
    emitted_rewards: bool = True
    gamma: float = 1.0
    advantage: str = "per-rollout"
    agents: str | None = None          # regex over whole agent names (write_query is not rewrite_query)
    intermediate: list[str] = field(default_factory=list)
    turn_weight: float = 0.0
    merge_turns: bool = False
    # Tokenizer for calls without a token record: a model folder, "bundled", or None (such rollouts are
    # then excluded, with the reason).
    model: Path | str | None = None
    chat_template: Path | None = None  # the Jinja file the gateway rendered with (its chat_template), if one
    tool_format: str | None = None  # the gateway's call syntax, if named (None: detected from the template)
    max_length: int | None = None  # prompt + completion tokens; a rollout with a longer call is excluded
    drift: bool = False  # also re-tokenise calls that have a token record and report the difference
    # Compile only these rollouts (a training round's): the accounting is then theirs, and the work does not
    # grow with the store. None: every rollout in the store.
    rollout_ids: frozenset[str] | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.gamma <= 1.0:
            raise UserError(f"gamma = {self.gamma}: must be in (0, 1]")
        self.advantage = advantage_name(self.advantage, log.warning)
        if self.advantage not in ADVANTAGES:
            raise UserError(f"advantage {self.advantage!r}: choose one of {sorted(ADVANTAGES)}")
        if self.turn_weight < 0:
            raise UserError(f"turn_weight = {self.turn_weight}: must be >= 0")
        if self.turn_weight and not self.intermediate:
            raise UserError("turn_weight needs intermediate rewards to weigh (name them in intermediate)")
        if self.max_length is not None and self.max_length < 2:
            raise UserError(f"max_length = {self.max_length}: must be at least 2 tokens")
        if self.drift and self.model is None:
            raise UserError("drift needs the model's tokenizer: give model (compile --tokenizer)")
        if self.model is not None and str(self.model) not in ("bundled", "base"):
            folder = Path(self.model).expanduser()
            if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer_config.json").is_file():
                raise UserError(f"model = {self.model}: no tokenizer there (tokenizer.json / tokenizer_config.json); "
                                f"give a Hugging Face model folder, or 'bundled'")
        if self.tool_format is not None:
            tool_format(self.tool_format)  # an unknown name lists the known ones
        if self.chat_template is not None:
            self.chat_template = Path(self.chat_template)
            if not self.chat_template.is_file():
                raise UserError(f"chat_template {self.chat_template}: no such file; give the Jinja chat template file "
                                f"the gateway rendered with")
        if self.agents is not None:
            try:
                re.compile(agent_regex(self.agents))
            except re.error as exc:
                raise UserError(f"agents = {self.agents!r} is not a regular expression: {exc}") from None


@dataclass
class Accounting:
    rollouts: int = 0
    compiled_rollouts: int = 0
    transitions: int = 0
    llm_calls: int = 0
    excluded: Counter = field(default_factory=Counter)  # reason -> rollouts
    zero_variance_groups: int = 0
    not_merged: Counter = field(default_factory=Counter)  # with --merge-turns: reason -> turn pairs
    duplicate_calls: int = 0  # LLM spans that recorded a request another span already stands for (store-wide)
    retokenized_calls: int = 0  # calls given ids from their recorded messages (token_source='retokenized')
    drift: Drift | None = None  # with --drift

    @property
    def transitions_per_episode(self) -> float:
        return self.llm_calls / self.compiled_rollouts if self.compiled_rollouts else float("nan")

    def why_none(self, reward: str | None) -> str | None:
        """With no transition compiled: why, and what to try (None when there are some)."""
        if self.transitions:
            return None
        if not self.rollouts:
            return ("the store holds no rollouts (or none of those chosen): run the agent under `lightning-otel "
                    "run` or `rollout` first, and check --db")
        reason, count = self.excluded.most_common(1)[0]
        share = ("every rollout" if count == self.rollouts
                 else f"the exclusions are above; the most common, for {count} of {self.rollouts} rollouts, is")
        if count == self.rollouts:
            share += " excluded for"
        tries = next((advice for key, advice in _EMPTY_ADVICE.items() if reason.startswith(key)),
                     "see the exclusions above")
        return f"{share}: {reason}. " + tries.replace("$reward", repr(reward or "the reward"))


# What to try when compile's main exclusion is one of these (its reason, up to its first variable part).
_EMPTY_ADVICE = {
    "zero-variance group": "Each task's rollouts all got the same reward, so every advantage is zero: sample more "
                           "rollouts per task (-n), use a shaped reward that tells better from worse, keep the "
                           "tasks the policy sometimes solves (train's pool filter), or try --advantage "
                           "batch-baseline or reinforce-pp, which compare across tasks",
    "no reward": "No rollout has a $reward reward: check the name (--reward; `lightning-otel sql \"SELECT DISTINCT "
                 "name FROM rewards\"` lists the stored ones), or score the rollouts (rollout --reward, "
                 "emit_reward() in the agent)",
    "no LLM call": "No LLM call spans were recorded: run the agent under opentelemetry-instrument with the "
                   "instrumentation of its LLM client installed (docs/capture.md), or check --agents",
    "no task id": "Advantages compare rollouts of one task: run the agent through `lightning-otel rollout` or "
                  "`run --task-id`",
    "rollout ": "The agent runs did not end ok: each one's error and output tails are in the store (`lightning-otel "
                "sql \"SELECT status, error_class, stderr_tail FROM rollout_runs\"`); fix the agent, or raise "
                "--rollout-timeout",
    "LLM call without a token record": "Send the agent's calls through the gateway (rollout does), or give "
                                      "--tokenizer to re-tokenise them",
    "over length": "Raise --max-length, or shorten the agent's prompts",
    "answered by an outside model": "Rollouts against an outside endpoint (base_url) serve prompt optimisation and "
                                    "evaluation only: to train, run the agent on the policy served here (train, or "
                                    "rollout without --base-url), with the same --prompt if you optimised one",
}


def _reward_name(config: CompileConfig, read: trajectories.Read) -> str:
    if config.reward:
        return config.reward
    names = read(SQL_REWARD_NAMES)
    if names.height == 1:
        return names["name"][0]
    if names.height == 0:
        raise UserError("the store has no rewards yet: run rollouts with a reward function, or emit_reward() in "
                        "the agent")
    raise UserError(f"several rewards are stored ({', '.join(names['name'].to_list())}): choose one (reward; "
                    f"compile --reward)")


def compile_transitions(config: CompileConfig) -> tuple[pl.DataFrame, Accounting]:
    with client.reading(config.db) as read:
        return _compile(config, read)


def _compile(config: CompileConfig, read: trajectories.Read) -> tuple[pl.DataFrame, Accounting]:
    name = _reward_name(config, read)
    rollouts = read(SQL_ROLLOUTS)
    calls = read(SQL_CALLS)
    episode_rewards = SQL_EPISODE_REWARDS if config.emitted_rewards else SQL_COMPUTED_EPISODE_REWARDS
    rewards = read(episode_rewards.replace("$name", client.sql_literal(name)))
    if config.rollout_ids is not None:
        chosen = pl.col("rollout_id").is_in(sorted(config.rollout_ids))
        rollouts, calls = rollouts.filter(chosen), calls.filter(chosen)
    account = Accounting(rollouts=rollouts.height, duplicate_calls=int(calls["duplicates"].sum() or 0))

    def exclude(frame: pl.DataFrame, reason: str) -> None:
        if frame.height:
            account.excluded[reason] += frame.height

    # Outcome of the agent process, when the runner recorded one.
    failed = rollouts.filter(pl.col("status").is_not_null() & (pl.col("status") != "ok"))
    for status, group in failed.group_by("status"):
        exclude(group, f"rollout {status[0]}")
    live = rollouts.filter(pl.col("status").is_null() | (pl.col("status") == "ok"))
    exclude(live.filter(pl.col("task_id").is_null()), "no task id (advantages compare rollouts of one task)")
    live = live.filter(pl.col("task_id").is_not_null())
    with_reward = live.join(rewards, on="rollout_id", how="left")
    exclude(with_reward.filter(pl.col("reward").is_null()), "no reward")
    with_reward = with_reward.filter(pl.col("reward").is_not_null())

    calls = calls.with_columns(pl.len().over("rollout_id").alias("_calls"),  # before any agent selection
                               pl.col("generation_version").min().over("rollout_id").alias("_record_version"))
    if config.agents is not None:
        calls = calls.filter(pl.col("agent").fill_null("").str.contains(agent_regex(config.agents)))  # whole name
    has_calls = with_reward.join(calls.select("rollout_id").unique(), on="rollout_id", how="semi")
    exclude(with_reward.join(has_calls, on="rollout_id", how="anti"),
            "no LLM call" if config.agents is None else "no LLM call of the selected agents")
    template = read_chat_template(config.chat_template) if config.chat_template is not None else None
    tokens = attach_tokens(calls.join(has_calls.select("rollout_id"), on="rollout_id", how="semi"),
                           read, config.model, template, config.tool_format)
    account.retokenized_calls = tokens.retokenized
    for (reason,), group in tokens.excluded.group_by("reason"):
        exclude(group, reason)
    kept = has_calls.join(tokens.excluded, on="rollout_id", how="anti")
    calls = tokens.calls
    if config.max_length is not None:
        long = calls.filter(pl.col("prompt_len") + pl.col("completion_len") > config.max_length)
        over = kept.join(long.select("rollout_id").unique(), on="rollout_id", how="semi")
        exclude(over, f"over length (a call has more than {config.max_length} prompt + completion tokens)")
        kept = kept.join(over, on="rollout_id", how="anti")
    if config.drift:
        account.drift = trajectories.drift(read, config.model, template, config.tool_format)

    # Credit on the calls without their token lists; the lists are joined once, to the final rows.
    steps = (calls.join(kept, on="rollout_id", how="inner")
             # One version per rollout: the runner's, else the lowest of its token records (groups need one).
             .with_columns(pl.coalesce("policy_version", "_record_version").fill_null(0).alias("policy_version"))
             # Episode reward received at the end: d = calls after this one.
             .with_columns((pl.col("reward") * pl.lit(config.gamma) ** (pl.col("_calls") - 1 - pl.col("turn")))
                           .alias("return")))
    if config.intermediate:
        steps = _add_intermediate_returns(steps, config, read)
    with_advantage, account.zero_variance_groups = ADVANTAGES[config.advantage](steps)
    if config.turn_weight:
        with_advantage = _add_turn_term(with_advantage, config.turn_weight)
    flat = steps.join(with_advantage.select("rollout_id").unique(), on="rollout_id", how="anti")
    exclude(flat.select("rollout_id").unique(), "zero-variance group")
    out = trajectories.join_lists(with_advantage, tokens.lists).select(
        "rollout_id", "task_id", pl.col("attempt").cast(pl.Int64), pl.col("policy_version").cast(pl.Int64), "agent",
        "agent_path", pl.col("turn").cast(pl.Int32),
        pl.col("prompt_ids").cast(pl.List(pl.Int32)), pl.col("completion_ids").cast(pl.List(pl.Int32)),
        pl.col("completion_logprobs").cast(pl.List(pl.Float32)),
        pl.col("completion_ids").list.eval(pl.lit(1, dtype=pl.Int8)).alias("loss_mask"),
        pl.col("reward").cast(pl.Float64), pl.col("return").cast(pl.Float64), pl.col("advantage").cast(pl.Float64),
        "token_source",
    )
    account.compiled_rollouts = out["rollout_id"].n_unique()
    account.llm_calls = out.height  # transitions per episode counts LLM calls, before any merging
    if config.merge_turns:
        out = merge_turns(out, account.not_merged)
    account.transitions = out.height
    return check_transitions(out), account


def merge_turns(frame: pl.DataFrame, not_merged: Counter) -> pl.DataFrame:
    """Merge consecutive turns of a rollout when one turn's prompt + completion is an exact prefix of the
    next turn's prompt: one sample whose completion is the first completion, then the tokens between
    (tool results, template tokens: loss_mask 0, logprob 0) and the next completion (loss_mask 1). The
    merged sample keeps the first turn's index and the last turn's reward, return and advantage.
    Pairs that cannot merge are counted by reason in `not_merged`."""
    rows = frame.sort(["rollout_id", "turn"]).to_dicts()
    merged: list[dict] = []
    for row in rows:
        last = merged[-1] if merged else None
        if last is None or last["rollout_id"] != row["rollout_id"]:
            merged.append(dict(row))
            continue
        reason = _merge_blocker(last, row)
        if reason:
            not_merged[reason] += 1
            merged.append(dict(row))
            continue
        seen = len(last["prompt_ids"]) + len(last["completion_ids"])
        gap = row["prompt_ids"][seen:]
        last["completion_ids"] = last["completion_ids"] + gap + row["completion_ids"]
        if last["token_source"] == "engine":  # re-tokenised samples have no logprobs to extend: they stay []
            last["completion_logprobs"] = last["completion_logprobs"] + [0.0] * len(gap) + row["completion_logprobs"]
        last["loss_mask"] = last["loss_mask"] + [0] * len(gap) + row["loss_mask"]
        for key in ("reward", "return", "advantage"):
            last[key] = row[key]
    return pl.DataFrame(merged, schema=frame.schema)


def _merge_blocker(previous: dict, current: dict) -> str | None:
    if previous["agent"] != current["agent"]:
        return "different agent"
    if previous["token_source"] != current["token_source"]:
        return "different token source (engine and re-tokenised)"
    context = previous["prompt_ids"] + previous["completion_ids"]
    if current["prompt_ids"][:len(context)] != context:
        return "prompt is not an extension of the previous turn"
    return None


def _add_intermediate_returns(steps: pl.DataFrame, config: CompileConfig, read: trajectories.Read) -> pl.DataFrame:
    """Add the discounted returns of rewards on inner spans to `return`, and keep them as `intermediate`.
    Per rollout that has such rewards (few); the rest of the pipeline stays vectorised."""
    names = ", ".join(client.sql_literal(n) for n in config.intermediate)
    rewards = read(SQL_INTERMEDIATE.replace("$names", names))
    ancestors = read(SQL_CALL_ANCESTORS)
    steps = steps.join(ancestors, on=["trace_id", "span_id"], how="left")
    parts = []
    for (rollout_id,), group in steps.group_by("rollout_id", maintain_order=True):
        mine = rewards.filter(pl.col("rollout_id") == rollout_id)
        values = [0.0] * group.height
        if mine.height:
            calls = [Call(r["start_ns"], r["end_ns"], frozenset(r["ancestors"] or ()))
                     for r in group.select("start_ns", "end_ns", "ancestors").to_dicts()]
            values = discounted_returns(calls, [Reward(r["value"], r["received_ns"], r["scope"])
                                                for r in mine.to_dicts()], config.gamma)
        parts.append(group.with_columns(pl.Series("intermediate", values, dtype=pl.Float64)))
    out = pl.concat(parts) if parts else steps.with_columns(pl.lit(0.0).alias("intermediate"))
    return out.with_columns((pl.col("return") + pl.col("intermediate")).alias("return")).drop("ancestors")


def _add_turn_term(frame: pl.DataFrame, weight: float) -> pl.DataFrame:
    """A_t += lambda * z_t, z_t = the intermediate return normalised within (task, agent, turn) groups;
    a group without variance contributes 0."""
    keys = ["task_id", "agent", "turn"]
    z = ((pl.col("intermediate") - pl.col("intermediate").mean().over(keys))
         / (pl.col("intermediate").std(ddof=1).over(keys) + EPS))
    return frame.with_columns((pl.col("advantage") + weight * z.fill_nan(0.0).fill_null(0.0)).alias("advantage"))
