"""Full weights into a running engine: vLLM's in-place reload (EngineConfig.reload_in_place) against the
restart it replaces, side by side on one engine, and whether the reloaded engine computes what a fresh one does.

    .venv/bin/python benchmarks/engine_reload.py [--rounds 3]

A copy of the bundled model with noise on its MLP weights stands for a trained checkpoint. Each round moves
the engine to it and back, once by reload and once by restart, timing each move until the engine answers.
Then greedy logprobs of one prompt: the reloaded engine against an engine started on the
copy (they must match), and against the base weights (they must differ).
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lightning_otel.serve.engine import EngineConfig, VLLMEngine, default_engine_python
from lightning_otel.serve.model import bundled_model_dir

BODY = {"messages": [{"role": "user", "content": "Name three SQL keywords."}], "max_tokens": 16, "temperature": 0}


def perturbed(base: Path, out: Path) -> Path:
    shutil.copytree(base, out)
    weights = load_file(str(base / "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    save_file({k: v + 0.02 * torch.randn(v.shape, generator=generator).to(v.dtype) if ".mlp." in k else v
               for k, v in weights.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def answer(engine: VLLMEngine) -> tuple[list[int], list[float]]:
    choice = engine.generate("/v1/chat/completions", dict(BODY))["choices"][0]
    return choice["token_ids"], [x["logprob"] for x in choice["logprobs"]["content"]]


def timed_move(engine: VLLMEngine, folder: Path, restart: bool) -> float:
    """Seconds until the engine answers on `folder`'s weights: loaded in place, or by the restart load_model()
    made before in-place loading (the same engine, so its dev-mode routes stay on for the next reload)."""
    began = time.perf_counter()
    if restart:
        engine.stop()
        engine.config.model_dir = folder
        engine.start()
    else:
        reloads = engine.reloads
        engine.load_model(folder, 1)
        assert engine.reloads == reloads + 1, "the in-place load fell back to a restart (see the log)"
    answer(engine)
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    python = default_engine_python()
    base = bundled_model_dir(python)
    with tempfile.TemporaryDirectory() as tmp:
        copy = perturbed(base, Path(tmp) / "perturbed")
        engine = VLLMEngine(EngineConfig(model_dir=base, python=python, kv_cache_gib=1))
        began = time.perf_counter()
        engine.start()
        start_s = time.perf_counter() - began
        try:
            on_base = answer(engine)
            seconds: dict[str, list[float]] = {"reload": [], "restart": []}
            for _ in range(args.rounds):
                for mode in ("reload", "restart"):
                    seconds[mode].append(timed_move(engine, copy, mode == "restart"))
                    seconds[mode].append(timed_move(engine, base, mode == "restart"))
            engine.load_model(copy, 1)
            reloaded = answer(engine)
        finally:
            engine.stop()
        fresh_engine = VLLMEngine(EngineConfig(model_dir=copy, python=python, kv_cache_gib=1))
        fresh_engine.start()
        try:
            fresh = answer(fresh_engine)
        finally:
            fresh_engine.stop()
    medians = {mode: statistics.median(values) for mode, values in seconds.items()}
    result = {
        "engine_start_s": round(start_s, 1), "moves_each": 2 * args.rounds,
        "median_s": {k: round(v, 2) for k, v in medians.items()},
        "restart_over_reload": round(medians["restart"] / medians["reload"], 1),
        "reloaded_equals_fresh": reloaded == fresh,
        "max_abs_logprob_diff_vs_fresh": max(abs(a - b) for a, b in zip(reloaded[1], fresh[1])),
        "differs_from_base": reloaded != on_base,
    }
    print(json.dumps(result, indent=2))
    sys.exit(0 if result["reloaded_equals_fresh"] and result["differs_from_base"] else 1)


if __name__ == "__main__":
    main()
