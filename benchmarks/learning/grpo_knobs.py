"""The GRPO knobs the learning runs learning_check and math_agent share: their command-line flags,
each script with its own defaults, and the TrainConfig fields they set."""
from __future__ import annotations

import argparse

from lightning_otel.train.losses import TOKEN_RETURNS
from lightning_otel.train.transitions.credit import ADVANTAGE_ALIASES, ADVANTAGES

KNOBS = ("lr", "lora_rank", "epochs", "batch_size", "micro_batch", "max_tokens", "temperature", "concurrency",
         "seed", "autocast", "advantage", "kl")


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
    p.add_argument("--advantage", default="per-rollout", choices=sorted([*ADVANTAGES, *ADVANTAGE_ALIASES]),
                   help="train/transitions/credit.py; reinforce-pp: REINFORCE++ (global baseline, KL in the rewards)")
    p.add_argument("--kl", type=float, default=0.0,
                   help="the KL coefficient: kl_loss (k3 term to the reference), or kl_reward with reinforce-pp")


def knob_settings(args: argparse.Namespace) -> dict:
    """The TrainConfig fields of the shared knobs, from parsed arguments."""
    settings = {k: getattr(args, k) for k in KNOBS if k != "kl"}
    settings["kl_reward" if args.advantage in TOKEN_RETURNS else "kl_loss"] = args.kl
    return settings
