"""A round's optimisation with one adapter per agent (`adapters`): each adapter takes its own pass over the
transitions of the calls it served, and only those.

Which adapter a transition belongs to is the one its token record names (`lightning.adapter`: the gateway's
routing, which also honours an agent asking for an adapter by model name); a call without a token record (re-
tokenised) is matched by its agent with the same patterns. A call the base model served belongs to none and is
not trained.
"""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from lightning_otel.serve.adapters import ADAPTER_ATTRIBUTE, adapter_of_agent
from lightning_otel.span_store import client
from lightning_otel.train.config import TrainConfig
from lightning_otel.train.optimize import StepCallback, StepStats, optimize

if TYPE_CHECKING:
    from lightning_otel.train.learner import Learner

SQL_RECORD_ADAPTERS = f"""
SELECT t.rollout_id, t.turn, json_extract_string(s.attributes, '$."{ADAPTER_ATTRIBUTE}"') AS adapter
FROM trajectory_calls t JOIN spans s ON s.trace_id = t.record_trace_id AND s.span_id = t.record_span_id
WHERE t.rollout_id IN ($ids)
"""


def split_by_adapter(db: Path, rows: list[dict], adapters: dict[str, str]) -> tuple[dict[str, list[dict]], int]:
    """The round's transitions by adapter (every adapter a key, in order), and how many belong to none."""
    recorded: dict[tuple[str, int], str | None] = {}
    ids = sorted({row["rollout_id"] for row in rows})
    if ids:
        query = SQL_RECORD_ADAPTERS.replace("$ids", ", ".join(client.sql_literal(i) for i in ids))
        recorded = {(r["rollout_id"], r["turn"]): r["adapter"] for r in client.query(query, db).to_dicts()}
    out: dict[str, list[dict]] = {name: [] for name in adapters}
    untrained = 0
    for row in rows:
        key = (row["rollout_id"], row["turn"])
        name = recorded[key] if key in recorded else adapter_of_agent(adapters, row.get("agent"))
        if name in out:
            out[name].append(row)
        else:
            untrained += 1
    return out, untrained


def merged_stats(parts: list[StepStats]) -> StepStats:
    """One round's figures from the adapters' passes: counts added, per-step lists joined, the first pass's
    first micro-batch, the last pass's single figures."""
    out = StepStats(ranks=parts[0].ranks if parts else 1)
    for part in parts:
        for f in fields(StepStats):
            value = getattr(part, f.name)
            if f.name in ("steps", "samples", "trained_tokens", "skipped_too_long", "seconds"):
                setattr(out, f.name, getattr(out, f.name) + value)
            elif isinstance(value, list):
                getattr(out, f.name).extend(value)
            elif f.name == "first":
                out.first = out.first or value
            elif value is not None and f.name != "ranks":
                setattr(out, f.name, value)
    return out


def optimize_adapters(learner: "Learner", by_adapter: dict[str, list[dict]], config: TrainConfig, seed: int,
                      progress: Callable[[str, int, int], None] | None = None, on_step: StepCallback | None = None,
                      objective: str = "grpo") -> tuple[StepStats, dict[str, dict]]:
    """Each adapter's pass over its own transitions (learner.training_adapter): the round's merged figures,
    and per adapter its transitions, steps and mean loss."""
    parts, per = [], {}
    for name, rows in by_adapter.items():
        if not rows:
            per[name] = {"transitions": 0, "steps": 0, "loss": None}
            continue
        with learner.training_adapter(name):
            stats = optimize(learner, rows, config, objective, seed=seed, epochs=config.epochs, on_step=on_step,
                             progress=((lambda done, total, name=name: progress(name, done, total))
                                       if progress else None))
        parts.append(stats)
        per[name] = {"transitions": len(rows), "steps": stats.steps,
                     "loss": sum(stats.loss) / len(stats.loss) if stats.loss else None}
    return merged_stats(parts), per


__all__ = ["merged_stats", "optimize_adapters", "split_by_adapter"]
