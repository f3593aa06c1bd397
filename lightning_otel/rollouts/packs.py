"""Task packs: what a task brings to the generic rollout, training and evaluation code.

A task pack is what a user writes for their own task (Spider and math are the bundled ones):
- `rewards`: reward functions by registered name, called as `fn(task, rollout) -> float | None`;
- optionally `classify`, an outcome classifier for reports: it names why a scored, not-correct rollout failed
  (Spider: wrong_result, sql_error, no_sql), with `outcome_classes` saying what each name means;
- optionally `setup`, per-rollout preparation that gives the agent command extra placeholders (Spider: a fresh
  copy of the task's database as {db_path}), with `check` finding missing inputs before any rollout starts;
- optionally `data_dir`, the pack's default data folder, and `group_field`, the task field reports break
  accuracy down by (Spider: hardness).

Give one by name (`spider`, `math`, or one a package registers under the `lightning_otel.task_packs` entry-point
group) or as `module:ATTRIBUTE` (a TaskPack object). Rollouts given a registered reward name use that reward's
pack; `module:function` rewards need no pack (the generic outcome classes apply).
"""
from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

from lightning_otel.errors import UserError


class RewardFunction(Protocol):
    def __call__(self, task: dict, rollout: dict) -> float | None: ...


# Outcome classes every report has, in report order; a pack's classifier splits `wrong` further.
GENERIC_CLASSES = {
    "correct": "reward 1: the task was solved",
    "wrong": "scored below 1",
    "agent_error": "the agent exited non-zero or could not start",
    "timeout": "the agent ran past the rollout timeout",
    "unscored": "no reward (the task has nothing to score against)",
}
IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
ENTRY_POINT_GROUP = "lightning_otel.task_packs"
# The packs that ship with lightning-otel; others come from entry points or module:ATTRIBUTE.
BUILTIN = {"spider": "lightning_otel.tasks.spider:PACK", "math": "lightning_otel.tasks.math:PACK"}


@dataclass(frozen=True)
class TaskPack:
    name: str
    rewards: Mapping[str, RewardFunction]
    # (episode row: reward, status, final_output and the task's fields; data folder) -> a class name
    classify: Callable[[dict, Path | None], str] | None = None
    outcome_classes: Mapping[str, str] = field(default_factory=dict)  # the classes `classify` returns
    # (task fields, the rollout's own folder, data folder) -> extra placeholders for the agent command
    setup: Callable[[dict, Path, Path | None], dict[str, str]] | None = None
    placeholders: tuple[str, ...] = ()  # the placeholders `setup` gives
    check: Callable[[dict, Path | None], str | None] | None = None  # (task fields, data folder) -> a problem
    data_dir: Callable[[], Path] | None = None
    group_field: str | None = None
    group_order: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.rewards:
            raise ValueError(f"task pack {self.name!r} registers no reward")
        if self.group_field is not None and not IDENTIFIER.match(self.group_field):
            raise ValueError(f"task pack {self.name!r}: group_field {self.group_field!r} is not a field name")
        if self.classify is not None and not self.outcome_classes:
            raise ValueError(f"task pack {self.name!r}: a classifier needs outcome_classes (name -> meaning)")

    def default_data_dir(self) -> Path | None:
        return self.data_dir() if self.data_dir is not None else None

    def report_classes(self) -> dict[str, str]:
        """Outcome classes of a report, in order: correct, the pack's own, then the generic ones."""
        own = {k: v for k, v in self.outcome_classes.items() if k not in GENERIC_CLASSES}
        generic = {k: v for k, v in GENERIC_CLASSES.items() if k != "wrong" or self.classify is None}
        return {"correct": generic.pop("correct"), **own, **generic}

    def outcome(self, row: dict, data_dir: Path | None) -> str:
        """The outcome class of one evaluated rollout."""
        if row.get("reward") is None:
            return "unscored"
        if row["reward"] == 1.0:
            return "correct"
        if row.get("status") == "timeout":
            return "timeout"
        if row.get("status") in ("failed", "error"):
            return "agent_error"
        if self.classify is None:
            return "wrong"
        name = self.classify(row, data_dir)
        if name not in self.report_classes():
            raise UserError(f"task pack {self.name!r} classified a rollout as {name!r}, which is not one of its "
                            f"outcome_classes {sorted(self.outcome_classes)}")
        return name


# A pack with only the generic classes, for module:function rewards.
def bare_pack(name: str, reward: RewardFunction) -> TaskPack:
    return TaskPack(name=name, rewards={name: reward})


def _load_object(spec: str, what: str) -> Any:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(f"cannot import {what} module {module_name!r}: {exc}") from None
    if not hasattr(module, attr):
        raise UserError(f"{spec!r}: {module_name} has no attribute {attr!r}")
    return getattr(module, attr)


def _entry_points() -> dict[str, str]:
    return {ep.name: ep.value for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def pack_names() -> list[str]:
    return sorted({**_entry_points(), **BUILTIN})


def load_pack(spec: str) -> TaskPack:
    """A task pack by name (bundled or registered by an installed package) or as module:ATTRIBUTE."""
    target = BUILTIN.get(spec) or _entry_points().get(spec)
    if target is None and ":" not in spec:
        raise UserError(f"unknown task pack {spec!r}: use one of {pack_names()} or module:ATTRIBUTE")
    pack = _load_object(target or spec, "task pack")
    if not isinstance(pack, TaskPack):
        raise UserError(f"{spec!r} is a {type(pack).__name__}, not a lightning_otel.rollouts.packs.TaskPack")
    return pack


def registered_rewards() -> dict[str, TaskPack]:
    """Every registered reward name, with the pack that registers it."""
    found: dict[str, TaskPack] = {}
    for name in pack_names():
        pack = load_pack(name)
        for reward in pack.rewards:
            found.setdefault(reward, pack)
    return found


def pack_for_reward(reward: str | None, pack: str | None = None) -> TaskPack | None:
    """The task pack a run uses: `pack` when given, else the pack that registers the reward name, else none."""
    if pack:
        chosen = load_pack(pack)
        if reward and ":" not in reward and reward not in chosen.rewards:
            raise UserError(f"task pack {chosen.name!r} has no reward {reward!r}: use one of "
                            f"{sorted(chosen.rewards)} or module:function")
        return chosen
    if reward and ":" not in reward:
        registered = registered_rewards()
        if reward not in registered:
            raise UserError(f"unknown reward {reward!r}: use one of {sorted(registered)} (registered by task "
                            "packs), module:function or path/to/file.py:function")
        return registered[reward]
    return None
