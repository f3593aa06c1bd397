"""Supervised warm start on labelled tasks, with the prompts the agent itself writes.

The bundled 135M model answers prose to most SQL questions, so GRPO alone gets almost no signal from it.
SFT first teaches it the answer format. The prompts are not guessed: the agent runs once per labelled task
through the gateway, which answers its calls with the task's labels instead of sampling (`sft_label`: one
template, or a list of them for the agent's successive calls, formatted from the task's fields, e.g.
"{query}") and refuses the calls after the last label (the agent then stops, possibly with an error, which is
expected). Each answered call is read back from the store (the exact prompt token ids, chat template, schema
and earlier turns included) and trained on its label followed by the end-of-turn token. So a multi-turn agent
learns every step of the labelled path: e.g. the query, then the reviewer's verdict on it. Calls listed in
`sft_untrained` are answered but not trained: a repair path answers the first call with a wrong query and
trains only the review that rejects it, the corrected query and the review that accepts that.

`sft_rows_from_successes()` is the other source: rejection-sampling fine-tuning on stored transitions of
rollouts whose reward reached a threshold (used by offline training).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import polars as pl

from lightning_otel.errors import UserError
from lightning_otel.runner import check_templates, format_answer, load_tasks
from lightning_otel.span_store import client
from lightning_otel.train.optimize import optimize

log = logging.getLogger(__name__)
SQL_PROMPTS = """
SELECT rollout_id, list(prompt_ids ORDER BY start_ns) AS prompts
FROM generations WHERE rollout_id IN ({ids}) AND prompt_ids IS NOT NULL AND choice_index = 0 GROUP BY rollout_id
"""


def labels_of(config) -> list[str]:
    return [config.sft_label] if isinstance(config.sft_label, str) else list(config.sft_label)


def check_labels(config) -> None:
    """Every label fits every labelled task (fields present, valid template): checked when the run is set up,
    before the engine starts, with the setting's own name in the error."""
    labels = labels_of(config)
    for task in load_tasks(Path(config.sft_tasks)):
        check_templates(labels, task, "sft_label")


def call_prompts(db: Path, rollout_ids: list[str]) -> dict[str, list[list[int]]]:
    """Each rollout's prompts, call by call."""
    if not rollout_ids:
        return {}
    listed = ", ".join(client.sql_literal(i) for i in rollout_ids)
    frame = client.query(SQL_PROMPTS.format(ids=listed), db)
    return {row["rollout_id"]: [list(p) for p in row["prompts"]] for row in frame.to_dicts()}


def target_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])


def demonstration_rows(results, tasks: dict, labels: list[str], prompts: dict[str, list[list[int]]],
                       tokenizer, untrained: list[int] = ()) -> tuple[list[dict], int]:
    """SFT rows, one per answered call (its prompt, its label + end of turn) except the `untrained` calls,
    and how many rollouts made fewer calls than there are labels (the agent stopped or failed early; the
    calls it made are kept)."""
    rows, short = [], 0
    for r in results:
        calls = prompts.get(r.rollout_id, [])[:len(labels)]
        short += len(calls) < len(labels)
        rows += [{"rollout_id": r.rollout_id, "turn": turn, "prompt_ids": prompt,
                  "completion_ids": target_ids(tokenizer, format_answer(label, tasks[r.task_id])),
                  "completion_logprobs": None, "loss_mask": None, "advantage": 0.0}
                 for turn, (prompt, label) in enumerate(zip(calls, labels)) if turn not in untrained]
    return rows, short


def warm_start(trainer) -> dict:
    """Walk the agent along each labelled task's path, then run `sft_epochs` of SFT at `sft_lr`."""
    c = trainer.config
    labels = labels_of(c)
    tasks = {t.task_id: t for t in load_tasks(Path(c.sft_tasks))}
    started = time.perf_counter()
    summary = trainer.rollouts(Path(c.sft_tasks), 1, "sft prompts", None, 1, reward=False, answers=labels)
    prompts = call_prompts(trainer.db, [r.rollout_id for r in summary.results])
    rows, short = demonstration_rows(summary.results, tasks, labels, prompts, trainer.learner.tokenizer,
                                     c.sft_untrained)
    if short:
        log.warning("%d labelled task(s) made fewer model calls than the %d label(s) (the agent stopped or "
                    "failed early); the calls they made are trained", short, len(labels))
    if not rows:
        raise UserError("SFT warm start: no labelled task produced a prompt; check that the agent runs "
                        "(lightning-otel rollout --tasks ... --agent ...)")
    prompt_seconds = time.perf_counter() - started
    trainer.learner.set_lr(c.sft_lr)
    stats = optimize(trainer.learner, rows, c, "sft", seed=c.seed, epochs=c.sft_epochs,
                     progress=lambda done, total: trainer.progress("sft", done, total))
    trainer.learner.set_lr(c.lr)
    return {"sft_examples": len(rows), "sft_short": short, "rollout_seconds": prompt_seconds,
            **stats.summary()}


def sft_rows_from_successes(frame: pl.DataFrame, threshold: float) -> list[dict]:
    """Transitions of rollouts whose reward is at least `threshold`, as SFT examples (their own tokens)."""
    return frame.filter(pl.col("reward") >= threshold).to_dicts()
