"""The policy being trained: a Hugging Face causal LM (LoRA adapters by default, or fully fine-tuned) inside a
DeepSpeed engine; its reference policy (adapters disabled); saving what the rollout engine loads.

DeepSpeed outside its launcher needs the torch.distributed variables (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT; else it tries MPI): `distributed_env()` sets them for a one-process run unless a
launcher did. On CPU it uses gloo, and starts without the shared-memory collective it would compile first
(distributed.without_shm_collective: training never calls it, and a build killed halfway hangs later runs).
Should a DeepSpeed build it anyway with LOCAL_SIZE set (the deepspeed launcher sets it), the op leaves an
allreduce buffer in /dev/shm behind: `close()` removes it.
Under a launcher with several ranks, rank 0's learner calls that change or save the policy are made by every
rank (train/distributed.py).
"""
from __future__ import annotations

import contextlib
import gc
import glob
import json
import logging
import os
import socket
from pathlib import Path

import torch

from lightning_otel.serve.adapters import MANIFEST
from lightning_otel.serve.engine import native_bf16
from lightning_otel.train import distributed
from lightning_otel.train.batch import (Batch, Scores, completion_logprobs, completion_scores,
                                        completion_scores_and_states)
from lightning_otel.train.config import TrainConfig
from lightning_otel.train.critic import build_critic
from lightning_otel.train.distributed import collective
from lightning_otel.train.losses import CRITIC_ADVANTAGES

log = logging.getLogger(__name__)
LORA_TARGETS = "all-linear"
OWNER_ENV = "LIGHTNING_OTEL_DIST_OWNER"  # marks the torch.distributed variables as set by us, not a launcher


def distributed_env() -> None:
    """One-process torch.distributed settings, unless a launcher (deepspeed, torchrun) set them."""
    if torch.distributed.is_initialized():
        return  # an earlier learner of this process: its process group is reused
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and OWNER_ENV not in os.environ:
        return  # a launcher's settings
    # Not set, or set by a lightning-otel parent process (inherited): a fresh port of our own, else this
    # process would meet the parent's rendezvous store on the same port.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), OWNER_ENV: str(os.getpid())})


def deepspeed_config(config: TrainConfig) -> dict:
    zero: dict = {"stage": config.zero_stage}
    if config.offload and config.zero_stage > 0:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": config.micro_batch,
        # Accumulation boundaries are set by the trainer (a step's micro-batch count varies with the data).
        "gradient_accumulation_steps": 1,
        "gradient_clipping": config.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": config.bf16},
        # torch's AdamW as the client optimizer: DeepSpeed's fused CPU Adam would compile for ~45 s first.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1 << 30,
    }


def slow_bf16_warning(config: TrainConfig, native: bool) -> str | None:
    """What to tell a user who set bf16 or autocast on a machine without native bf16 (`native`), else None."""
    setting = "bf16" if config.bf16 else "autocast" if config.autocast else None
    if setting is None or native:
        return None
    return (f"{setting} is set, but this machine has no native bf16 (no GPU; no AVX512-BF16, AMX or Arm BF16 "
            "instructions): bf16 matrix products run in a slow fallback here, many times slower than fp32 (44x "
            f"measured on an AVX2 CPU). Set {setting} = false on this machine.")


def adapter_param_groups(model: torch.nn.Module, adapters: list[str]) -> list[dict]:
    """The optimizer's parameter groups: one per named adapter (its LoRA matrices, made trainable), in order,
    then the rest that trains (full fine-tuning; PEFT's modules_to_save); without adapters one group."""
    if not adapters:
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]
    groups: list[dict] = [{"params": []} for _ in adapters]
    rest = []
    for name, p in model.named_parameters():
        parts = name.split(".")
        owner = next((parts[i + 1] for i, part in enumerate(parts[:-1]) if part.startswith("lora_")), None)
        if owner in adapters:
            p.requires_grad_(True)
            groups[adapters.index(owner)]["params"].append(p)
        elif p.requires_grad:
            rest.append(p)
    return groups + ([{"params": rest}] if rest else [])


