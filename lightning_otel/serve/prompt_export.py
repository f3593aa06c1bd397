"""Prompts out of the store and out of patch files (`lightning-otel export-prompt`).

`agent_prompts(db)`: each agent's system message(s) as its stored LLM calls sent them, with fingerprints (the
agent is the compiler's: the nearest agent, task or graph node span above the call). `agents_map(rows)` makes of
them the `agents` map of a patch file, so patches can target agents by name. `patched_prompts(...)`: what a
patch makes of its agent's prompt, the system text and demonstrations, for users who want the winner in their
own code.
"""
from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path
from typing import Any

from lightning_otel.errors import UserError
from lightning_otel.serve.prompts import FINGERPRINT_CHARS, PromptPatch, PromptPatches, content_text, fingerprint

log = logging.getLogger(__name__)

# Only what the system message comes from: the recorded system instructions, else the first input message.
SQL_AGENT_SYSTEMS = """
SELECT agent, system_instructions, json_extract(input_messages, '$[0]')::VARCHAR AS first_message,
       count(*) AS calls
FROM llm_calls WHERE agent IS NOT NULL
GROUP BY ALL
"""


def recorded_system(system_instructions: str | None, first_message: str | None) -> str | None:
    """The system text of a stored call: its gen_ai.system_instructions (text parts), else its first input
    message when that is a system one (parts schema, or OpenAI's content)."""
    for raw, is_message in ((system_instructions, False), (first_message, True)):
        if not raw:
            continue
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            continue
        if is_message:
            if not isinstance(value, dict) or value.get("role") not in ("system", "developer"):
                return None
            parts = value.get("parts")
            value = parts if isinstance(parts, list) else value.get("content")
        if isinstance(value, dict):
            value = [value]
        text = content_text(value)
        if text:
            return text
    return None


def agent_prompts(db: Path | str) -> list[dict]:
    """One row per (agent, system text) of the stored calls: agent, system_sha256, system, calls; most calls
    first within an agent. Calls without a system message are left out (a patch cannot target them)."""
    from lightning_otel.span_store import client

    counts: dict[tuple[str, str], int] = defaultdict(int)
    for row in client.query(SQL_AGENT_SYSTEMS, db).iter_rows(named=True):
        text = recorded_system(row["system_instructions"], row["first_message"])
        if text is not None:
            counts[(row["agent"], text)] += int(row["calls"])
    rows = [{"agent": agent, "system_sha256": fingerprint(text), "system": text, "calls": calls}
            for (agent, text), calls in counts.items()]
    return sorted(rows, key=lambda r: (r["agent"], -r["calls"], r["system_sha256"]))


def agents_map(rows: list[dict]) -> dict[str, dict]:
    """The `agents` map of a patch file from agent_prompts rows: an agent with one system text gets it as
    "system"; one with several gets its most used as "system" and all their fingerprints."""
    by_agent: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        by_agent[row["agent"]].append(row)
    agents = {}
    for name, texts in by_agent.items():
        entry: dict[str, Any] = {"system": max(texts, key=lambda r: r["calls"])["system"]}
        if len(texts) > 1:
            entry["system_sha256"] = [r["system_sha256"] for r in texts]
        agents[name] = entry
    return agents


def shared_fingerprints(rows: list[dict]) -> dict[str, list[str]]:
    """Fingerprints that more than one agent sends, with those agents: the gateway cannot tell them apart."""
    agents: dict[str, set[str]] = defaultdict(set)
    for row in rows:
        agents[row["system_sha256"]].add(row["agent"])
    return {f: sorted(names) for f, names in agents.items() if len(names) > 1}


def _base_text(patch: PromptPatch, patches: PromptPatches, stored: list[dict] | None) -> str | None:
    """The system text `patch` changes, from the patch file's agents map, else from the store's calls."""
    if "agent" in patch.target:
        known = patches.agents[patch.target["agent"]].system
        if known is not None:
            return known
    if "system_prefix" in patch.target:  # the instruction every matched text starts with (the rest varies)
        return patch.target["system_prefix"]
    for row in stored or []:
        if any(f[:FINGERPRINT_CHARS] == row["system_sha256"] for f in patch.fingerprints):
            return row["system"]
    return None


def patched_prompt(patch: PromptPatch, patches: PromptPatches, stored: list[dict] | None = None) -> dict:
    """What `patch` makes of its target's prompt: the system text (None when the patch leaves it as it is and
    it is not known), the demonstrations, and the messages that open every patched call."""
    base = _base_text(patch, patches, stored)
    action = patch.action
    if action.changes_system and action.replace is None and base is None:
        where = f"agents.{patch.target['agent']}" if "agent" in patch.target else "agents"
        raise UserError(f"{patches.source}: patch {patch.id!r} extends the system text of {patch.target_label}, "
                        f"which is not known here: add its text as \"system\" under {where}, or give --db with "
                        f"stored traces of its calls")
    system = patch.system(base or "") if action.changes_system else base
    demos = [{"user": d.user, "assistant": d.assistant} for d in action.demos]
    messages = ([{"role": "system", "content": system}] if system is not None else []) + action.demo_messages()
    return {"id": patch.id, "version": patch.version, "target": patch.target, "system": system, "demos": demos,
            "messages": messages}


def patched_prompts(patches: PromptPatches, patch_id: str | None = None, db: Path | str | None = None
                    ) -> list[dict]:
    """patched_prompt of every patch, or of the one with `patch_id`; `db`: a store to read base texts from."""
    chosen = [patches.by_id(patch_id)] if patch_id is not None else patches.patches
    stored = agent_prompts(db) if db is not None else None
    return [patched_prompt(p, patches, stored) for p in chosen]


def render_text(prompts: list[dict]) -> str:
    """Patched prompts as plain text: per patch a heading, the system text, then each demonstration."""
    blocks = []
    for prompt in prompts:
        target = ", ".join(f"{k} {v}" for k, v in prompt["target"].items())
        lines = [f"# patch {prompt['id']} (version {prompt['version']}), {target}", "", "## system"]
        lines.append(prompt["system"] if prompt["system"] is not None else "(the agent's own, unchanged)")
        for i, demo in enumerate(prompt["demos"], 1):
            lines += ["", f"## demonstration {i}: user", demo["user"], "", f"## demonstration {i}: assistant",
                      demo["assistant"]]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


def render_agents_text(rows: list[dict]) -> str:
    """agent_prompts rows as plain text: per agent and system text, its fingerprint, its calls, the text."""
    blocks = [f"# agent {r['agent']}: system_sha256 {r['system_sha256']}, {r['calls']} call(s)\n\n{r['system']}"
              for r in rows]
    return "\n\n".join(blocks) + "\n"
