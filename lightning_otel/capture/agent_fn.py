"""Agent functions: the in-process rollout mode's agent, `fn(task, llm)`, named as `module:function` or
`path/to/file.py:function`.

    def run(task: dict, llm) -> str:            # llm: lightning_otel.LLM (duck typing is enough)
        client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key)
        ...
        return final_sql                         # the rollout's final_output (its last non-empty line)

`task` is the task's fields plus `db_path` (a fresh copy of its database when it has a `db_id`); `llm` says
where to send model calls for this rollout (its own gateway prefix) and which rollout it is. The runner
calls such functions in one long-lived worker process (lightning_otel.capture.agent_worker), many at a time.

This module is imported into agent processes: it must stay light (no duckdb, no torch; openai lazily).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from lightning_otel.errors import UserError

# No whitespace at all: `python agent.py:run` or `agent.py:run --x` are commands, as they always were.
_SPEC = re.compile(r"(?P<target>[^\s:]+):(?P<name>[A-Za-z_][A-Za-z0-9_]*)")
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


@dataclass(frozen=True)
class LLM:
    """Where one rollout sends its model calls, and which rollout it is."""
    base_url: str  # the rollout's own gateway prefix (.../r/<rollout_id>/v1): its calls are recorded under it
    api_key: str
    model: str  # the model name to ask for (LIGHTNING_MODEL in the subprocess mode)
    rollout_id: str
    task_id: str
    attempt: int

    def openai(self, **kwargs: Any):
        """An `openai.OpenAI` client on this rollout's base URL and key (kwargs go to the client)."""
        import openai  # lazily: the core does not depend on the SDK

        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key, **kwargs)


@dataclass(frozen=True)
class AgentFunction:
    """A parsed `module:function` or `file.py:function` agent spec."""
    spec: str
    target: str  # a dotted module name, or a path to a .py file
    name: str

    @property
    def is_file(self) -> bool:
        return self.target.endswith(".py")


def parse_agent_function(agent: str) -> AgentFunction | None:
    """The function spec in `agent`, or None when it is a shell command (anything with spaces, for one)."""
    match = _SPEC.fullmatch(agent.strip())
    if match is None:
        return None
    target, name = match["target"], match["name"]
    if not target.endswith(".py") and not _MODULE.fullmatch(target):
        return None
    return AgentFunction(agent.strip(), target, name)


def load_agent_function(agent: AgentFunction, what: str = "agent", call: str = "fn(task, llm)") -> Callable[..., Any]:
    """Import the module or file and return its function; a UserError says what is wrong and what to do.
    `what` and `call` name the function's role in those messages (rewards load this way too)."""
    module = _import_file(agent, what) if agent.is_file else _import_module(agent, what)
    fn = getattr(module, agent.name, None)
    if fn is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise UserError(f"{what} {agent.spec!r}: {agent.target} has no function {agent.name!r}; "
                        f"callables there: {public[:12]}")
    if not callable(fn):
        raise UserError(f"{what} {agent.spec!r}: {agent.name} is a {type(fn).__name__}, not a function; "
                        f"give a function called as {call}")
    return fn


def _import_module(agent: AgentFunction, what: str):
    # As `python -m` would: modules of the current folder import (the console script's sys.path lacks it).
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        return importlib.import_module(agent.target)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - any failure of the user's module is theirs to fix
        raise UserError(f"{what} {agent.spec!r}: cannot import module {agent.target!r} "
                        f"({type(exc).__name__}: {exc}); check the name and that it imports in this "
                        "environment (python -c 'import ...')") from None


def _import_file(agent: AgentFunction, what: str):
    path = Path(agent.target).expanduser().resolve()
    if not path.is_file():
        raise UserError(f"{what} {agent.spec!r}: file {agent.target} does not exist (relative paths are from "
                        f"{os.getcwd()})")
    key = f"lightning_agent_{abs(hash(str(path))):x}"
    if key in sys.modules:
        return sys.modules[key]
    # As `python file.py` would: the file's own folder comes first, so its sibling modules import.
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(key, path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[key] = module
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - SystemExit: argparse at module level, say
        del sys.modules[key]
        raise UserError(f"{what} {agent.spec!r}: {agent.target} does not import ({type(exc).__name__}: {exc}); "
                        f"run python {agent.target} to see the whole error") from None
    return module
