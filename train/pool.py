"""Which tasks a run trains on: the pool filter (tasks whose pass rate under the starting policy lies in
[pool_min_pass, pool_max_pass], so GRPO groups disagree and give a gradient) and each round's draw from it.
"""
from __future__ import annotations

import itertools
import json
import random
from collections import deque
from pathlib import Path

from lightning_otel.errors import UserError
from lightning_otel.rollouts.runner import RolloutResult, Task


def pass_rates(tasks: list[Task], results: list[RolloutResult], pass_reward: float, min_pass: float,
               max_pass: float) -> list[dict]:
    """One row per task: its scored samples, the share with reward >= pass_reward (None: none scored) and
    whether the pool keeps it."""
    rewards: dict[str, list[float]] = {t.task_id: [] for t in tasks}
    for result in results:
        if result.reward is not None:
            rewards[result.task_id].append(result.reward)
    rows = []
    for task in tasks:
        got = rewards[task.task_id]
        rate = sum(x >= pass_reward for x in got) / len(got) if got else None
        rows.append({"task_id": task.task_id, "samples": len(got), "pass_rate": rate,
                     "kept": rate is not None and min_pass <= rate <= max_pass})
    return rows


def pool_record(rows: list[dict]) -> dict:
    """The pool's metrics line: tasks kept, never passed, always passed, unscored."""
    rates = [row["pass_rate"] for row in rows if row["pass_rate"] is not None]
    return {"pool_tasks": len(rows), "pool_kept": sum(row["kept"] for row in rows),
            "pool_never": sum(rate == 0 for rate in rates), "pool_always": sum(rate == 1 for rate in rates),
            "pool_unscored": len(rows) - len(rates)}


def kept_tasks(tasks: list[Task], pool_file: Path, pass_reward: float, min_pass: float, max_pass: float) -> list[Task]:
    """The tasks pool.jsonl keeps, in the task file's order; a UserError saying what to change when none."""
    rows = [json.loads(line) for line in pool_file.read_text().splitlines() if line.strip()]
    kept = {row["task_id"] for row in rows if row["kept"]}
    chosen = [task for task in tasks if task.task_id in kept]
    if not chosen:
        rates = sorted(row["pass_rate"] for row in rows if row["pass_rate"] is not None)
        raise UserError(f"the pool filter kept no task: of {len(rows)} tasks none has a pass rate in "
                        f"[{min_pass}, {max_pass}] (pass: reward >= {pass_reward}; {len(rates)} scored, pass "
                        f"rates from {rates[0] if rates else None} to {rates[-1] if rates else None}; see "
                        f"{pool_file}). Give more or other tasks, widen the range, or lower pool_pass_reward")
    return chosen


def round_tasks(tasks: list[Task], round_index: int, count: int, seed: int) -> list[Task]:
    """The tasks of round `round_index` (0-based): consecutive slices of a stream of per-epoch shuffles of the
    task list, so every task is used once per epoch and the choice depends only on (seed, round). A round never
    holds a task twice: where a round runs from one epoch into the next, a task it already holds is put off to
    the next round. With fewer tasks than `count` (a pool filter that kept few), each round is one epoch."""
    count = min(count, len(tasks))
    epochs = itertools.count()

    def shuffled() -> list[int]:
        order = list(range(len(tasks)))
        random.Random(f"{seed}:{next(epochs)}").shuffle(order)
        return order

    pending: deque[int] = deque()  # the stream's next indices, a put-off one first
    for _ in range(round_index + 1):
        chosen: dict[int, None] = {}  # in the order drawn
        while len(chosen) < count:
            position = next((i for i, index in enumerate(pending) if index not in chosen), None)
            if position is None:
                pending.extend(shuffled())
                continue
            chosen[pending[position]] = None
            del pending[position]
    return [tasks[i] for i in chosen]
