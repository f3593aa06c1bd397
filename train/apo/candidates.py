"""Candidates: the texts the optimiser changes, and the prompt patch each candidate is run with.

A component is one system message the agent sends (one agent's instruction; found in the seed rollouts'
stored calls, `discover_components`). An agent whose system message is an instruction followed by what changes
per task (a schema, retrieved text) sends several texts with the same first line: they make one component, whose
text is the whole lines they all start with, and whose patch targets that leading text (`system_prefix`), so a
candidate reaches the agent's calls on every task, seen or not. A candidate maps each component's name to a
system text, and may add a set of demonstrations to a component under `<name>::demos` (a JSON list of
{"user", "assistant"} pairs):

    {"answer": "You answer in one word.", "answer::demos": "[{\"user\": \"...\", \"assistant\": \"...\"}]"}

The seed candidate holds every component's own text and no demonstrations. A candidate's key names what it
changes: `base` when it changes nothing (it runs with no patch at all, the agent's own prompt), else the first 12
hex digits of the sha256 of its changes; the key is the patch version every patched call records
(`lightning.prompt.version`), and the evaluations of equal candidates are shared. The patch of a candidate
(`candidate_patch`) targets each changed component by name through the file's `agents` map, which gives the
component's own text, so the gateway finds its calls by their system message's fingerprint.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from lightning_otel.errors import UserError
from lightning_otel.serve.prompt_export import recorded_system
from lightning_otel.serve.prompts import fingerprint, first_target, normalised, parse_patches

DEMOS = "::demos"
BASE = "base"
PATCH_ID_PREFIX = "apo-"
MIN_PREFIX_CHARS = 20  # a shared leading text shorter than this (normalised) is no instruction: texts stay apart

# The system message of every stored call of the given rollouts, by agent (NULL for a bare SDK call).
SQL_CALL_SYSTEMS = """
SELECT agent, system_instructions, json_extract(input_messages, '$[0]')::VARCHAR AS first_message,
       count(*) AS calls
FROM llm_calls WHERE rollout_id IN ({ids})
GROUP BY ALL
"""


@dataclass(frozen=True)
class Component:
    name: str                 # its key in a candidate and in the patch file's agents map
    system: str               # the text the agent itself sends
    agents: tuple[str, ...]   # the agents (as the compiler names them) whose calls send it; () for bare calls
    calls: int = 0            # calls of the seed rollouts that sent it
    prefix: bool = False      # `system` is what the sent texts start with, the rest varying per task

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.system)


def component_of(components: list[Component], text: str | None) -> Component | None:
    """The component a call with system text `text` belongs to, as the gateway matches its patches: an exact
    text first, then a leading text."""
    return first_target(components, text, lambda c: () if c.prefix else (c.fingerprint,),
                        lambda c: normalised(c.system) if c.prefix else None)


def first_line(text: str) -> str:
    return normalised(text.strip().split("\n", 1)[0])


def shared_lead(texts: list[str]) -> str | None:
    """The whole lines every text starts with (the first line at least, as the texts share it); None when too
    short to be an instruction."""
    common = os.path.commonprefix([t.lstrip() for t in texts])
    lead = common[:common.rfind("\n")] if "\n" in common else ""
    lead = lead.rstrip() or texts[0].lstrip().split("\n", 1)[0].rstrip()
    return lead if len(normalised(lead)) >= MIN_PREFIX_CHARS else None


def merge_templated(texts: dict[str, dict]) -> dict[str, dict]:
    """Texts by fingerprint, those of one sender (the same agents, or bare calls) that share their first line
    merged into one entry of their shared leading lines (`prefix`), keyed by its fingerprint."""
    groups: dict[tuple, list[str]] = defaultdict(list)
    for fp, entry in texts.items():
        groups[(tuple(sorted(entry["agents"])), first_line(entry["system"]))].append(fp)
    merged = {}
    for prints in groups.values():
        lead = shared_lead([texts[fp]["system"] for fp in prints]) if len(prints) > 1 else None
        if lead is None:
            merged.update({fp: texts[fp] for fp in prints})
            continue
        merged[fingerprint(lead)] = {"system": lead, "prefix": True,
                                     "agents": set().union(*(texts[fp]["agents"] for fp in prints)),
                                     "calls": sum(texts[fp]["calls"] for fp in prints)}
    return merged


def components_from_rows(rows: list[dict], agents_pattern: str = "") -> list[Component]:
    """Components from (agent, system_instructions, first_message, calls) rows of stored calls: one per distinct
    system text, kept when one of its agents matches `agents_pattern` (whole name; "" keeps all, bare calls too)."""
    texts: dict[str, dict] = {}
    for row in rows:
        text = recorded_system(row["system_instructions"], row["first_message"])
        if text is None:
            continue
        entry = texts.setdefault(fingerprint(text), {"system": text, "agents": set(), "calls": 0})
        entry["calls"] += int(row["calls"])
        if row["agent"]:
            entry["agents"].add(row["agent"])
    texts = merge_templated(texts)
    pattern = re.compile(agents_pattern) if agents_pattern else None
    kept = {fp: e for fp, e in texts.items()
            if pattern is None or any(pattern.fullmatch(a) for a in e["agents"])}
    texts_per_agent: dict[str, int] = defaultdict(int)
    for entry in kept.values():
        for agent in entry["agents"]:
            texts_per_agent[agent] += 1
    components = []
    for fp, entry in sorted(kept.items(), key=lambda item: (-item[1]["calls"], item[0])):
        agents = tuple(sorted(entry["agents"]))
        name = "+".join(agents) if agents else f"system-{fp[:8]}"
        if any(texts_per_agent[a] > 1 for a in agents):
            name = f"{name}@{fp[:8]}"
        components.append(Component(name, entry["system"], agents, entry["calls"], entry.get("prefix", False)))
    return components


def discover_components(db: Path, rollout_ids: list[str], agents_pattern: str = "") -> list[Component]:
    """The system messages the given (seed) rollouts' calls sent, as components (components_from_rows)."""
    from lightning_otel.span_store import client

    if not rollout_ids:
        return []
    ids = ", ".join(client.sql_literal(i) for i in sorted(rollout_ids))
    rows = client.query(SQL_CALL_SYSTEMS.format(ids=ids), db).to_dicts()
    return components_from_rows(rows, agents_pattern)


