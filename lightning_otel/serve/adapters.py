"""One LoRA adapter per agent: named adapters, each serving (and trained on) the calls of the agents its pattern
matches.

`adapters = {writer = "generate_query", checker = "check_query"}`: a name (the adapter's folder in a checkpoint,
and a model name an agent may ask for) and a regular expression over whole agent names, the same matching the
compiler's `agents` option uses (`agent_regex`; the agent is the nearest agent/task/node span above the call,
the store's `trajectory_calls.agent`). The first pattern that matches wins; an agent no pattern matches is
served the base model and is not trained.

The gateway routes each call (`adapter_for`): to the adapter the request's `model` names, else to the adapter of
the agent that made it (the agent name the capture distro sends in AGENT_HEADER, derived from the agent
process's live span tree), else to the base model.
"""
from __future__ import annotations

import re
from urllib.parse import unquote

from lightning_otel.errors import UserError

AGENT_HEADER = "x-lightning-agent"  # the agent name the capture distro derives for each LLM request (lowercase)
AGENT_ATTRIBUTE = "lightning.agent"  # that name on the call's record (token record or forwarded call)
ADAPTER_ATTRIBUTE = "lightning.adapter"  # a token record's adapter (absent: the base model served the call)
MANIFEST = "adapters.json"  # a checkpoint or exported policy with adapters: {name: pattern, ...} and its folders
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
RESERVED = {"base", "critic", "optimizer", "adapter"}  # folder names a checkpoint already uses


def agent_regex(pattern: str) -> str:
    """The regular expression that matches a whole agent name (write_query is not rewrite_query); a call with
    no agent has the name ""."""
    return f"^(?:{pattern})$"


def check_adapters(adapters: object, label: str = "adapters") -> dict[str, str]:
    """`adapters` checked: names safe as folder names and unique (also ignoring case), patterns valid regular
    expressions; the same dict, in its order (the first pattern that matches an agent wins)."""
    if not isinstance(adapters, dict):
        raise UserError(f"{label} = {adapters!r}: give a table of adapter names and agent patterns, e.g. "
                        f'{{writer = "generate_query", checker = "check_query"}} (key=value: '
                        f'adapters={{"writer": "generate_query"}})')
    seen: dict[str, str] = {}
    for name, pattern in adapters.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name) or name.endswith("."):
            raise UserError(f"{label}: adapter name {name!r} cannot be a folder name: use letters, digits, '_', "
                            f"'-' and '.', starting with a letter or digit, at most 64 characters")
        if name.lower() in RESERVED:
            raise UserError(f"{label}: adapter name {name!r} is reserved (a checkpoint's own folder); choose "
                            f"another name")
        if name.lower() in seen:
            raise UserError(f"{label}: adapter names {seen[name.lower()]!r} and {name!r} differ only in case; "
                            f"their folders would collide on some file systems: rename one")
        seen[name.lower()] = name
        if not isinstance(pattern, str) or not pattern:
            raise UserError(f"{label}: {name} = {pattern!r}: give a regular expression over agent names, e.g. "
                            f'"generate_query" or "writer|rewriter"')
        try:
            re.compile(agent_regex(pattern))
        except re.error as exc:
            raise UserError(f"{label}: {name} = {pattern!r} is not a regular expression: {exc}") from None
    return dict(adapters)


def adapter_of_agent(adapters: dict[str, str], agent: str | None) -> str | None:
    """The adapter whose pattern matches the whole agent name first, or None (the base model)."""
    for name, pattern in adapters.items():
        if re.match(agent_regex(pattern), agent or ""):
            return name
    return None


def adapter_for(adapters: dict[str, str], requested_model: str | None, agent: str | None) -> str | None:
    """The adapter that serves a call: the one the request's model names, else the agent's, else None."""
    if requested_model in adapters:
        return requested_model
    return adapter_of_agent(adapters, agent)


__all__ = ["ADAPTER_ATTRIBUTE", "AGENT_ATTRIBUTE", "AGENT_HEADER", "header_agent", "MANIFEST", "adapter_for",
           "adapter_of_agent", "agent_regex", "check_adapters"]


def header_agent(headers: dict[str, str]) -> str | None:
    """The agent a request names in AGENT_HEADER (URL-quoted on the wire), or None."""
    agent = headers.get(AGENT_HEADER)
    return None if agent is None else unquote(agent)
