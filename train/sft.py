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

A killed warm start resumes. The walk goes `sft_save_tasks` tasks at a time and records each finished stretch
in the run folder (rounds/sft/walked.jsonl), so a rerun walks only what was not recorded; training saves the
learner's state every `sft_save_steps` steps (checkpoints/sft-partial-0|1, rounds/sft/trained.json) and goes
on from the last save when the demonstrations are the same.

`sft_rows_from_successes()` is the other source: rejection-sampling fine-tuning on stored transitions of
rollouts whose reward reached a threshold (used by offline training).
"""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from pathlib import Path

import polars as pl

from lightning_otel.errors import UserError
from lightning_otel.rollouts.runner import Task, check_templates, format_answer, load_tasks, write_tasks
from lightning_otel.span_store import client
from lightning_otel.train.optimize import optimize
from lightning_otel.train.run import write_atomically
from lightning_otel.train.transitions.record import Transition

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


def demonstration_rows(walked: dict[str, str], tasks: dict, labels: list[str], prompts: dict[str, list[list[int]]],
                       tokenizer, untrained: list[int] = ()) -> tuple[list[Transition], int]:
    """SFT rows from the walked rollouts (task id -> rollout id), one per answered call (its prompt, its
    label + end of turn) except the `untrained` calls, and how many rollouts made fewer calls than there are
    labels (the agent stopped or failed early; the calls it made are kept)."""
    rows, short = [], 0
    for task_id, rollout_id in walked.items():
        calls = prompts.get(rollout_id, [])[:len(labels)]
        short += len(calls) < len(labels)
        rows += [{"rollout_id": rollout_id, "turn": turn, "prompt_ids": prompt,
                  "completion_ids": target_ids(tokenizer, format_answer(label, tasks[task_id])),
                  "completion_logprobs": None, "loss_mask": None, "advantage": 0.0}
                 for turn, (prompt, label) in enumerate(zip(calls, labels)) if turn not in untrained]
    return rows, short


def fields_digest(task: Task) -> str:
    return hashlib.sha256(json.dumps(task.fields, sort_keys=True, default=str).encode()).hexdigest()


def walk_labelled(trainer, tasks: list[Task], labels: list[str]) -> tuple[dict[str, str], int]:
    """The rollout that walked each labelled task along its labels (task id -> rollout id, in the file's
    order), and how many of them an earlier, killed attempt of the run had walked. Tasks go `sft_save_tasks`
    at a time; after each stretch (its gateway closed, so its spans are stored) rounds/sft/walked.jsonl is
    rewritten with every pair so far and a digest of each task's fields. An earlier pair is kept when its task
    is unchanged and the store holds its prompts; every other task is walked."""
    folder = trainer.folder.path / "rounds" / "sft"
    folder.mkdir(parents=True, exist_ok=True)
    record = folder / "walked.jsonl"
    digests = {t.task_id: fields_digest(t) for t in tasks}

    def in_file_order(pairs: dict[str, str]) -> dict[str, str]:
        return {t.task_id: pairs[t.task_id] for t in tasks if t.task_id in pairs}

    earlier = {}
    if record.is_file():
        entries = [json.loads(line) for line in record.read_text().splitlines()]
        earlier = {e["task_id"]: e["rollout_id"] for e in entries if digests.get(e["task_id"]) == e["digest"]}
        stored = call_prompts(trainer.db, list(earlier.values()))
        earlier = {task_id: rollout_id for task_id, rollout_id in earlier.items() if rollout_id in stored}
    walked = in_file_order(earlier)
    todo = [t for t in tasks if t.task_id not in walked]
    step = trainer.config.sft_save_tasks
    for start in range(0, len(todo), step):
        summary = trainer.rollouts(
            write_tasks(todo[start:start + step], folder / "tasks.jsonl"), 1, "sft prompts", None, 1, reward=False,
            answers=labels, progress=lambda done, _: trainer.progress("sft prompts", len(walked) + done, len(tasks)))
        walked = in_file_order({**walked, **{r.task_id: r.rollout_id for r in summary.results}})
        write_atomically(record, "".join(json.dumps({"task_id": task_id, "rollout_id": rollout_id,
                                                     "digest": digests[task_id]}) + "\n"
                                         for task_id, rollout_id in walked.items()))
    return walked, len(earlier)


def warm_start(trainer) -> dict:
    """Walk the agent along each labelled task's path, then run `sft_epochs` of SFT at `sft_lr`."""
    c = trainer.config
    labels = labels_of(c)
    listed = load_tasks(Path(c.sft_tasks))
    started = time.perf_counter()
    walked, earlier = walk_labelled(trainer, listed, labels)
    prompts = call_prompts(trainer.db, list(walked.values()))
    rows, short = demonstration_rows(walked, {t.task_id: t for t in listed}, labels, prompts,
                                     trainer.learner.tokenizer, c.sft_untrained)
    if short:
        log.warning("%d labelled task(s) made fewer model calls than the %d label(s) (the agent stopped or "
                    "failed early); the calls they made are trained", short, len(labels))
    if not rows:
        raise UserError("SFT warm start: no labelled task produced a prompt; check that the agent runs "
                        "(lightning-otel rollout --tasks ... --agent ...)")
    prompt_seconds = time.perf_counter() - started
    trainer.learner.set_lr(c.sft_lr)
    resumed = resume_training(trainer, rows)

    def after_step(step: int, total: int) -> None:
        trainer.progress("sft", step, total)
        if c.sft_save_steps and step % c.sft_save_steps == 0 and step < total:
            save_partial(trainer, rows, step)

    stats = optimize(trainer.learner, rows, c, "sft", seed=c.seed, epochs=c.sft_epochs, progress=after_step,
                     start_step=resumed, on_step=trainer.metrics.write_step)
    trainer.learner.set_lr(c.lr)
    return {"sft_examples": len(rows), "sft_short": short, "sft_walked_earlier": earlier,
            "sft_resumed_at_step": resumed, "rollout_seconds": prompt_seconds,
            "optimizer_steps_total": trainer.learner.engine.global_steps, **stats.summary()}


