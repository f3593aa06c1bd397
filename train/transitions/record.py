"""The transition record: one LLM call of a rollout as the learner sees it, from compile to the loss.

compile_transitions returns a Polars frame with exactly TRANSITION_SCHEMA's columns (also the Parquet file of
`lightning-otel compile` and the `transitions` view's shape, docs/schema.md); the learner takes its rows as
Transition dicts (frame.to_dicts()), and REINFORCE++ adds per-token advantages before the loss.
"""
from __future__ import annotations

from typing import NotRequired, TypedDict

import polars as pl

# name -> dtype, in the frame's order.
TRANSITION_SCHEMA: dict[str, pl.DataType] = {
    "rollout_id": pl.String(), "task_id": pl.String(), "attempt": pl.Int64(), "policy_version": pl.Int64(),
    "agent": pl.String(), "agent_path": pl.String(), "turn": pl.Int32(),
    "prompt_ids": pl.List(pl.Int32()),             # the state: the prompt's token ids
    "completion_ids": pl.List(pl.Int32()),         # the action: what the policy generated
    "completion_logprobs": pl.List(pl.Float32()),  # sampling logprobs, aligned with completion_ids ([]: none)
    "loss_mask": pl.List(pl.Int8()),               # 1 on tokens the policy generated (merged turns: 0 between)
    "reward": pl.Float64(), "return": pl.Float64(), "advantage": pl.Float64(),
    "token_source": pl.String(),                   # 'engine' (the gateway's record) or 'retokenized'
}

# One row. "return" is a Python keyword, hence the functional form.
Transition = TypedDict("Transition", {
    "rollout_id": str, "task_id": str, "attempt": int, "policy_version": int, "agent": str, "agent_path": str,
    "turn": int, "prompt_ids": list[int], "completion_ids": list[int], "completion_logprobs": list[float],
    "loss_mask": list[int], "reward": float, "return": float, "advantage": float, "token_source": str,
    "token_advantages": NotRequired[list[float]],  # REINFORCE++ only: per completion token
})


def check_transitions(frame: pl.DataFrame) -> pl.DataFrame:
    """`frame` itself when its columns and dtypes are TRANSITION_SCHEMA's; ValueError naming the first
    difference otherwise (a compile change that would reach the loss with another shape)."""
    got = dict(frame.schema)
    if list(got) != list(TRANSITION_SCHEMA):
        raise ValueError(f"transition columns {list(got)} differ from {list(TRANSITION_SCHEMA)}")
    for name, dtype in TRANSITION_SCHEMA.items():
        if got[name] != dtype and not (got[name] == pl.Null() and frame.height == 0):
            raise ValueError(f"transition column {name} is {got[name]}, not {dtype}")
    return frame
