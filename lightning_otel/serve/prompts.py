"""Prompt patches: a changed prompt for chosen agents, applied by the gateway, the agent's code untouched.

A patch file (JSON, or TOML by its `.toml` suffix; docs/prompts.md) holds a list of patches, each an id, a
version, a target and an action, and a map from agent names to the system messages those agents send:

    {"agents": {"generate_query": {"system": "You work with a SQL database. ..."}},
     "patches": [{"id": "gq-limit", "version": "2", "target": {"agent": "generate_query"},
                  "action": {"append": "Always end the query with LIMIT 5.", "demos": [{"user": "...",
                                                                                       "assistant": "..."}]}}]}

Targeting. The compiler names a call's agent from the spans above it (the LangGraph node, the CrewAI agent);
the gateway sees only the request, and those spans usually reach the store after the call (a parent span is
exported when it ends). What every request does carry is its system message, and an agent's calls send the
same one each time. So a call is matched by the fingerprint of its system message: sha256 of the text with
every run of whitespace made one space and the ends stripped (`fingerprint`, the first 16 hex digits). A
target names the fingerprint (`system_sha256`), or an agent, which the file's `agents` map resolves to
fingerprints: given as `system_sha256` (one or a list), or as the system text itself (`system`), which also
gives `export-prompt` the base text an extension extends. `lightning-otel export-prompt --db` writes the map
from stored traces (prompt_export.py). An agent whose system message changes per task (an instruction, then a
database schema or retrieved documents) is targeted by what every one of its texts starts with:
`system_prefix`, the instruction's text, matched on the normalised texts; there `replace` replaces that
leading part and keeps the rest of each call's text. A call that a fingerprint and a prefix both match takes
the fingerprint's patch (the more exact). What this cannot do, said plainly: a call without a system message is
never patched; two agents that send the same system message cannot be told apart, so a patch that targets one
of them by name is refused.

Actions (one patch may combine them): `replace` the system text, or extend it: `prepend` / `append` a text,
joined to it by a blank line; and `demos`, few-shot demonstrations as user / assistant pairs, inserted after the
system message(s) that open the conversation and before the rest. One call takes at most one patch: two patches
that target the same system message are refused when the file is read.
"""
from __future__ import annotations

import copy
import hashlib
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

from lightning_otel.errors import UserError

VERSION_ATTRIBUTE = "lightning.prompt.version"
PATCH_ID_ATTRIBUTE = "lightning.prompt.patch_id"
FINGERPRINT_CHARS = 16
SEPARATOR = "\n\n"  # between a system text and what a patch prepends or appends
SYSTEM_ROLES = ("system", "developer")
TEXT_PART_TYPES = ("text", "input_text", "output_text")
FILE_KEYS = ("agents", "patches")
PATCH_KEYS = ("id", "version", "target", "action", "description")
TARGET_KEYS = ("agent", "system_sha256", "system_prefix")
ACTION_KEYS = ("replace", "prepend", "append", "demos")
AGENT_KEYS = ("system", "system_sha256")
DEMO_KEYS = ("user", "assistant")
HEX = frozenset("0123456789abcdef")


def normalised(text: str) -> str:
    """The text a fingerprint is taken of: runs of whitespace made one space, the ends stripped."""
    return " ".join(text.split())


def fingerprint(text: str, chars: int = FINGERPRINT_CHARS) -> str:
    """The short hex sha256 of a system text, normalised (module docstring)."""
    return hashlib.sha256(normalised(text).encode()).hexdigest()[:chars]


T = TypeVar("T")


def first_target(items: Iterable[T], text: str | None, fingerprints: Callable[[T], Iterable[str]],
                 prefix: Callable[[T], str | None]) -> T | None:
    """The item a call with system text `text` falls under, as the gateway decides (module docstring): the first
    whose `fingerprints` name the text exactly (its normalised sha256 starts with one of them), else the first
    whose normalised leading text (`prefix`, None for none) the normalised text starts with."""
    if text is None:
        return None
    items = list(items)
    flat = normalised(text)
    digest = hashlib.sha256(flat.encode()).hexdigest()
    exact = next((item for item in items if any(digest.startswith(f) for f in fingerprints(item))), None)
    if exact is not None:
        return exact
    return next((item for item in items if (lead := prefix(item)) is not None and flat.startswith(lead)), None)


