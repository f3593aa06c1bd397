"""Supervised warm start on labelled tasks, with the prompts the agent itself writes.

The bundled 135M model answers prose to most SQL questions, so GRPO alone gets almost no signal from it.
SFT first teaches it the answer format. The prompt of each labelled task is not guessed: the agent runs
once per task through the gateway with generation capped at one token and every call after its first
refused (the agent then stops, usually with an error, which is expected), and that first LLM call is read
back from the store (the exact prompt token ids, chat template and schema included). The target is the
task's label (`sft_label`, formatted from the task's fields, e.g. "{query}") followed by the end-of-turn
token. This works for any agent whose first call asks for the answer; multi-turn agents learn their first
turn.

`sft_rows_from_successes()` is the other source: rejection-sampling fine-tuning on stored transitions of
rollouts whose reward reached a threshold (used by offline training).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import polars as pl

from lightning_otel.errors import UserError
from lightning_otel.runner import load_tasks
from lightning_otel.span_store import client
from lightning_otel.train.optimize import optimize

log = logging.getLogger(__name__)
SQL_FIRST_PROMPTS = """
SELECT rollout_id, arg_min(prompt_ids, start_ns) AS prompt_ids
FROM generations WHERE rollout_id IN ({ids}) AND prompt_ids IS NOT NULL GROUP BY rollout_id
"""


def label_of(task_fields: dict, template: str, task_id: str) -> str:
    try:
        return template.format_map(task_fields)
    except KeyError as exc:
        raise UserError(f"sft_label {template!r} needs field {exc} which task {task_id} does not have") from None


def first_prompts(db: Path, rollout_ids: list[str]) -> dict[str, list[int]]:
    if not rollout_ids:
        return {}
    listed = ", ".join(client.sql_literal(i) for i in rollout_ids)
    frame = client.query(SQL_FIRST_PROMPTS.format(ids=listed), db)
    return {row["rollout_id"]: list(row["prompt_ids"]) for row in frame.to_dicts()}


def target_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])


def warm_start(trainer) -> dict:
    """Collect the agent's prompts for the labelled tasks, then run `sft_epochs` of SFT at `sft_lr`."""
    c = trainer.config
    tasks = load_tasks(Path(c.sft_tasks))
    labels = {t.task_id: label_of(t.fields, c.sft_label, t.task_id) for t in tasks}
    started = time.perf_counter()
    # One call per agent: the gateway refuses the rest, so a multi-turn agent stops after its first prompt.
    summary = trainer.rollouts(Path(c.sft_tasks), 1, "sft prompts", None, 1, max_calls=1, reward=False)
    prompts = first_prompts(trainer.db, [r.rollout_id for r in summary.results])
    tokenizer = trainer.learner.tokenizer
    rows = [{"rollout_id": r.rollout_id, "prompt_ids": prompts[r.rollout_id],
             "completion_ids": target_ids(tokenizer, labels[r.task_id]), "completion_logprobs": None,
             "loss_mask": None, "advantage": 0.0}
            for r in summary.results if r.rollout_id in prompts]
    missing = len(summary.results) - len(rows)
    if missing:
        log.warning("%d labelled task(s) gave no prompt (the agent failed before its first LLM call)", missing)
    if not rows:
        raise UserError("SFT warm start: no labelled task produced a prompt; check that the agent runs "
                        "(lightning-otel rollout --tasks ... --agent ...)")
    prompt_seconds = time.perf_counter() - started
    trainer.learner.set_lr(c.sft_lr)
    stats = optimize(trainer.learner, rows, c, "sft", seed=c.seed, epochs=c.sft_epochs,
                     progress=lambda done, total: trainer.progress("sft", done, total))
    trainer.learner.set_lr(c.lr)
    return {"sft_examples": len(rows), "sft_without_prompt": missing, "rollout_seconds": prompt_seconds,
            **stats.summary()}


def sft_rows_from_successes(frame: pl.DataFrame, threshold: float) -> list[dict]:
    """Transitions of rollouts whose reward is at least `threshold`, as SFT examples (their own tokens)."""
    return frame.filter(pl.col("reward") >= threshold).to_dicts()