def _module_params(learner: "Learner", group: dict) -> list[torch.nn.Parameter]:
    """The module's parameters of adapter group `group` (ZeRO's groups hold flat copies: found by name)."""
    index = next(i for i, g in enumerate(learner.optimizer.param_groups) if g is group)
    name = learner.adapters[index]
    return [p for n, p in learner.module.named_parameters() if f".{name}." in n and ".lora_" in n]


def write_manifest(folder: Path, adapters: dict[str, str]) -> Path:
    """`folder/adapters.json`: the adapters (name -> agent pattern, in routing order) and their folders."""
    path = folder / MANIFEST
    path.write_text(json.dumps({"adapters": adapters, "folders": {name: f"adapters/{name}" for name in adapters}},
                               indent=1) + "\n")
    return path


class Learner:
    """The trainable policy. `logprobs(batch)` is differentiable; `reference_logprobs(batch)` is not. With an
    advantage that needs a value model (losses.CRITIC_ADVANTAGES: PPO) it also holds the critic
    (train/critic.py), trained and saved beside the policy; `critic` is None otherwise."""

    def __init__(self, model_dir: Path, config: TrainConfig):
        import deepspeed
        from transformers import AutoModelForCausalLM, AutoTokenizer

        distributed.init()
        distributed.announce("learner", {"model_dir": Path(model_dir), "config": config})
        self.rank, self.world = distributed.rank(), distributed.world()
        self.config, self.model_dir = config, Path(model_dir)
        self.adapters = list(config.adapters)  # one LoRA adapter per agent group (empty: one for all)
        self._frozen: dict[int, dict] = {}  # while one adapter trains: the other groups' index -> saved lr, state
        if warning := slow_bf16_warning(config, native_bf16(gpu=torch.cuda.is_available())):
            log.warning(warning)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else \
            self.tokenizer.eos_token_id
        dtype = torch.bfloat16 if config.bf16 else torch.float32
        # Seeded before the adapters exist: LoRA's A matrices are drawn at random, and a run with the same seed
        # (or another rank of it) must start from the same ones.
        torch.manual_seed(config.seed)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        model.config.use_cache = False
        self.reference = None
        if config.full_finetune:
            if config.kl_loss or config.kl_reward:
                self.reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
                self.reference.requires_grad_(False)
        else:
            from peft import LoraConfig, get_peft_model

            lora = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, target_modules=LORA_TARGETS,
                              lora_dropout=0.0, task_type="CAUSAL_LM")
            model = get_peft_model(model, lora, **({"adapter_name": self.adapters[0]} if self.adapters else {}))
            for name in self.adapters[1:]:  # one adapter per agent group, each drawn after the one before
                model.add_adapter(name, lora)
        groups = adapter_param_groups(model, self.adapters)
        self.trainable = sum(p.numel() for group in groups for p in group["params"])
        optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.999), weight_decay=0.0)
        distributed_env()
        with distributed.without_shm_collective():
            self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                                                     config=deepspeed_config(config))
        self.critic = None
        if config.advantage in CRITIC_ADVANTAGES:
            self.critic = build_critic(config, self.model_dir, self.module, self.tokenizer, self.world)
        log.info("policy: %s, %s, %.1fM trainable parameters, ZeRO %d, %d rank(s)", model_dir,
                 "full fine-tune" if config.full_finetune else f"LoRA r{config.lora_rank}",
                 self.trainable / 1e6, config.zero_stage, self.world)

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @collective
    def set_lr(self, lr: float) -> None:
        for i, group in enumerate(self.optimizer.param_groups):
            if i in self._frozen:
                self._frozen[i]["lr"] = lr
            else:
                group["lr"] = lr

    def learning_rate(self) -> float:
        live = [g for i, g in enumerate(self.optimizer.param_groups) if i not in self._frozen]
        return float(live[0]["lr"])

    @contextlib.contextmanager
    def training_adapter(self, name: str):
        """One adapter per agent: forward passes and optimizer steps inside move adapter `name` only. The
        others are not in the forward pass (no gradient), their parameter groups step at lr 0, and their Adam
        moments and step counts are put back as they were after: each adapter keeps its own optimizer state
        (the learner holds one optimizer, and one DeepSpeed engine, for all of them)."""
        self.use_adapter(name)
        try:
            yield
        finally:
            self.end_adapter()

    @collective
    def use_adapter(self, name: str) -> None:
        """Start training adapter `name` alone (training_adapter(); every rank makes it)."""
        if name not in self.adapters:
            raise ValueError(f"no adapter {name!r} (this learner has {self.adapters})")
        self.module.set_adapter(name)
        for group in self.optimizer.param_groups[:len(self.adapters)]:  # set_adapter freezes the others
            for p in _module_params(self, group):
                p.requires_grad_(True)
        state = self.base_optimizer().state
        for i, group in enumerate(self.optimizer.param_groups[:len(self.adapters)]):
            if self.adapters[i] != name:
                self._frozen[i] = {"lr": group["lr"], "state": {id(p): {k: v.clone() if torch.is_tensor(v) else v
                                                                        for k, v in state[p].items()}
                                                                 for p in group["params"] if p in state}}
                group["lr"] = 0.0

    @collective
    def end_adapter(self) -> None:
        """The other adapters' learning rates and optimizer state back as use_adapter() found them."""
        state = self.base_optimizer().state
        for i, saved in self._frozen.items():
            group = self.optimizer.param_groups[i]
            group["lr"] = saved["lr"]
            for p in group["params"]:
                if id(p) not in saved["state"]:
                    state.pop(p, None)  # it had no state before this adapter's steps
                    continue
                for key, value in saved["state"][id(p)].items():
                    if torch.is_tensor(value):
                        state[p][key].copy_(value)
                    else:
                        state[p][key] = value
        self._frozen = {}

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps this run has taken (kept across resumes: it is saved with the state)."""
        return int(self.engine.global_steps)

    def train_mode(self, on: bool) -> None:
        self.engine.train(on)

    def logprobs(self, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
        return completion_logprobs(self.engine, batch, temperature, self.config.autocast)

    def scores(self, batch: Batch, temperature: float = 1.0) -> Scores:
        """logprobs(), and the policy's entropy at each completion position from the same forward pass."""
        return completion_scores(self.engine, batch, temperature, self.config.autocast)

    def scores_and_values(self, batch: Batch, temperature: float = 1.0) -> tuple[Scores, torch.Tensor]:
        """scores(batch), and the critic's values V [B] of each sample's state (its last prompt token): the
        head critic reads the policy's hidden states of this same forward pass."""
        scores, hidden = completion_scores_and_states(self.engine, batch, temperature, self.config.autocast)
        return scores, self.critic.values(batch, lambda: hidden)

    @torch.no_grad()
    def values(self, batch: Batch) -> torch.Tensor:
        """The critic's values [B], without gradients (a policy forward pass only when the critic reads it)."""
        return self.critic.values(batch, lambda: completion_scores_and_states(
            self.engine, batch, 1.0, self.config.autocast, entropy=False)[1])

    @torch.no_grad()
    def reference_logprobs(self, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
        if self.reference is not None:
            return completion_logprobs(self.reference, batch, temperature, self.config.autocast)
        with self.module.disable_adapter():
            return completion_logprobs(self.engine, batch, temperature, self.config.autocast)

    def backward(self, loss: torch.Tensor, last_of_step: bool, critic_loss: torch.Tensor | None = None) -> None:
        """Accumulate gradients; the optimizer steps after the last micro-batch of a step. With several ranks each
        holds part of the step's loss and DeepSpeed averages their gradients: scaled by the world size, the
        average is the gradient of the whole step's loss. `critic_loss` (PPO's value loss) goes to the critic's
        own parameters and optimizer, on the same step boundaries."""
        self.engine.set_gradient_accumulation_boundary(last_of_step)
        self.engine.backward(loss * self.world if self.world > 1 else loss, scale_wrt_gas=False)
        self.engine.step()
        if critic_loss is not None:
            self.critic.backward(critic_loss, last_of_step)

    def grad_norm(self) -> float | None:
        """The last step's gradient norm over all ranks, before clipping (None when DeepSpeed did not compute it:
        no gradient clipping)."""
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    @contextlib.contextmanager
    def _gathered(self):
        """Full parameters on this rank (ZeRO 3 partitions them)."""
        if self.config.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=None):
                yield
        else:
            yield

    @collective
    def save_policy(self, folder: Path) -> Path:
        """What the rollout engine loads: `folder/adapter` (LoRA), `folder/adapters/<name>` (one adapter per
        agent; with the manifest `folder/adapters.json`) or `folder/model` (full weights), written by rank 0
        (every rank takes part in gathering ZeRO 3's partitions)."""
        target = folder / ("model" if self.config.full_finetune else "adapters" if self.adapters else "adapter")
        with self._gathered():
            if self.rank == 0:
                target.mkdir(parents=True, exist_ok=True)
                # PEFT writes each named adapter into a folder of its name (the "default" one into target).
                self.module.save_pretrained(target, safe_serialization=True)
                if self.adapters:
                    write_manifest(folder, self.config.adapters)
        if self.config.full_finetune and self.rank == 0:
            self.tokenizer.save_pretrained(target)
        return target

    @collective
    def save_state(self, folder: Path) -> None:
        """Optimizer and parameters for resuming (DeepSpeed checkpoint); the critic's in `folder/critic`."""
        self.engine.save_checkpoint(str(folder), tag="state")
        if self.critic is not None:
            self.critic.save(folder / "critic", self.rank)

    @collective
    def load_state(self, folder: Path, optimizer: bool = True) -> None:
        """Parameters and, with `optimizer`, the optimizer's moments and step counts from a save_state folder.
        Without it the weights alone are loaded (DeepSpeed refreshes its fp32 copies from them) and the
        optimizer starts fresh: what a new phase wants, e.g. GRPO after an SFT warm start."""
        path, rest = self.engine.load_checkpoint(str(folder), tag="state", load_module_only=not optimizer)
        if path is None:
            raise RuntimeError(f"no DeepSpeed checkpoint in {folder}")
        if not optimizer:
            self._forget_moments()
            # DeepSpeed restores its step count only with the optimizer; the run's count goes on either way (the
            # x axis of the step metrics, train/trackers.py), as it does when GRPO follows SFT in one process.
            self.engine.global_steps = int(rest.get("global_steps", self.engine.global_steps))
        if self.critic is not None:
            if (folder / "critic").is_dir():
                self.critic.load(folder / "critic", optimizer)
            else:  # a state saved without one: the SFT warm start's
                log.info("no critic in %s: the critic starts fresh", folder)

    @collective
    def fresh_optimizer(self) -> None:
        """Forget the optimizer's state (Adam's moments and step counts): its next step is a first step.
        SFT's moments are shaped by another loss at another learning rate; carried into GRPO they would steer
        its first updates (and Adam's bias correction would treat them as a long-running average)."""
        self._forget_moments()

    def _forget_moments(self) -> None:
        self.base_optimizer().state.clear()  # torch optimizers rebuild a parameter's state when it is empty

    def base_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer under DeepSpeed's wrappers (ZeRO keeps its own over the flat fp32 partitions)."""
        inner = self.optimizer
        while not isinstance(inner, torch.optim.Optimizer) and getattr(inner, "optimizer", None) is not None:
            inner = inner.optimizer
        if not isinstance(inner, torch.optim.Optimizer):
            raise RuntimeError(f"no torch optimizer under {type(self.optimizer).__name__}")
        return inner

    @collective
    def close(self) -> None:
        """Give back the model and optimizer memory, and remove the shared-memory buffer DeepSpeed's CPU collective
        leaves behind. Without `destroy` DeepSpeed keeps the engine reachable and each learner a process builds
        stays resident (2 GB for the bundled model, full fine-tune). The process group stays for the life of the
        process: DeepSpeed keeps references to it, and a later learner reuses it."""
        if self.engine is not None:
            self.engine.destroy()
        if self.critic is not None:
            self.critic.close()
        self.engine = self.optimizer = self.reference = self.critic = None
        gc.collect()
        pattern = (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR')}_"
                   f"{os.environ.get('MASTER_PORT')}_*")
        for path in glob.glob(pattern):
            with contextlib.suppress(OSError):
                os.unlink(path)
