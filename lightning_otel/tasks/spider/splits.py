"""A split of the bundled Spider data by database: questions on databases never trained on, for evaluation, and
training questions (SFT, GRPO) from the others.

A policy that has seen a database's questions knows its table names; whether it reads a schema it has never
seen shows only on databases kept out of training altogether. HELD_OUT names three of the bundled dev
databases; `split()` writes the task files of a run that keeps them out.
"""
from __future__ import annotations

import json
from pathlib import Path

from lightning_otel.tasks.spider.rewards import bundled_data_dir, database_path
from lightning_otel.tasks.spider.synthesis import round_robin, synthesize

HELD_OUT = ("singer", "poker_player", "tvshow")


def read_rows(path: Path) -> list[dict]:
    """The rows of a JSONL file (blank lines skipped)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def write_rows(rows: list[dict], path: Path) -> Path:
    """`rows` as a JSONL file at `path` (its folder made); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _sft_rows(trainable: list[dict], train_rows: list[dict], sft_count: int | None) -> list[dict]:
    """The dev databases' questions first (Spider's own style, as the held-out ones), then train.jsonl's (geo,
    scholar, restaurants...: older datasets, mostly hard / extra), each spread evenly when cut."""
    if sft_count is None:
        return trainable + train_rows
    if sft_count <= 0:
        return []
    if sft_count <= len(trainable):
        return trainable[::max(1, len(trainable) // sft_count)][:sft_count]
    rest = sft_count - len(trainable)
    return trainable + train_rows[::max(1, len(train_rows) // rest)][:rest]


def split(out: Path, eval_count: int, grpo_count: int, sft_count: int | None, synthetic: int = 0,
          grpo_synthetic: bool = False) -> dict[str, Path]:
    """The task files `eval.jsonl`, `grpo.jsonl` and `sft.jsonl` in `out`: `eval_count` questions of the
    HELD_OUT databases spread evenly, `grpo_count` GRPO questions and `sft_count` SFT questions (None: all) of
    the other databases, plus `synthetic` templated questions per training dev database (synthesis.synthesize)
    mixed into the SFT set. With `grpo_synthetic` the GRPO questions are templated ones the SFT set does not
    hold (the same generator drawn further), spread over the training dev databases, instead of the easiest
    labelled questions. Returns the three paths by name ("eval", "sft", "grpo")."""
    data = bundled_data_dir()
    dev, train_rows = read_rows(data / "dev.jsonl"), read_rows(data / "train.jsonl")
    held = [r for r in dev if r["db_id"] in HELD_OUT]
    step = max(1, len(held) // eval_count)
    evaluation = held[::step][:eval_count]
    trainable = [r for r in dev if r["db_id"] not in HELD_OUT]
    # GRPO on easy questions first: a group teaches only when some of its samples succeed. They are in the SFT
    # set too, so the warm-started policy solves some of them sometimes.
    grpo = sorted(trainable, key=lambda r: r.get("hardness") != "easy")[:grpo_count]
    sft = _sft_rows(trainable, train_rows, sft_count)
    databases = list(dict.fromkeys(r["db_id"] for r in trainable))
    extra = -(-grpo_count // len(databases)) if grpo_synthetic else 0
    # A database's rows are the same for any count up to it (synthesize is prefix-stable), so the first
    # `synthetic` of each go to SFT as without grpo_synthetic, and the rest are questions SFT never saw.
    drawn = {db_id: synthesize(database_path(data, db_id), db_id, synthetic + extra) if synthetic + extra else []
             for db_id in databases}
    if synthetic:
        generated = [row for rows in drawn.values() for row in rows[:synthetic]]
        sft = round_robin(sft, generated)
    if grpo_synthetic:
        fresh = round_robin(*(rows[synthetic:] for rows in drawn.values()))
        grpo = fresh[:grpo_count]
    return {"eval": write_rows(evaluation, out / "eval.jsonl"), "sft": write_rows(sft, out / "sft.jsonl"),
            "grpo": write_rows(grpo, out / "grpo.jsonl")}
