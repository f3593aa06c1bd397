"""Offline batch training from traces already in a store: no engine, no new rollouts.

    lightning-otel train --offline --db traces.duckdb [--where "status = 'ok'"] [--objective grpo|sft]

grpo: the compiler's transitions with the `batch-baseline` advantage: rollouts sharing a (task, policy
      version) group with others are normalised within it (GRPO); rollouts alone in theirs are normalised
      against all lone rollouts (a batch baseline). With `advantage = "reinforce-pp"` REINFORCE++ instead:
      one baseline over all the transitions, no groups, token-level KL with `kl`; with `advantage = "ppo"`
      PPO: GAE from a critic trained from scratch on the same transitions. Ratios are taken against
      the recorded sampling logprobs, so older policies' data is clipped like any off-policy sample.
sft:  rejection-sampling fine-tuning: the transitions of rollouts whose reward reached `--min-reward`.
The result is a run folder like an online run's (checkpoints/offline, run.json, metrics.jsonl), so `eval`,
`serve` and `export` take it the same way.
"""
from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from lightning_otel.errors import UserError
from lightning_otel.serve.hub import recorded_model
from lightning_otel.span_store import client
from lightning_otel.train.adapter_rounds import optimize_adapters, split_by_adapter
from lightning_otel.train.config import TrainConfig, render_toml
from lightning_otel.train.metrics import open_metrics
from lightning_otel.train.optimize import optimize
from lightning_otel.train.run import RunFolder, RunState
from lightning_otel.train.sft import sft_rows_from_successes
from lightning_otel.train.transitions.compile import CompileConfig, compile_transitions

log = logging.getLogger(__name__)
ADVANTAGE_FOR = {"grpo": "batch-baseline", "sft": "none"}
GROUPLESS = {"reinforce-pp", "ppo"}  # advantages that need no groups: offline GRPO takes them as configured


def offline_advantage(config: TrainConfig, objective: str) -> str:
    """The compiler's advantage for an offline pass: batch-baseline for GRPO (stored rollouts rarely form
    groups) unless the config names a groupless one, none for SFT."""
    if objective not in ADVANTAGE_FOR:
        raise UserError(f"--objective {objective!r}: choose one of {sorted(ADVANTAGE_FOR)}")
    return config.advantage if objective == "grpo" and config.advantage in GROUPLESS else ADVANTAGE_FOR[objective]


def selected_rollouts(db: Path, where: str | None) -> set[str] | None:
    if not where:
        return None
    try:
        frame = client.query(f"SELECT rollout_id FROM rollouts WHERE {where}", db)
    except UserError as exc:
        raise UserError(f"--where {where!r} is not a valid condition on the rollouts view: {exc}") from None
    return set(frame["rollout_id"].to_list())


def train_offline(config: TrainConfig, db: Path, where: str | None = None, objective: str = "grpo",
                  min_reward: float = 1.0, progress: Callable[[str, int, int], None] | None = None) -> RunState:
    from lightning_otel.serve.engine import default_engine_python
    from lightning_otel.serve.model import resolve_model
    from lightning_otel.train.learner import Learner

    advantage = offline_advantage(config, objective)
    if not Path(db).exists():
        raise UserError(f"--db {db}: no such trace store")
    folder = RunFolder(Path(config.output_dir))
    folder.path.mkdir(parents=True, exist_ok=True)
    frame, account = compile_transitions(CompileConfig(
        db=Path(db), reward=config.reward or None, gamma=config.gamma, advantage=advantage,
        agents=config.agents or None, merge_turns=config.merge_turns))
    chosen = selected_rollouts(Path(db), where)
    rows = [r for r in frame.to_dicts() if chosen is None or r["rollout_id"] in chosen]
    if objective == "sft":
        import polars as pl

        rows = sft_rows_from_successes(pl.DataFrame(rows, schema=frame.schema), min_reward) if rows else []
    if not rows:
        excluded = ", ".join(f"{n} {reason}" for reason, n in account.excluded.items()) or "none"
        raise UserError(f"no transitions to train on in {db} (after --where and, for sft, --min-reward "
                        f"{min_reward}); rollouts excluded by the compiler: {excluded}")
    model_dir = resolve_model(config.model, config.engine_python or default_engine_python())
    config.save(folder.path / "config.toml")
    log.info("offline train config:\n%s", render_toml(config))
    learner = Learner(model_dir, config)
    metrics = None
    try:
        metrics = open_metrics(config, folder.path)
        if objective == "sft":
            learner.set_lr(config.sft_lr)
        by_adapter: dict = {}
        if config.adapters:  # each adapter on its agents' transitions (train/adapter_rounds.py)
            groups, untrained = split_by_adapter(Path(db), rows, config.adapters)
            stats, per = optimize_adapters(
                learner, groups, config, config.seed, on_step=metrics.write_step, objective=objective,
                progress=(lambda name, d, t: progress(f"offline {objective} {name}", d, t)) if progress else None)
            by_adapter = {"adapters": per, "untrained_transitions": untrained}
        else:
            stats = optimize(learner, rows, config, objective, seed=config.seed, epochs=config.epochs,
                             progress=(lambda d, t: progress(f"offline {objective}", d, t)) if progress else None,
                             on_step=metrics.write_step)
        checkpoint = folder.checkpoint("offline")
        learner.save_policy(checkpoint)
        (checkpoint / "policy.json").write_text('{"policy_version": 1}')
        state = RunState(model=recorded_model(model_dir), policy_version=1, last="checkpoints/offline",
                         best="checkpoints/offline", sft_done=objective == "sft", config=asdict(config),
                         offline={"db": str(db), "where": where, "objective": objective, "min_reward": min_reward})
        folder.save(state)
        metrics.write({"round": 1, "phase": f"offline-{objective}", "transitions": len(rows),
                       "rollouts": len({r["rollout_id"] for r in rows}), "excluded": dict(account.excluded),
                       "zero_variance_groups": account.zero_variance_groups, **stats.summary(), **by_adapter})
        metrics.close()
        metrics = None
        return state
    finally:
        if metrics is not None:  # an error on the way: the tracker runs end as failed
            metrics.close(failed=True)
        learner.close()
