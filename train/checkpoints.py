"""A trained policy as folders other tools load: the LoRA adapter as PEFT saves it, or one full Hugging Face
model folder with the adapter merged into the base weights (tokenizer included) that any inference server
loads. The trainer serves merged copies of its checkpoints the same way.

    lightning-otel export-policy runs/sql --out sql-policy [--merge]
"""
from __future__ import annotations

import shutil
from pathlib import Path

from lightning_otel.errors import UserError
from lightning_otel.serve.policy import resolve_policy


def export_policy(spec: str, out: Path, merge: bool = False, python: str | None = None) -> Path:
    policy = resolve_policy(spec, python)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out {out} exists and is not empty: give a new folder")
    if policy.adapter is None:
        shutil.copytree(policy.base_model, out, dirs_exist_ok=True)
        return out
    if not merge:
        shutil.copytree(policy.adapter, out, dirs_exist_ok=True)
        return out
    return merge_adapter(policy.base_model, policy.adapter, out)


def merge_adapter(base_model: Path, adapter: Path, out: Path) -> Path:
    """A full model folder: the base model with the LoRA adapter merged into its weights, and its tokenizer."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(base_model)
    merged = PeftModel.from_pretrained(base, adapter).merge_and_unload()
    merged.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(base_model).save_pretrained(out)
    return out
