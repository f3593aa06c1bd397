"""Loading a config dataclass from a TOML file and `key=value` arguments, and writing it back as TOML.

Shared by the commands that take settings this way (`train`: train/config.py; `optimize`: train/apo/config.py).
Later sources win: defaults < TOML file < key=value < keyword values (CLI flags). No torch here: the prompt
optimiser loads its config with these too.
"""
from __future__ import annotations

import dataclasses
import json
import shlex
import tomllib
from pathlib import Path
from typing import Any

from lightning_otel.errors import UserError


def render_toml(config) -> str:
    """Any config dataclass as TOML (None values, deprecated keys already mapped, are left out)."""
    lines = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if value is None:  # a deprecated key, already mapped onto its new one; TOML has no null
            continue
        if isinstance(value, dict):  # an inline table of texts: {"writer" = "generate_query"}
            text = "{" + ", ".join(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in value.items()) + "}"
        elif isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (int, float)):
            text = repr(value)
        else:  # JSON strings (and lists of them) are TOML basic strings (and arrays): newlines escaped
            text = json.dumps(value)
        lines.append(f"{f.name} = {text}")
    return "\n".join(lines) + "\n"


def _coerce(name: str, kind: Any, raw: Any, label: str = "train config") -> Any:
    if isinstance(kind, str) and kind.endswith(" | None"):  # a deprecated key: its value's own type
        kind = kind[:-len(" | None")]
    if kind == "str | list[str]":  # a TOML array, or `key=[...]` as JSON, or a plain text
        if isinstance(raw, str) and raw.lstrip().startswith("["):
            try:
                return json.loads(raw)
            except json.JSONDecodeError as exc:
                raise UserError(f"{label}: {name} = {raw!r} is not a JSON list of texts ({exc})") from None
        return raw
    if kind == "list[str]":  # a TOML array, `key=["--a", "b"]` as JSON, or `key=--a b` split as a shell would
        if isinstance(raw, str):
            if raw.lstrip().startswith("["):
                try:
                    return json.loads(raw)
                except json.JSONDecodeError as exc:
                    raise UserError(f"{label}: {name} = {raw!r} is not a JSON list of texts ({exc})") from None
            try:
                return shlex.split(raw)
            except ValueError as exc:
                raise UserError(f"{label}: {name} = {raw!r}: {exc}") from None
        return raw
    if kind == "dict[str, str]":  # a TOML table, or `key={"a": "x"}` as JSON, or `key=a:x,b:y`
        if isinstance(raw, str):
            return _text_table(name, raw, label)
        return raw
    if kind == "list[int]":  # a TOML array, or `key=0,2` / `key=[0, 2]`
        if isinstance(raw, str):
            text = raw.strip().strip("[]")
            try:
                return [int(part) for part in text.split(",") if part.strip()]
            except ValueError:
                raise UserError(f"{label}: {name} = {raw!r} is not a list of whole numbers (e.g. 0,2)") from None
        return raw
    kind = {"str": str, "int": int, "float": float, "bool": bool}.get(kind, kind) if isinstance(kind, str) else kind
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        if str(raw).lower() in ("1", "true", "yes", "on"):
            return True
        if str(raw).lower() in ("0", "false", "no", "off"):
            return False
        raise UserError(f"{label}: {name} = {raw!r} is not true/false")
    try:
        return kind(raw) if not (kind is int and isinstance(raw, float)) else int(raw)
    except (TypeError, ValueError):
        raise UserError(f"{label}: {name} = {raw!r} is not a valid {kind.__name__}") from None


def _text_table(name: str, raw: str, label: str) -> dict:
    """`{"a": "x", "b": "y"}` (JSON) or `a:x,b:y` (patterns holding ',' or ':' need the JSON form)."""
    if raw.lstrip().startswith("{"):
        try:
            table = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise UserError(f"{label}: {name} = {raw!r} is not a JSON object ({exc})") from None
        if not isinstance(table, dict) or not all(isinstance(v, str) for v in table.values()):
            raise UserError(f"{label}: {name} = {raw!r}: give an object of texts, e.g. {{\"writer\": \"w.*\"}}")
        return table
    table: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in raw.split(","))):
        key, sep, value = part.partition(":")
        if not sep or key.strip() in table:
            raise UserError(f"{label}: {name} = {raw!r}: give name:pattern pairs, each name once, e.g. "
                            f"writer:generate_query,checker:check_query (or a JSON object)")
        table[key.strip()] = value.strip()
    return table


def load_settings(cls: type, label: str, path: Path | None = None, overrides: list[str] = (), **values: Any):
    """A config dataclass `cls` from defaults, then the TOML file, then `key=value` overrides, then keyword
    values (CLI flags); `label` names the config in errors ("train config", "optimize config")."""
    fields = {f.name: f.type for f in dataclasses.fields(cls)}
    merged: dict[str, Any] = {}
    if path is not None:
        try:
            merged.update(tomllib.loads(Path(path).read_text()))
        except FileNotFoundError:
            raise UserError(f"--config {path}: no such file") from None
        except tomllib.TOMLDecodeError as exc:
            raise UserError(f"--config {path}: not valid TOML ({exc})") from None
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise UserError(f"{item!r}: overrides are key=value (e.g. rounds=3)")
        merged[key.strip()] = raw.strip()
    merged.update({k: v for k, v in values.items() if v is not None})
    unknown = sorted(set(merged) - set(fields))
    if unknown:
        raise UserError(f"{label}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(fields))}")
    return cls(**{k: _coerce(k, fields[k], v, label) for k, v in merged.items()})


__all__ = ["load_settings", "render_toml"]
