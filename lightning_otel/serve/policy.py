"""Which weights a command should serve, from one `--model` value (eval, serve, train's warm start).

    policy = resolve_policy("runs/sql-grpo")      # a training run folder: its best checkpoint
    policy.base_model, policy.adapter, policy.label

Accepted values, checked in this order:
- `base` (or `bundled`): the bundled model, no adapter.
- a training run folder (has `run.json`): the checkpoint named by run.json's `best` key, else `last`
  (a path relative to the run folder, e.g. "checkpoints/round-0003"), resolved as below.
- a checkpoint folder with `adapter/`: that LoRA adapter (and its `merged/` copy when the trainer wrote one,
  which an engine already running on it serves as is); with `model/`: that full model folder.
- a checkpoint (or exported policy) with one adapter per agent (has `adapters.json`: the agent patterns and
  each adapter's folder): every adapter, served under its name, routed by agent (serve/adapters.py).
- a PEFT LoRA adapter folder (has `adapter_config.json`). Its base model is the `model` key of the
  nearest run.json above it (up to three levels: adapter -> checkpoint -> checkpoints -> run), else the
  adapter config's `base_model_name_or_path` when that is a local model folder, else the bundled model.
- a Hugging Face model folder (has `config.json`): served as is.
- a Hugging Face hub id, `org/name` or `org/name@revision` (when no such folder exists): its snapshot folder in the
  hub cache, downloaded first when the hub can be reached (serve/hub.py).
Anything else is a UserError saying what was expected. A run.json `model` or an adapter's
`base_model_name_or_path` may be a hub id too (an adapter's `revision` key pins it).
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from lightning_otel.errors import UserError
from lightning_otel.serve.adapters import MANIFEST, check_adapters
from lightning_otel.serve.hub import parse_hub_id, resolve_hub_model

log = logging.getLogger(__name__)

BASE_NAMES = ("base", "bundled")
EXPECTED = ("'base' (the bundled model), a training run folder (with run.json), a checkpoint folder "
            "(with adapter/ or model/), a PEFT LoRA adapter folder (with adapter_config.json), a Hugging "
            "Face model folder (with config.json) or a Hugging Face hub id (org/name or org/name@revision)")
ROUND = re.compile(r"round-?(\d+)$")


@dataclass(frozen=True)
class Policy:
    base_model: Path            # model folder the engine starts on
    adapter: Path | None        # LoRA adapter hot-loaded on top of it; None = serve base_model as is
    label: str                  # for people: "base", "run-x/checkpoints/round-0003", a folder name
    version: int = 0            # policy version to serve it as: 0 = base, else the version the trainer gave the
                                # checkpoint (its policy.json), else the checkpoint's round (or 1)
    run_dir: Path | None = None  # the training run it came from (its metrics.jsonl feeds reports)
    merged: Path | None = None   # the checkpoint's merged/ copy (serve_merged): base + adapter as full weights,
                                 # served instead of the adapter by an engine already running on it
    # one adapter per agent: each adapter's folder by name, and the agent patterns that route calls to them
    adapters: dict[str, Path] = field(default_factory=dict)
    routes: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"base_model": str(self.base_model), "adapter": str(self.adapter) if self.adapter else None,
                "label": self.label, "version": self.version,
                "run_dir": str(self.run_dir) if self.run_dir else None,
                **({"adapters": {k: str(v) for k, v in self.adapters.items()}, "routes": self.routes}
                   if self.adapters else {})}


def resolve_policy(spec: str | Path, python: str | None = None) -> Policy:
    """Turn a --model value into a Policy; `python` converts the bundled model on first use."""
    text = str(spec).strip()
    if text in BASE_NAMES:
        return Policy(_bundled(python), None, "base")
    path = Path(text).expanduser()
    if not path.exists() and parse_hub_id(text) is not None:
        hub = resolve_hub_model(text)
        return Policy(hub.path, None, hub.spec)
    if not path.exists():
        raise UserError(f"--model {text}: no such folder; expected {EXPECTED}")
    if not path.is_dir():
        raise UserError(f"--model {text} is a file; expected {EXPECTED}")
    path = path.resolve()
    if (path / "run.json").is_file():
        return _from_run(path, python)
    return _from_folder(path, python, run_dir=None, label=path.name)


def read_run(run_dir: Path) -> dict:
    try:
        run = json.loads((run_dir / "run.json").read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{run_dir / 'run.json'} is not JSON ({exc.msg})") from None
    if not isinstance(run, dict):
        raise UserError(f"{run_dir / 'run.json'} must hold a JSON object")
    return run


def _from_run(run_dir: Path, python: str | None) -> Policy:
    run = read_run(run_dir)
    key = "best" if run.get("best") else "last" if run.get("last") else None
    if key is None:
        why = (f"its {run['rounds_without_step']} round(s) took no optimizer step, so it trained nothing (see "
               f"'no_step' in its metrics.jsonl)" if run.get("rounds_without_step")
               else "the run has not saved one yet")
        raise UserError(f"{run_dir / 'run.json'} names no checkpoint (keys 'best' or 'last'): {why}")
    checkpoint = (run_dir / str(run[key])).resolve()
    if not checkpoint.is_dir():
        raise UserError(f"{run_dir / 'run.json'}: {key} = {run[key]!r}, but {checkpoint} is not a folder")
    return _from_folder(checkpoint, python, run_dir=run_dir, label=f"{run_dir.name}/{run[key]}")


def _from_folder(path: Path, python: str | None, run_dir: Path | None, label: str) -> Policy:
    version = _recorded_version(path) or _round_of(path) or \
        (_round_of(path.parent) if path.name in ("adapter", "model") else 0)
    if (path / MANIFEST).is_file():
        return _from_manifest(path, python, run_dir, label, version)
    if (path / "adapter").is_dir():
        policy = _from_adapter(path / "adapter", python, run_dir, label, version)
        merged = path / "merged"
        return replace(policy, merged=merged.resolve()) if (merged / "config.json").is_file() else policy
    if (path / "adapter_config.json").is_file():
        return _from_adapter(path, python, run_dir, label, version)
    if (path / "model").is_dir():
        return Policy(_model_folder(path / "model"), None, label, version, run_dir)
    if (path / "config.json").is_file():
        return Policy(_model_folder(path), None, label, version, run_dir)
    raise UserError(f"--model {path}: found no run.json, adapter/, model/, adapter_config.json or config.json "
                    f"there; expected {EXPECTED}")


def _from_adapter(adapter: Path, python: str | None, run_dir: Path | None, label: str, version: int) -> Policy:
    if not (adapter / "adapter_config.json").is_file():
        raise UserError(f"{adapter} has no adapter_config.json: not a PEFT adapter")
    try:
        config = json.loads((adapter / "adapter_config.json").read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{adapter / 'adapter_config.json'} is not JSON ({exc.msg})") from None
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise UserError(f"{adapter}: peft_type {config.get('peft_type')!r}; only LoRA adapters can be served")
    run_dir = run_dir or _run_above(adapter)
    base = _base_of_adapter(adapter, config, run_dir, python)
    return Policy(base, adapter, label, version or 1, run_dir)


def _from_manifest(folder: Path, python: str | None, run_dir: Path | None, label: str, version: int) -> Policy:
    """One adapter per agent: adapters.json's patterns and folders (relative to `folder`)."""
    run_dir = run_dir or _run_above(folder)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        routes = check_adapters(manifest["adapters"], f"{folder / MANIFEST}: adapters")
        folders = {name: (folder / str(manifest["folders"][name])).resolve() for name in routes}
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{folder / MANIFEST} is not an adapters manifest ({exc}): it holds {{\"adapters\": "
                        f"{{name: agent pattern}}, \"folders\": {{name: folder}}}}, as train writes it") from None
    if not routes:
        raise UserError(f"{folder / MANIFEST} names no adapter")
    policies = {name: _from_adapter(path, python, run_dir, label, version) for name, path in folders.items()}
    bases = {p.base_model.resolve() for p in policies.values()}
    if len(bases) != 1:
        raise UserError(f"{folder / MANIFEST}: its adapters have different base models ({sorted(map(str, bases))}); "
                        f"one engine serves one base model")
    first = next(iter(policies.values()))
    return Policy(first.base_model, None, label, first.version, first.run_dir, adapters=folders, routes=routes)


def _run_above(adapter: Path) -> Path | None:
    for parent in list(adapter.parents)[:3]:
        if (parent / "run.json").is_file():
            return parent
    return None


def _base_of_adapter(adapter: Path, config: dict, run_dir: Path | None, python: str | None) -> Path:
    if run_dir is not None:
        model = read_run(run_dir).get("model")
        if model in (None, "", *BASE_NAMES):
            return _bundled(python)
        candidate = Path(str(model)).expanduser()
        for path in (candidate, run_dir / candidate):
            if (path / "config.json").is_file():
                return path.resolve()
        if parse_hub_id(str(model)) is not None:
            return resolve_hub_model(str(model), what=f"{run_dir / 'run.json'}: model").path
        raise UserError(f"{run_dir / 'run.json'}: model {model!r} is not a local model folder (no config.json) nor "
                        f"a hub id; the adapter {adapter} needs its base model")
    named = config.get("base_model_name_or_path")
    if named and (Path(str(named)).expanduser() / "config.json").is_file():
        return Path(str(named)).expanduser().resolve()
    if named and parse_hub_id(str(named)) is not None:
        return _hub_base(str(named), config.get("revision"), adapter, python)
    return _bundled(python)


def _hub_base(repo: str, revision: str | None, adapter: Path, python: str | None) -> Path:
    """A lone adapter's base named by hub id: the cached snapshot; else the bundled model when the id is the
    bundled model's own (as adapters trained elsewhere on it name it); else fetched from the hub."""
    from lightning_otel.serve.model import BUNDLED_HUB_ID

    spec = f"{repo}@{revision}" if revision and "@" not in repo else repo
    what = f"{adapter / 'adapter_config.json'}: base_model_name_or_path"
    try:
        return resolve_hub_model(spec, what=what, local_only=True).path
    except UserError:
        if repo == BUNDLED_HUB_ID:
            log.info("%s: %s is not in the hub cache; serving the bundled copy of it", adapter, repo)
            return _bundled(python)
    return resolve_hub_model(spec, what=what).path


def _model_folder(path: Path) -> Path:
    if not (path / "config.json").is_file():
        raise UserError(f"{path} has no config.json: not a Hugging Face model folder")
    return path


def _recorded_version(path: Path) -> int:
    """The policy version the trainer served a checkpoint as (checkpoint/policy.json), when it wrote one."""
    for folder in (path, path.parent):
        try:
            return int(json.loads((folder / "policy.json").read_text())["policy_version"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return 0


def _round_of(path: Path) -> int:
    match = ROUND.search(path.name)
    return int(match.group(1)) if match else 0


def _bundled(python: str | None) -> Path:
    from lightning_otel.serve.model import bundled_model_dir
    return bundled_model_dir(python)
