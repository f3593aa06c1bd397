"""The GRPO knobs the learning benchmarks (learning_check.py, math_agent.py) share: their command-line flags,
each script with its own defaults, and the TrainConfig fields they set."""
from __future__ import annotations

import argparse

KNOBS = ("lr", "lora_rank", "epochs", "batch_size", "micro_batch", "max_tokens", "temperature", "concurrency",
         "seed", "autocast")


def add_knobs(p: argparse.ArgumentParser, *, lr: float, epochs: int, batch_size: int, max_tokens: int,
              temperature: float, concurrency: int, micro_batch: int = 4, lora_rank: int = 16) -> None:
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--lora-rank", type=int, default=lora_rank)
    p.add_argument("--epochs", type=int, default=epochs, help="passes over a round's transitions")
    p.add_argument("--batch-size", type=int, default=batch_size, help="transitions per optimizer step")
    p.add_argument("--micro-batch", type=int, default=micro_batch)
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=temperature)
    p.add_argument("--concurrency", type=int, default=concurrency)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--autocast", action="store_true", help="bf16 forward passes (CPUs with bf16 instructions)")


def knob_settings(args: argparse.Namespace) -> dict:
    """The TrainConfig fields of the shared knobs, from parsed arguments."""
    return {k: getattr(args, k) for k in KNOBS}
