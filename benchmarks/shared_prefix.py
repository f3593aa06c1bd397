"""PROTOTYPE (not in train/): one forward/backward per GRPO group, the shared prompt computed once.

The n completions of a task's group share their prompt token for token. train/batch.py runs every transition
as its own left-padded sequence, so a group of 4 with a 200-token prompt and 64-token completions pushes
4 x 264 = 1056 positions through the model, 800 of them the same prompt four times. Here the prompt goes through
once with the KV cache on: the cache's keys and values stay in the autograd graph, are expanded (a view, no copy)
to the G completions, and the completions run on top of them. 200 + 4 x 64 = 456 positions: the same
log-probabilities, the same gradients (the prompt's gradient is the sum over the completions that attend to it),
less than half the work and the activations.

    .venv/bin/python benchmarks/shared_prefix.py --data /tmp/grpo-bench/batch-8x4-64-p190-215.json

checks it: log-probs and LoRA gradients of the GRPO loss (beta 0.04, adapters perturbed away from zero) against
train/batch.py's path on a plain peft model. benchmarks/grpo_throughput.py --prototype times it.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from transformers import DynamicCache

from lightning_otel.train.losses import AGGREGATIONS, grpo_loss


def shared_prefix_logprobs(model, prompt_ids: list[int], completions: list[list[int]],
                           pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """log p of each completion token of G completions of ONE prompt: logp [G, T], mask [G, T], left-aligned
    (completions are right-padded: under causal attention, padding after a token changes nothing before it)."""
    G, P, T = len(completions), len(prompt_ids), max(len(c) for c in completions)
    head = model(input_ids=torch.tensor([prompt_ids]), use_cache=True, logits_to_keep=1)
    cache = DynamicCache(ddp_cache_data=[(layer.keys.expand(G, -1, -1, -1), layer.values.expand(G, -1, -1, -1))
                                         for layer in head.cache.layers])
    targets = torch.full((G, T), pad_id, dtype=torch.long)
    mask = torch.zeros((G, T))
    for g, c in enumerate(completions):
        targets[g, :len(c)] = torch.tensor(c)
        mask[g, :len(c)] = 1.0
    attention = torch.cat([torch.ones((G, P), dtype=torch.long), mask.long()], dim=1)
    positions = torch.arange(P, P + T).unsqueeze(0).expand(G, -1)
    # Position t of the completion pass predicts token t + 1; the prompt's last position predicts token 0.
    tail = model(input_ids=targets, attention_mask=attention, position_ids=positions, cache=cache, use_cache=True,
                 logits_to_keep=T)
    first = torch.log_softmax(head.logits[:, -1].float(), dim=-1).expand(G, -1).gather(-1, targets[:, :1])
    rest = torch.log_softmax(tail.logits[:, :-1].float(), dim=-1).gather(-1, targets[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.cat([first, rest], dim=1), mask


def group_loss(model, reference, members: list[dict], pad_id: int, scale: torch.Tensor, clip: float,
               kl: float):
    """GRPO loss of one group (rows sharing prompt_ids); `reference` is a context manager for the reference
    policy (adapters disabled) or None when kl == 0."""
    prompt, completions = list(members[0]["prompt_ids"]), [list(r["completion_ids"]) for r in members]
    logp, mask = shared_prefix_logprobs(model, prompt, completions, pad_id)
    old = torch.full_like(mask, math.nan)
    for g, r in enumerate(members):
        if r.get("completion_logprobs") is not None:
            old[g, :len(r["completion_logprobs"])] = torch.tensor(r["completion_logprobs"])
    old = torch.where(torch.isnan(old), logp.detach(), old)
    ref = None
    if kl:
        with torch.no_grad(), reference():
            ref, _ = shared_prefix_logprobs(model, prompt, completions, pad_id)
    advantages = torch.tensor([float(r["advantage"]) for r in members])
    return grpo_loss(logp, old, advantages, mask * scale[:, None], clip=clip, kl_coef=kl, ref_logp=ref)


def prefix_shared_step(learner, rows: list[dict], config) -> tuple[int, float]:
    """optimize()'s step (train/optimize.py) with one micro-batch per group of rows that share a prompt.
    Returns (trained tokens, loss)."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(tuple(row["prompt_ids"]), []).append(row)
    ordered = [r for members in groups.values() for r in members]
    index: dict[str, int] = {}
    rollout = torch.tensor([index.setdefault(r["rollout_id"], len(index)) for r in ordered])
    counts = torch.tensor([float(len(r["completion_ids"])) for r in ordered])
    scale = AGGREGATIONS[config.aggregation](counts, rollout)
    total, first = 0.0, 0
    for i, members in enumerate(groups.values()):
        out = group_loss(learner.engine, learner.module.disable_adapter, members, learner.pad_id,
                         scale[first:first + len(members)], config.clip, config.kl)
        learner.backward(out.loss, last_of_step=i == len(groups) - 1)
        total += float(out.loss.detach())
        first += len(members)
    return int(counts.sum()), total


