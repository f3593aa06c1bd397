"""Evaluating a candidate: real rollouts of the unchanged agent under the candidate's prompt patch, scored by the
task pack's reward, kept in the run folder so that no evaluation is ever run twice.

A candidate's score on a task is the mean reward of its `n` rollouts of the task; a rollout that ended without a
reward (the agent failed, the reward function gave None) counts 0, since a prompt that breaks the agent must
lose. `evaluations.jsonl` holds one line per (candidate key, task) as soon as the task's rollouts are done and
scored, with their rollout ids (their spans, messages and rewards are in the run's store); `candidates.jsonl`
holds each candidate once, by key. A rerun of the optimiser reads both back: an evaluation that is there is
not run again, whichever proposer asks for it, so a killed run continues where it stopped.

How the rollouts run is a parameter (`RunBatch`): the optimiser's session runs them through the gateway over the
engine (train/apo/session.py); tests may give a cheap stand-in to check the bookkeeping.
"""
from __future__ import annotations

import json
import logging
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from lightning_otel.rollouts.runner import Task
from lightning_otel.train.apo.candidates import Component, candidate_key, write_patch

log = logging.getLogger(__name__)


@dataclass
class TaskResult:
    """One task's evaluation under one candidate."""
    task_id: str
    score: float                                     # mean reward, None counted as 0
    rewards: list[float | None] = field(default_factory=list)
    rollout_ids: list[str] = field(default_factory=list)
    outputs: list[str | None] = field(default_factory=list)  # each rollout's final output
    statuses: list[str] = field(default_factory=list)        # ok | failed | timeout | error
    errors: list[str] = field(default_factory=list)          # the end of stderr of rollouts that did not end ok


class RunBatch(Protocol):
    def __call__(self, key: str, patch: Path | None, tasks: list[Task],
                 report: Callable[[TaskResult], None]) -> None:
        """Run the rollouts of `tasks` with the patch file (None: the agent's own prompt), calling `report` with
        each task's result as soon as it is scored."""


def score_of(rewards: list[float | None]) -> float:
    return sum(r or 0.0 for r in rewards) / len(rewards) if rewards else 0.0


class EvaluationLog:
    """evaluations.jsonl and candidates.jsonl of a run folder (module docstring)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path, self.candidates_path = self.folder / "evaluations.jsonl", self.folder / "candidates.jsonl"
        self.results: dict[tuple[str, str], TaskResult] = {}
        self.candidates: dict[str, dict[str, str]] = {}
        self._lock = threading.Lock()
        for line in self._lines(self.path):
            key = line.pop("candidate")
            self.results[(key, line["task_id"])] = TaskResult(**line)
        for line in self._lines(self.candidates_path):
            self.candidates[line["key"]] = line["candidate"]

    @staticmethod
    def _lines(path: Path) -> list[dict]:
        """The complete lines of a JSONL file; a last line a kill cut short is dropped (and rewritten later)."""
        if not path.is_file():
            return []
        rows = []
        for number, text in enumerate(path.read_text().splitlines(), 1):
            try:
                rows.append(json.loads(text))
            except json.JSONDecodeError:
                log.warning("%s:%d: an unfinished line (the run was stopped while writing it); ignored", path, number)
        return rows

    def get(self, key: str, task_id: str) -> TaskResult | None:
        return self.results.get((key, task_id))

    def put(self, key: str, result: TaskResult) -> None:
        with self._lock:
            self.results[(key, result.task_id)] = result
            with self.path.open("a") as f:
                f.write(json.dumps({"candidate": key, **asdict(result)}, ensure_ascii=False) + "\n")

    def remember(self, key: str, candidate: dict[str, str]) -> None:
        with self._lock:
            if key in self.candidates:
                return
            self.candidates[key] = dict(candidate)
            with self.candidates_path.open("a") as f:
                f.write(json.dumps({"key": key, "candidate": candidate}, ensure_ascii=False) + "\n")

    @property
    def rollouts(self) -> int:
        return sum(len(r.rollout_ids) for r in self.results.values())

    def mean(self, key: str, task_ids: list[str]) -> float | None:
        """The candidate's mean score over these tasks; None unless every one of them was evaluated."""
        results = [self.get(key, t) for t in task_ids]
        if not results or any(r is None for r in results):
            return None
        return sum(r.score for r in results) / len(results)  # type: ignore[union-attr]


class Evaluator:
    """Evaluates candidates on tasks, running only what the log does not hold yet."""

    def __init__(self, folder: Path, components: list[Component], run_batch: RunBatch,
                 progress: Callable[[str, int, int], None] | None = None):
        self.folder, self.components, self.run_batch = Path(folder), components, run_batch
        self.log = EvaluationLog(self.folder)
        self.progress = progress or (lambda label, done, total: None)
        self.ran = self.rollouts_ran = 0  # task evaluations and rollouts this process ran (not read back)

    def key(self, candidate: dict[str, str]) -> str:
        return candidate_key(candidate, self.components)

    def patch_file(self, candidate: dict[str, str]) -> Path | None:
        return write_patch(candidate, self.components, self.folder / "candidates")

    def evaluate(self, candidate: dict[str, str], tasks: list[Task], label: str) -> list[TaskResult]:
        """The candidate's result on every task, in the order of `tasks`."""
        key = self.key(candidate)
        self.log.remember(key, candidate)
        missing = [t for t in dict((t.task_id, t) for t in tasks).values() if self.log.get(key, t.task_id) is None]
        if missing:
            patch = self.patch_file(candidate)
            done = [0]
            title = f"{label}: candidate {key}"
            self.progress(title, 0, len(missing))

            def report(result: TaskResult) -> None:
                self.log.put(key, result)
                done[0] += 1
                self.ran += 1
                self.rollouts_ran += len(result.rollout_ids)
                self.progress(title, done[0], len(missing))

            self.run_batch(key, patch, missing, report)
            absent = [t.task_id for t in missing if self.log.get(key, t.task_id) is None]
            if absent:
                raise RuntimeError(f"candidate {key}: no result for task(s) {absent} after their rollouts")
        return [self.log.get(key, t.task_id) for t in tasks]  # type: ignore[misc]


__all__ = ["TaskResult", "EvaluationLog", "Evaluator", "RunBatch", "score_of"]