def seed_candidate(components: list[Component]) -> dict[str, str]:
    return {c.name: c.system for c in components}


def demos_of(candidate: dict[str, str], name: str) -> list[dict]:
    raw = candidate.get(name + DEMOS)
    return json.loads(raw) if raw else []


def with_demos(candidate: dict[str, str], name: str, demos: list[dict]) -> dict[str, str]:
    """The candidate with `demos` as the demonstrations of component `name` (replacing any it had)."""
    changed = {k: v for k, v in candidate.items() if k != name + DEMOS}
    if demos:
        changed[name + DEMOS] = json.dumps([{"user": d["user"], "assistant": d["assistant"]} for d in demos],
                                           ensure_ascii=False)
    return changed


def changes(candidate: dict[str, str], components: list[Component]) -> dict[str, str]:
    """What the candidate changes against the seed: texts that differ, and demonstrations."""
    known = {c.name: c for c in components}
    unknown = sorted(k for k in candidate if k.removesuffix(DEMOS) not in known)
    if unknown:
        raise ValueError(f"candidate names unknown component(s) {unknown}; the components are {sorted(known)}")
    return {k: v for k, v in sorted(candidate.items())
            if (k.endswith(DEMOS) and demos_of(candidate, k.removesuffix(DEMOS)))
            or (not k.endswith(DEMOS) and v != known[k].system)}


def candidate_key(candidate: dict[str, str], components: list[Component]) -> str:
    """`base` for a candidate that changes nothing, else a short hash of its changes (module docstring)."""
    changed = changes(candidate, components)
    if not changed:
        return BASE
    return hashlib.sha256(json.dumps(changed, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:12]


def candidate_patch(candidate: dict[str, str], components: list[Component]) -> dict | None:
    """The prompt patch file (as data) that runs the agent with `candidate`; None when it changes nothing."""
    changed = changes(candidate, components)
    if not changed:
        return None
    version = candidate_key(candidate, components)
    patches = []
    for component in components:
        action: dict = {}
        text = candidate.get(component.name, component.system)
        if text != component.system:
            if not text.strip():
                raise UserError(f"candidate {version}: the system text of {component.name} is empty")
            action["replace"] = text
        if demos := demos_of(candidate, component.name):
            action["demos"] = demos
        if action:
            target = {"system_prefix": component.system} if component.prefix else {"agent": component.name}
            patches.append({"id": PATCH_ID_PREFIX + component.name, "version": version,
                            "description": f"prompt optimiser candidate {version}", "target": target,
                            "action": action})
    data = {"agents": {c.name: {"system": c.system} for c in components if not c.prefix}, "patches": patches}
    parse_patches(data, f"candidate {version}")  # what the gateway will read: checked here
    return data


def write_patch(candidate: dict[str, str], components: list[Component], folder: Path) -> Path | None:
    """The candidate's patch file in `folder` (`<key>.json`), written once; None for the seed."""
    data = candidate_patch(candidate, components)
    if data is None:
        return None
    path = folder / f"{candidate_key(candidate, components)}.json"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".tmp")
        partial.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
        partial.replace(path)
    return path


__all__ = ["Component", "component_of", "components_from_rows", "discover_components", "seed_candidate",
           "candidate_key", "candidate_patch", "write_patch", "with_demos", "demos_of", "changes", "BASE", "DEMOS"]