def normalised_end(text: str, length: int) -> int:
    """The index in `text` just past the first `length` characters of normalised(text) (a run of whitespace
    counts as the one space it becomes; the leading whitespace is skipped)."""
    i = len(text) - len(text.lstrip())
    for _ in range(length):
        if i >= len(text):
            break
        if text[i].isspace():
            while i < len(text) and text[i].isspace():
                i += 1
        else:
            i += 1
    return i


def content_text(content: Any) -> str | None:
    """A message's text: its content string, or its text parts joined; None when it has no text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [p.get("text") if "text" in p else p.get("content") for p in content
                 if isinstance(p, dict) and p.get("type") in TEXT_PART_TYPES]
        texts = [t for t in texts if isinstance(t, str)]
        return "".join(texts) if texts else None
    return None


def system_text(messages: Any) -> str | None:
    """The system text of a chat request: its first message's, when that is a system (or developer) message."""
    if not isinstance(messages, list) or not messages or not isinstance(messages[0], dict):
        return None
    first = messages[0]
    return content_text(first.get("content")) if first.get("role") in SYSTEM_ROLES else None


@dataclass(frozen=True)
class Demo:
    user: str
    assistant: str


@dataclass(frozen=True)
class Action:
    replace: str | None = None
    prepend: str | None = None
    append: str | None = None
    demos: tuple[Demo, ...] = ()

    @property
    def changes_system(self) -> bool:
        return any(x is not None for x in (self.replace, self.prepend, self.append))

    def system(self, base: str) -> str:
        """The system text this action makes of `base`."""
        text = self.replace if self.replace is not None else base
        if self.prepend is not None:
            text = self.prepend + SEPARATOR + text.lstrip()
        if self.append is not None:
            text = text.rstrip() + SEPARATOR + self.append
        return text

    def demo_messages(self) -> list[dict]:
        return [m for d in self.demos for m in ({"role": "user", "content": d.user},
                                                {"role": "assistant", "content": d.assistant})]


@dataclass(frozen=True)
class PromptPatch:
    id: str
    version: str
    target: dict  # {"agent": name}, {"system_sha256": hex} or {"system_prefix": text}, as written
    action: Action
    fingerprints: tuple[str, ...]  # the system messages it applies to (hex prefixes of their sha256)
    description: str = ""
    prefix: str | None = None  # the normalised leading text of the system messages it applies to

    def system(self, base: str) -> str:
        """The system text this patch makes of `base`: a prefix target's `replace` replaces the leading part."""
        if self.prefix is not None and self.action.replace is not None:
            return self.action.replace.rstrip() + base[normalised_end(base, len(self.prefix)):]
        return self.action.system(base)

    @property
    def target_label(self) -> str:
        if "agent" in self.target:
            return f"agent {self.target['agent']}"
        if self.prefix is not None:
            shown = self.prefix if len(self.prefix) <= 48 else self.prefix[:45] + "..."
            return f"system_prefix {shown!r}"
        return f"system_sha256 {self.target['system_sha256']}"

    def record(self) -> dict[str, str]:
        """The attributes a patched call's token record carries."""
        return {VERSION_ATTRIBUTE: self.version, PATCH_ID_ATTRIBUTE: self.id}


@dataclass(frozen=True)
class AgentPrompt:
    """What the patch file knows of an agent's system message: its fingerprints, and its text when given."""
    fingerprints: tuple[str, ...]
    system: str | None = None


@dataclass
class PromptPatches:
    patches: list[PromptPatch]
    agents: dict[str, AgentPrompt] = field(default_factory=dict)
    source: str = "prompt patches"  # the file it came from, for messages

    def find(self, messages: Any) -> PromptPatch | None:
        """The patch for a chat request with these messages, or None."""
        return first_target(self.patches, system_text(messages), lambda p: p.fingerprints, lambda p: p.prefix)

    def apply(self, body: dict) -> tuple[dict, PromptPatch | None]:
        """The chat request as the engine should get it, and the patch applied (None: `body` itself, untouched).
        The given request is not changed: a Responses call keeps its conversation unpatched."""
        patch = self.find(body.get("messages"))
        if patch is None:
            return body, None
        messages = [copy.copy(m) for m in body["messages"]]
        if patch.action.changes_system:
            messages[0]["content"] = patch.system(system_text(messages) or "")
        at = 1 + next((i for i, m in enumerate(messages[1:]) if m.get("role") not in SYSTEM_ROLES),
                      len(messages) - 1)
        messages[at:at] = patch.action.demo_messages()
        return {**body, "messages": messages}, patch

    def by_id(self, patch_id: str) -> PromptPatch:
        for patch in self.patches:
            if patch.id == patch_id:
                return patch
        raise UserError(f"{self.source}: no patch with id {patch_id!r}; its patches are "
                        f"{', '.join(p.id for p in self.patches)}")


