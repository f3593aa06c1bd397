"""Rewards for the tests. concise_sql: for the trainer tests, it varies within every group of samples, so
GRPO's gradient is not 0: half for writing a SELECT at all, half for brevity (fewer words score higher)."""
from lightning_otel.rollouts.packs import TaskPack


def concise_sql(task: dict, rollout: dict) -> float:
    output = rollout.get("final_output") or ""
    return 0.5 * ("select" in output.lower()) + 0.5 / (1.0 + len(output.split()) / 10.0)


_calls: dict[str, int] = {}
_lock = __import__("threading").Lock()


def by_kind(task: dict, rollout: dict) -> float:
    """By the task's `kind`: always 1.0, never 0.0, or (half) 1.0 on every other rollout of the task, so the
    pool filter's pass rates are known before any rollout runs."""
    if task["kind"] != "half":
        return float(task["kind"] == "always")
    with _lock:
        seen = _calls[task["id"]] = _calls.get(task["id"], 0) + 1
    return float(seen % 2)


def gold_only(task: dict, rollout: dict) -> float | None:
    """The task's own `gold` field, whatever the agent did (None where it has none)."""
    return task.get("gold")


GOLD_PACK = TaskPack(name="gold", rewards={"gold_only": gold_only})
