"""TRL's GRPOTrainer timed on fixed completions: the peer side of benchmarks/grpo_throughput.py.

    /work/venvs/trl/bin/python benchmarks/peers/trl_grpo.py --data batch.json --beta 0.0 --steps 7

Runs in TRL's own venv and does not import lightning_otel. The token ids come from the JSON file the driver
writes (prompts, and per prompt `group` completions with their rewards). Driven like our side: after set-up it
prints a `@@grpo-bench {"ready": ...}` line, then before each optimizer step waits for a `step` line on stdin
and after it prints the step's timing; at the end, its peak RSS (ru_maxrss of this process).

How sampling is kept out of the clock: TRL always generates inside its optimizer step (`_prepare_inputs` ->
`_generate_and_score_completions` -> `_generate`). Its documented `rollout_func` hook replaces the generator: here
it hands back the precomputed prompt ids, completion ids and logprobs for the prompts TRL's sampler drew (each
prompt arrives `num_generations` times; the k-th copy gets the k-th completion), and the reward function returns
each completion's fixed reward. A step is timed from the `on_step_begin` callback (before the first micro-batch)
to `on_step_end` (after the optimizer step), minus the time spent in `_generate` (the rollout_func, decoding the
completions and TRL's length metrics). What stays in the clock is everything TRL does to a sampled batch:
padding, rewards and group advantages, reference log-probs (beta > 0: adapters disabled, in no_grad), forward
with its fused LM head, loss, backward, gradient clipping and AdamW.

"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import psutil  # noqa: E402
import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402

import trl  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

MARK = "@@grpo-bench "


def report(message: dict) -> None:
    print(MARK + json.dumps(message), flush=True)


class TimedGRPOTrainer(GRPOTrainer):
    """GRPOTrainer that accumulates the seconds spent generating (here: looking completions up)."""

    generate_seconds = 0.0
    generate_cpu_seconds = 0.0

    def _generate(self, prompts):
        started, cpu = time.perf_counter(), time.process_time()
        try:
            return super()._generate(prompts)
        finally:
            self.generate_seconds += time.perf_counter() - started
            self.generate_cpu_seconds += time.process_time() - cpu


class StepClock(TrainerCallback):
    """Waits for the driver's turn before each optimizer step, reports the step's time after it."""

    def __init__(self, trainer_ref: list, tokens_per_step: int):
        self.trainer_ref, self.tokens = trainer_ref, tokens_per_step
        self.process = psutil.Process()

    def on_step_begin(self, args, state, control, **kwargs):
        if sys.stdin.readline().strip() != "step":
            raise SystemExit("driver went away")
        self.started, self.cpu_started = time.perf_counter(), time.process_time()
        self.generate_before = self.trainer_ref[0].generate_seconds
        self.generate_cpu_before = self.trainer_ref[0].generate_cpu_seconds

    def on_step_end(self, args, state, control, **kwargs):
        wall, cpu = time.perf_counter() - self.started, time.process_time() - self.cpu_started
        generate = self.trainer_ref[0].generate_seconds - self.generate_before
        generate_cpu = self.trainer_ref[0].generate_cpu_seconds - self.generate_cpu_before
        report({"seconds": wall - generate, "cpu_seconds": cpu - generate_cpu, "tokens": self.tokens,
                "generate_seconds": generate, "rss_mb": self.process.memory_info().rss / 2**20})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="JSON written by benchmarks/grpo_throughput.py")
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--steps", type=int, default=7, help="optimizer steps (the driver times them)")
    parser.add_argument("--micro-batch", type=int, default=4, help="per_device_train_batch_size")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--full-finetune", action="store_true", help="no LoRA: train every weight")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (GRPOConfig bf16=True), no checkpointing")
    parser.add_argument("--trl-defaults", action="store_true",
                        help="keep GRPOConfig's own bf16 and gradient_checkpointing defaults (both on)")
    parser.add_argument("--compact-lm-head", action="store_true",
                        help="PATCHED TRL: score only the completion positions in the fused LM head, as TRL does on "
                             "CUDA/XPU (on CPU it projects every position, prompt included, through the LM head)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    if args.compact_lm_head:
        from trl.trainer import utils as trl_utils

        # `_fused_forward` asks this (imported by name into trl.trainer.utils) only whether to compact the rows;
        # the kernel choice in trl.kernels.chunked_logprob keeps its own copy, so the torch tiles still run.
        trl_utils._use_triton = lambda device: True
    data = json.loads(open(args.data).read())
    group = data["group"]
    by_prompt = {p["text"]: p for p in data["prompts"]}
    samples = group * len(data["prompts"])
    if samples % args.micro_batch:
        raise SystemExit(f"{samples} samples do not split into micro-batches of {args.micro_batch}")

    def rollout_func(prompts: list, trainer) -> dict:
        seen: dict[str, int] = {}
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "fixed_reward": []}
        for text in prompts:
            k = seen.get(text, 0)
            seen[text] = k + 1
            prompt, completion = by_prompt[text], by_prompt[text]["completions"][k % group]
            out["prompt_ids"].append(prompt["prompt_ids"])
            out["completion_ids"].append(completion["completion_ids"])
            out["logprobs"].append(completion["logprobs"])
            out["fixed_reward"].append(completion["reward"])
        return out

    def fixed_reward(completions, fixed_reward, **kwargs) -> list[float]:
        return list(fixed_reward)

    tokenizer = AutoTokenizer.from_pretrained(data["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(data["model_dir"], dtype=torch.float32)
    extra = {} if args.trl_defaults else {"bf16": args.bf16, "activation_checkpointing": False}
    config = GRPOConfig(
        output_dir=os.path.join(os.path.dirname(os.path.abspath(args.data)), "trl-out"),
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=samples // args.micro_batch,
        num_generations=group,
        max_completion_length=max(len(c["completion_ids"]) for p in data["prompts"] for c in p["completions"]),
        max_steps=args.steps,
        loss_type="grpo",
        beta=args.beta,
        use_bias_correction_kl=False,  # plain k3, as in lightning_otel's loss
        temperature=1.0,
        epsilon=0.2,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1_000_000,
        disable_dropout=True,
        seed=args.seed,
        **extra,
    )
    peft_config = None if args.full_finetune else LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    dataset = Dataset.from_list([{"prompt": p["text"]} for p in data["prompts"]])
    holder: list = []
    tokens_per_step = sum(len(c["completion_ids"]) for p in data["prompts"] for c in p["completions"])
    clock = StepClock(holder, tokens_per_step)
    trainer = TimedGRPOTrainer(model=model, reward_funcs=fixed_reward, args=config, train_dataset=dataset,
                               processing_class=tokenizer, peft_config=peft_config, rollout_func=rollout_func,
                               callbacks=[clock])
    holder.append(trainer)
    report({"ready": True, "ready_rss_mb": psutil.Process().memory_info().rss / 2**20, "version": trl.__version__,
            "trainable": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
            "threads": torch.get_num_threads(), "bf16": config.bf16,
            "activation_checkpointing": config.activation_checkpointing, "compact_lm_head": args.compact_lm_head})
    trainer.train()
    report({"done": True, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})


if __name__ == "__main__":
    main()
