"""The math task pack: questions with a numeric `answer` (examples/openai_agents_math).

    --reward number_match    1 when the last number of the final output equals the task's answer, else 0
"""
from __future__ import annotations

import re
from pathlib import Path

from lightning_otel.rollouts.packs import TaskPack

NUMBER = re.compile(r"(?<![\w.])-?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\w])|-?\d+(?:\.\d+)?")


def last_number(text: str | None) -> float | None:
    """The last number written in `text` ("1,234" and "-5.5" included), or None when it has none."""
    found = NUMBER.findall(text or "")
    return float(found[-1].replace(",", "")) if found else None


def number_match(task: dict, rollout: dict) -> float | None:
    """1.0 when the last number in the rollout's final output equals the task's `answer` (within 1e-6 of
    it, relative for large answers), else 0.0; None when the task has no numeric `answer`."""
    gold = task.get("answer")
    try:
        gold = float(str(gold).replace(",", "")) if gold is not None and not isinstance(gold, bool) else None
    except ValueError:
        gold = None
    if gold is None:
        return None
    predicted = last_number(rollout.get("final_output"))
    return float(predicted is not None and abs(predicted - gold) <= 1e-6 * max(1.0, abs(gold)))


OUTCOME_CLASSES = {
    "wrong_number": "the final output ends in a number other than the answer",
    "no_number": "the final output has no number",
}


def classify(row: dict, data_dir: Path | None) -> str:
    """Why a scored answer was not right (the generic classes come first: see TaskPack.outcome)."""
    return "no_number" if last_number(row.get("final_output")) is None else "wrong_number"


PACK = TaskPack(name="math", rewards={"number_match": number_match}, classify=classify,
                outcome_classes=OUTCOME_CLASSES)