# ---- reading a patch file -----------------------------------------------------------------------------------

def load_patches(path: Path | str) -> PromptPatches:
    """A patch file, checked: every mistake is a UserError that names the file and the patch."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"prompt patch file {path}: no such file; give a JSON file of patches (docs/prompts.md)")
    text = path.read_text(encoding="utf-8")
    try:
        data = tomllib.loads(text) if path.suffix.lower() == ".toml" else json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{path}: not valid TOML ({exc})") from None
    return parse_patches(data, str(path))


def _unknown(where: str, value: dict, known: tuple[str, ...]) -> None:
    extra = sorted(set(value) - set(known))
    if extra:
        raise UserError(f"{where}: unknown key(s) {', '.join(map(repr, extra))}; the keys are {', '.join(known)}")


def _object(where: str, value: Any, what: str) -> dict:
    if not isinstance(value, dict):
        raise UserError(f"{where}: {what} must be an object, not {type(value).__name__}")
    return value


def _text(where: str, value: Any, key: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise UserError(f"{where}: {key!r} must be a non-empty text")
    return value


def _hex(where: str, value: Any) -> str:
    if not (isinstance(value, str) and FINGERPRINT_CHARS <= len(value) <= 64 and set(value.lower()) <= HEX):
        raise UserError(f"{where}: system_sha256 {value!r} must be {FINGERPRINT_CHARS} to 64 hex digits of the "
                        f"system message's sha256 (lightning-otel export-prompt --db writes them)")
    return value.lower()


def _agents(source: str, value: Any) -> dict[str, AgentPrompt]:
    agents = {}
    for name, entry in _object(f"{source}: agents", value, "\"agents\"").items():
        where = f"{source}: agents.{name}"
        entry = _object(where, entry, "an agent's entry")
        _unknown(where, entry, AGENT_KEYS)
        sums = entry.get("system_sha256", [])
        sums = [_hex(where, s) for s in (sums if isinstance(sums, list) else [sums])]
        system = _text(where, entry["system"], "system") if "system" in entry else None
        if system is not None:
            sums.append(fingerprint(system))
        if not sums:
            raise UserError(f"{where}: give the agent's system message as \"system\" (its text) or "
                            f"\"system_sha256\" (its fingerprint)")
        agents[name] = AgentPrompt(tuple(dict.fromkeys(sums)), system)
    return agents


def _action(where: str, value: Any) -> Action:
    value = _object(where, value, "\"action\"")
    _unknown(f"{where}: action", value, ACTION_KEYS)
    if not value:
        raise UserError(f"{where}: the action is empty; give replace, prepend, append and/or demos")
    if "replace" in value and ("prepend" in value or "append" in value):
        raise UserError(f"{where}: replace gives the whole system text: write what prepend/append add into it")
    texts = {k: _text(f"{where}: action", value[k], k) for k in ("replace", "prepend", "append") if k in value}
    demos = value.get("demos", [])
    if not isinstance(demos, list) or ("demos" in value and not demos):
        raise UserError(f"{where}: demos must be a non-empty list of {{\"user\": ..., \"assistant\": ...}} pairs")
    pairs = []
    for i, demo in enumerate(demos):
        demo = _object(f"{where}: demos[{i}]", demo, "a demonstration")
        _unknown(f"{where}: demos[{i}]", demo, DEMO_KEYS)
        missing = [k for k in DEMO_KEYS if k not in demo]
        if missing:
            raise UserError(f"{where}: demos[{i}] has no {' or '.join(missing)}: give both the user's message "
                            f"and the assistant's answer")
        pairs.append(Demo(*(_text(f"{where}: demos[{i}]", demo[k], k) for k in DEMO_KEYS)))
    return Action(demos=tuple(pairs), **texts)


def _patch(source: str, index: int, value: Any, agents: dict[str, AgentPrompt]) -> PromptPatch:
    where = f"{source}: patch {index}"
    value = _object(where, value, "a patch")
    if isinstance(value.get("id"), str) and value["id"].strip():
        where = f"{where} ({value['id']!r})"
    _unknown(where, value, PATCH_KEYS)
    missing = [k for k in ("id", "version", "target", "action") if k not in value]
    if missing:
        raise UserError(f"{where}: missing {', '.join(missing)}; a patch has an id, a version, a target "
                        f"({{\"agent\": NAME}}, {{\"system_sha256\": HEX}} or {{\"system_prefix\": TEXT}}) "
                        f"and an action")
    patch_id = _text(where, value["id"], "id")
    version = value["version"]
    if isinstance(version, bool) or not isinstance(version, (str, int)) or not str(version).strip():
        raise UserError(f"{where}: version must be a non-empty text or a number")
    target = _object(where, value["target"], "\"target\"")
    _unknown(f"{where}: target", target, TARGET_KEYS)
    if len(target) != 1:
        raise UserError(f"{where}: the target names one of agent (a name in \"agents\"), system_sha256 or "
                        f"system_prefix")
    if "agent" in target:
        name = _text(where, target["agent"], "agent")
        if name not in agents:
            listed = ", ".join(agents) or "none"
            raise UserError(f"{where}: targets agent {name!r}, which \"agents\" does not list ({listed}): "
                            f"add its system message there (lightning-otel export-prompt --db traces.duckdb "
                            f"lists each agent's, from stored traces)")
        sums = agents[name].fingerprints
        for other, prompt in agents.items():
            shared = [f for f in sums if any(_overlap(f, g) for g in prompt.fingerprints)]
            if other != name and shared:
                raise UserError(f"{where}: agents {name!r} and {other!r} send the same system message ({shared[0]}): "
                                f"the gateway tells calls apart by it, so it cannot patch one and not the other; "
                                f"target its system_sha256 instead, knowing both agents' calls change")
    else:
        sums = (_hex(where, target["system_sha256"]),) if "system_sha256" in target else ()
    prefix = normalised(_text(where, target["system_prefix"], "system_prefix")) if "system_prefix" in target else None
    description = value.get("description", "")
    if not isinstance(description, str):
        raise UserError(f"{where}: description must be a text")
    return PromptPatch(patch_id, str(version), dict(target), _action(where, value["action"]), sums, description,
                       prefix)


def _overlap(a: str, b: str) -> bool:
    return a.startswith(b) or b.startswith(a)


def parse_patches(data: Any, source: str = "prompt patches") -> PromptPatches:
    """Patches from a patch file's parsed content, checked (module docstring)."""
    data = _object(source, data, "the patch file")
    _unknown(source, data, FILE_KEYS)
    agents = _agents(source, data.get("agents", {}))
    raw = data.get("patches")
    if not isinstance(raw, list) or not raw:
        raise UserError(f"{source}: \"patches\" must be a non-empty list of patches (each an id, a version, a "
                        f"target and an action; docs/prompts.md)")
    patches = [_patch(source, i, p, agents) for i, p in enumerate(raw)]
    seen: dict[str, PromptPatch] = {}
    for patch in patches:
        if patch.id in seen:
            raise UserError(f"{source}: two patches have the id {patch.id!r}; give each its own")
        for earlier in seen.values():
            if any(_overlap(f, g) for f in patch.fingerprints for g in earlier.fingerprints) or (
                    patch.prefix is not None and earlier.prefix is not None and _overlap(patch.prefix, earlier.prefix)):
                raise UserError(f"{source}: patches {earlier.id!r} ({earlier.target_label}) and {patch.id!r} "
                                f"({patch.target_label}) target the same system message; one call takes one patch: "
                                f"merge their actions into one, or keep each in its own file")
        seen[patch.id] = patch
    return PromptPatches(patches, agents, source)


__all__ = ["PromptPatch", "PromptPatches", "Action", "Demo", "AgentPrompt", "load_patches", "parse_patches",
           "fingerprint", "system_text", "VERSION_ATTRIBUTE", "PATCH_ID_ATTRIBUTE"]
