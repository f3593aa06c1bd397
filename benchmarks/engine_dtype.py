"""The engine's precision on this machine: vLLM serving the bundled model in bf16 against fp32, side by side.

    .venv/bin/python benchmarks/engine_dtype.py [--rounds 2]

EngineConfig's dtype "auto" picks bf16 only where it is native (engine.native_bf16: a GPU, or a CPU with
AVX512-BF16, AMX or Arm BF16 instructions). This measures what that choice is worth here: a matrix product of
the model's shape in PyTorch, then the engine in each precision on the same requests (a 600-token prompt
answered with 1 token: what the SFT walk sends; 64 tokens alone; 8 x 64 tokens at once: what rollouts and
evaluations send), each engine started fresh, the two alternated --rounds times. Prints the times and the
bf16 / fp32 ratios.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from lightning_otel.serve.engine import EngineConfig, VLLMEngine, auto_dtype, default_engine_python, native_bf16
from lightning_otel.serve.model import bundled_model_dir

PROMPT = "singer(Singer_ID, Name, Country, Song_Name, Age) " * 40  # ~600 tokens, a schema-like prompt


def matmul_ms(dtype: torch.dtype, repeats: int = 5) -> float:
    """One 600 x 576 x 1536 product (prompt tokens x hidden x MLP width of the bundled model), one thread."""
    a, b = torch.randn(600, 576, dtype=dtype), torch.randn(576, 1536, dtype=dtype)
    a @ b
    began = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return (time.perf_counter() - began) / repeats * 1000


def request(prompt: str, tokens: int) -> dict:
    return {"model": "policy", "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
            "temperature": 0.0, "ignore_eos": True}


def measure(dtype: str, model_dir: Path, python: str, logs: Path) -> dict[str, float]:
    engine = VLLMEngine(EngineConfig(model_dir=model_dir, python=python, dtype=dtype,
                                     log_path=logs / f"engine-{dtype}.log"))
    engine.start()
    try:
        engine.generate("/v1/chat/completions", request("Write one SQL query.", 8))  # warm-up
        times = {}
        began = time.perf_counter()
        for _ in range(3):
            engine.generate("/v1/chat/completions", request(PROMPT, 1))
        times["600-token prompt, 1 token"] = (time.perf_counter() - began) / 3
        began = time.perf_counter()
        for i in range(3):
            engine.generate("/v1/chat/completions", request(f"Write SQL query number {i}.", 64))
        times["64 tokens, one stream"] = (time.perf_counter() - began) / 3
        began = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: engine.generate("/v1/chat/completions",
                                                    request(f"Write SQL query number {i}.", 64)), range(8)))
        times["8 x 64 tokens at once"] = time.perf_counter() - began
        return times
    finally:
        engine.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print(f"native bf16 here: {native_bf16()}; the engine's auto dtype: {auto_dtype()}", flush=True)
    torch.set_num_threads(1)
    fp32, bf16 = matmul_ms(torch.float32), matmul_ms(torch.bfloat16)
    print(f"matmul 600x576x1536, 1 thread: fp32 {fp32:.1f} ms, bf16 {bf16:.1f} ms, bf16/fp32 {bf16 / fp32:.1f}x",
          flush=True)
    python = default_engine_python()
    model_dir = bundled_model_dir(python)
    results: dict[str, list[dict[str, float]]] = {"float32": [], "bfloat16": []}
    with tempfile.TemporaryDirectory() as logs:
        for _ in range(args.rounds):
            for dtype in results:
                results[dtype].append(measure(dtype, model_dir, python, Path(logs)))
                print(dtype, {k: round(v, 2) for k, v in results[dtype][-1].items()}, flush=True)
    for name in results["float32"][0]:
        f32 = statistics.median(r[name] for r in results["float32"])
        b16 = statistics.median(r[name] for r in results["bfloat16"])
        print(f"{name}: fp32 {f32:.2f} s, bf16 {b16:.2f} s, bf16/fp32 {b16 / f32:.2f}x")


if __name__ == "__main__":
    main()
