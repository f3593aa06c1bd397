"""Reward functions, called by the rollout runner after each rollout as `fn(task, rollout) -> float | None`.

`task` is the task row (a dict from the task file); `rollout` is the rollout's row (`final_output`, status,
exit code, ...) plus `spans` (its spans as dicts) and `data_dir`. Returning None means "no reward": the
rollout is then excluded from training and counted, never scored 0.

Give one by the name a task pack registers (`spider_exec`, `number_match`: lightning_otel.rollouts.packs), as
`module:function` or as `path/to/file.py:function`.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

from lightning_otel.errors import UserError
from lightning_otel.rollouts.packs import RewardFunction, TaskPack, pack_for_reward

__all__ = ["RewardFunction", "call_reward", "resolve_reward"]


def resolve_reward(spec: str, pack: TaskPack | None = None) -> RewardFunction:
    """A name the run's task pack or a registered pack registers, `module:function` importable from the current
    environment, or `path/to/file.py:function` (imported as `python file.py` would: its folder's modules
    import)."""
    if pack is not None and spec in pack.rewards:
        return pack.rewards[spec]
    if ":" not in spec:
        pack = pack_for_reward(spec)  # UserError for a name no pack registers
        return pack.rewards[spec]  # type: ignore[union-attr]
    from lightning_otel.capture.agent_fn import load_agent_function, parse_agent_function

    in_file = parse_agent_function(spec)
    if in_file is not None and in_file.is_file:
        return load_agent_function(in_file, what="reward", call="fn(task, rollout)")
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(f"cannot import reward module {module_name!r}: {exc}") from None
    fn: Any = getattr(module, attr, None)
    if not callable(fn):
        raise UserError(f"{spec!r}: {module_name} has no function {attr!r}")
    return fn


def call_reward(fn: Callable[..., Any], task: dict, rollout: dict) -> float | None:
    """Call a reward function and check what it returned."""
    value = fn(task, rollout)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise UserError(f"reward function {getattr(fn, '__name__', fn)!r} returned {value!r}; "
                        f"return a finite number or None")
    return float(value)