def check_logprobs(learner, rows: list[dict]) -> float:
    """Largest |difference| between this file's log-probs and train/batch.py's on the first group."""
    from lightning_otel.train.batch import collate

    members = [r for r in rows if r["prompt_ids"] == rows[0]["prompt_ids"]]
    with torch.no_grad():
        batch = collate(members, learner.pad_id)
        reference = learner.logprobs(batch)
        mine, _ = shared_prefix_logprobs(learner.engine, list(members[0]["prompt_ids"]),
                                         [list(r["completion_ids"]) for r in members], learner.pad_id)
    T = batch.completion_width
    return max(float((reference[g, T - len(r["completion_ids"]):] - mine[g, :len(r["completion_ids"])]).abs().max())
               for g, r in enumerate(members))


def check_gradients(data_path: Path, beta: float = 0.04) -> dict:
    """The GRPO loss and its LoRA gradients both ways, on a plain peft model with perturbed adapters."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lightning_otel.train.batch import collate, completion_logprobs
    from lightning_otel.train.losses import token_weights

    data = json.loads(data_path.read_text())
    prompt = data["prompts"][0]
    rewards = [c["reward"] for c in prompt["completions"]]
    mean, std = sum(rewards) / len(rewards), torch.tensor(rewards).std().item()
    rows = [{"prompt_ids": prompt["prompt_ids"], "completion_ids": c["completion_ids"],
             "completion_logprobs": c["logprobs"], "advantage": (c["reward"] - mean) / (std + 1e-4),
             "rollout_id": str(k)} for k, c in enumerate(prompt["completions"])]
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(data["model_dir"], dtype=torch.float32),
                           LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0,
                                      task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)  # B starts at zero: perturb it so the adapters change the outputs
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]

    def gradient(loss: torch.Tensor) -> torch.Tensor:
        for p in params:
            p.grad = None
        loss.backward()
        return torch.cat([p.grad.flatten() for p in params])

    pad = 0
    batch = collate(rows, pad)
    scale = AGGREGATIONS["sequence"](batch.mask.sum(1), batch.rollout)
    with torch.no_grad(), model.disable_adapter():
        ref = completion_logprobs(model, batch)
    theirs = grpo_loss(completion_logprobs(model, batch), batch.old_logp, batch.advantages,
                       token_weights(batch.mask, scale), kl_coef=beta, ref_logp=ref)
    g_theirs = gradient(theirs.loss)
    mine = group_loss(model, model.disable_adapter, rows, pad, scale, 0.2, beta)
    g_mine = gradient(mine.loss)
    return {"loss_batch_py": theirs.loss.item(), "loss_shared_prefix": mine.loss.item(),
            "grad_norm": g_theirs.norm().item(), "grad_max_abs_diff": (g_theirs - g_mine).abs().max().item(),
            "grad_rel_diff": ((g_theirs - g_mine).norm() / g_theirs.norm()).item()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="a batch JSON of benchmarks/grpo_throughput.py")
    print(json.dumps(check_gradients(parser.parse_args().data)))
