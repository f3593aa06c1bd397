"""A trained policy as folders other tools load: the LoRA adapter as PEFT saves it, or one full Hugging Face
model folder with the adapter merged into the base weights (tokenizer included) that any inference server
loads. The trainer serves merged copies of its checkpoints the same way. Each export carries a model card
(README.md, train/model_card.py).

    lightning-otel export-policy runs/sql --out sql-policy [--merge] [--eval-report DIR]

A run with one adapter per agent exports one folder per adapter and adapters.json (their agent patterns).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from lightning_otel.errors import UserError
from lightning_otel.serve.adapters import MANIFEST
from lightning_otel.serve.policy import resolve_policy
from lightning_otel.train.model_card import base_model_of, name_hub_base, write_model_card


def export_policy(spec: str, out: Path, merge: bool = False, python: str | None = None,
                  eval_reports: list[Path] = ()) -> Path:
    """Write the policy `spec` names into the new folder `out`, with a model card (README.md); an adapter's
    config names its base by hub id when the base came from the hub. `eval_reports`: eval --report folders to
    summarise in the card, besides those inside the run folder."""
    policy = resolve_policy(spec, python)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out {out} exists and is not empty: give a new folder")
    missing = [str(r) for r in eval_reports if not (Path(r) / "summary.json").is_file()]
    if missing:
        raise UserError(f"--eval-report {', '.join(missing)}: no summary.json there; give the --report folder of "
                        f"`lightning-otel eval`")
    if policy.adapters:
        if merge:
            raise UserError(f"{spec} holds one adapter per agent ({', '.join(policy.adapters)}): they cannot merge "
                            f"into one model; export them without --merge (one folder per adapter)")
        export_adapters(policy, out)
        kind = "set of LoRA adapters"
    elif policy.adapter is None:
        shutil.copytree(policy.base_model, out, dirs_exist_ok=True)
        kind = "model folder"
    elif not merge:
        shutil.copytree(policy.adapter, out, dirs_exist_ok=True)
        name_hub_base(out, base_model_of(policy))
        kind = "LoRA adapter"
    else:
        merge_adapter(policy.base_model, policy.adapter, out)
        kind = "merged model folder"
    write_model_card(policy, out, kind, [Path(r) for r in eval_reports])
    return out


def export_adapters(policy, out: Path) -> Path:
    """One adapter per agent: each adapter into `out/<name>`, and `out/adapters.json` (patterns and folders), which
    `serve`, `eval` and `--model` read back."""
    base = base_model_of(policy)
    for name, folder in policy.adapters.items():
        shutil.copytree(folder, out / name, dirs_exist_ok=True)
        name_hub_base(out / name, base)
    (out / MANIFEST).write_text(json.dumps({"adapters": policy.routes, "folders": {n: n for n in policy.adapters}},
                                           indent=1) + "\n")
    return out


def merge_adapter(base_model: Path, adapter: Path, out: Path) -> Path:
    """A full model folder: the base model with the LoRA adapter merged into its weights, and its tokenizer."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(base_model)
    merged = PeftModel.from_pretrained(base, adapter).merge_and_unload()
    merged.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(base_model).save_pretrained(out)
    return out