def rows_digest(rows: list[Transition]) -> str:
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps([row["prompt_ids"], row["completion_ids"]]).encode())
    return digest.hexdigest()


def save_partial(trainer, rows: list[Transition], step: int) -> None:
    """The learner's state after `step` SFT steps, into the slot the last save did not use (a kill during this
    save leaves that one whole), then rounds/sft/trained.json pointing at it."""
    slot = f"checkpoints/sft-partial-{step // trainer.config.sft_save_steps % 2}"
    trainer.learner.save_state(trainer.folder.path / slot / "state")
    write_atomically(trainer.folder.path / "rounds" / "sft" / "trained.json",
                     json.dumps({"steps": step, "state": f"{slot}/state", "rows": rows_digest(rows)}))


def resume_training(trainer, rows: list[Transition]) -> int:
    """The SFT steps an earlier, killed attempt saved on these same rows (their state loaded), else 0."""
    record = trainer.folder.path / "rounds" / "sft" / "trained.json"
    if not record.is_file():
        return 0
    saved = json.loads(record.read_text())
    if saved["rows"] != rows_digest(rows):
        log.info("the saved SFT state was trained on other demonstrations: SFT starts over")
        return 0
    trainer.learner.load_state(trainer.folder.path / saved["state"])
    log.info("SFT resumes after step %d (saved state loaded)", saved["steps"])
    return saved["steps"]


def drop_partial(run: Path) -> None:
    """Once the SFT checkpoint is committed, the states saved along the way are not needed."""
    for slot in (run / "checkpoints").glob("sft-partial-*"):
        shutil.rmtree(slot, ignore_errors=True)
    (run / "rounds" / "sft" / "trained.json").unlink(missing_ok=True)


def sft_rows_from_successes(frame: pl.DataFrame, threshold: float) -> list[Transition]:
    """Transitions of rollouts whose reward is at least `threshold`, as SFT examples (their own tokens)."""
    return frame.filter(pl.col("reward") >= threshold).to_dicts()
