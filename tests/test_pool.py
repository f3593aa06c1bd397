"""The pool filter's arithmetic, apart from the rollouts that feed it (tests/test_train.py runs it whole)."""
from __future__ import annotations

import json

import pytest

from lightning_otel.errors import UserError
from lightning_otel.rollouts.runner import RolloutResult, Task
from lightning_otel.train.pool import kept_tasks, pass_rates, pool_record


def result(task_id: str, reward: float | None) -> RolloutResult:
    return RolloutResult("r", task_id, 0, 0, "ok", None, 0, 0, 1, "", "", "", "cmd", reward)


def test_pass_rates_keep_the_tasks_whose_groups_disagree(tmp_path):
    tasks = [Task(name, i, {}) for i, name in enumerate(["never", "half", "always", "unscored"], start=1)]
    results = [result("never", 0.0), result("never", 0.5), result("half", 1.0), result("half", 0.0),
               result("always", 1.0), result("always", 1.0), result("unscored", None)]
    rows = pass_rates(tasks, results, pass_reward=1.0, min_pass=0.25, max_pass=0.75)
    assert [(r["task_id"], r["samples"], r["pass_rate"], r["kept"]) for r in rows] == [
        ("never", 2, 0.0, False), ("half", 2, 0.5, True), ("always", 2, 1.0, False), ("unscored", 0, None, False)]
    assert pool_record(rows) == {"pool_tasks": 4, "pool_kept": 1, "pool_never": 1, "pool_always": 1,
                                 "pool_unscored": 1}
    pool = tmp_path / "pool.jsonl"
    pool.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [t.task_id for t in kept_tasks(tasks, pool, 1.0, 0.25, 0.75)] == ["half"]
    pool.write_text("".join(json.dumps({**r, "kept": False}) + "\n" for r in rows))
    with pytest.raises(UserError, match="kept no task: of 4 tasks.*pass rates from 0.0 to 1.0"):
        kept_tasks(tasks, pool, 1.0, 0.25, 0.75)
