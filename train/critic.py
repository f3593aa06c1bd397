"""PPO's critic (`advantage = "ppo"`): a value model V(s) of the state at the start of each turn's completion
(the final hidden state at the prompt's last token), trained with the clipped value loss (train/losses.py).

Two kinds, chosen by the `critic` config key:
  head     (the default) a scalar head (ValueHead: linear on the unit-length state) on the policy's own final
           hidden state, computed in the policy's forward pass and detached from it: the value loss trains the
           head alone and never moves the policy's LoRA; the policy loss never moves the head. Cost: nothing
           beyond the head (one hidden-size vector) and its optimizer; no second model, no second forward pass in
           the update steps. Its features are the policy's, so it sees what the policy sees and follows it as the
           policy changes. The head is a plain torch module beside the DeepSpeed engine (tiny, so not
           partitioned); with several ranks its gradients are summed over them (each rank holds part of the
           step's loss).
  base / a model folder
           a separate value model: the policy's base model ("base") or another causal LM with the same tokenizer,
           with its own LoRA adapter (lora_rank, lora_alpha) and a scalar head, in its own DeepSpeed engine (its own
           optimizer, ZeRO partitioning and gradient clipping). More capacity than the head, at the cost of its own
           weights and optimizer state in memory and one more forward and backward pass per micro-batch. Not the
           policy's model with a second PEFT adapter: one module under two DeepSpeed engines (ZeRO hooks its
           parameters) and adapter switching inside one engine's step are what this design avoids.
Both start at V = 0 (the head's weights are zero). Learning rate: critic_lr, AdamW.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import torch

from lightning_otel.errors import UserError
from lightning_otel.train.batch import Batch, prefix_arguments, prompt_states
from lightning_otel.train.config import TrainConfig

log = logging.getLogger(__name__)
HEAD = "head"
BASE = "base"
HEAD_FILE = "critic_head.pt"

States = Callable[[], torch.Tensor]  # the policy's final hidden states at the batch's last prompt tokens [B, H]


class ValueHead(torch.nn.Module):
    """V = w . h / |h| + b: a linear head on the direction of the hidden state h. A model's hidden states have
    their own scale (|h|_1 ~ 600 for SmolLM2-135M's), and Adam moves every weight by about the learning rate per
    step, so on raw states V would move by critic_lr x |h|_1 a step; on unit vectors by about critic_lr x
    sqrt(hidden size), whatever the model. Zero weights: V starts at 0."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = torch.nn.Linear(hidden, 1)
        torch.nn.init.zeros_(self.linear.weight)
        torch.nn.init.zeros_(self.linear.bias)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        states = states.float()
        return self.linear(states / states.norm(dim=-1, keepdim=True).clamp(min=1e-6)).squeeze(-1)


def _sum_over_ranks(parameters, world: int) -> None:
    if world > 1:
        for p in parameters:
            if p.grad is not None:
                torch.distributed.all_reduce(p.grad)


class HeadCritic:
    """A value head on the policy's detached final hidden state."""

    def __init__(self, hidden: int, config: TrainConfig, device: torch.device, world: int = 1):
        self.head = ValueHead(hidden).to(device)
        self.optimizer = torch.optim.AdamW(self.head.parameters(), lr=config.critic_lr, weight_decay=0.0)
        self.grad_clip, self.world = config.grad_clip, world
        self.trainable = sum(p.numel() for p in self.head.parameters())

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.head.parameters())

    def values(self, batch: Batch, policy_states: States) -> torch.Tensor:
        return self.head(policy_states().detach())

    def backward(self, loss: torch.Tensor, last_of_step: bool) -> None:
        loss.backward()
        if last_of_step:
            _sum_over_ranks(self.head.parameters(), self.world)
            if self.grad_clip:
                torch.nn.utils.clip_grad_norm_(self.head.parameters(), self.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def save(self, folder: Path, rank: int) -> None:
        if rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
            torch.save({"head": self.head.state_dict(), "optimizer": self.optimizer.state_dict()}, folder / HEAD_FILE)

    def load(self, folder: Path, optimizer: bool) -> None:
        saved = torch.load(folder / HEAD_FILE, map_location=self.head.linear.weight.device, weights_only=True)
        self.head.load_state_dict(saved["head"])
        if optimizer:
            self.optimizer.load_state_dict(saved["optimizer"])

    def close(self) -> None:
        self.head = self.optimizer = None


class ValueModel(torch.nn.Module):
    """A causal LM (with its LoRA adapter) and a scalar head. Called like the LM (what the shared-prefix pass
    does), or with `values_of` (the batch's completion lengths): the head's values at the last prompt tokens."""

    def __init__(self, lm: torch.nn.Module, hidden: int):
        super().__init__()
        self.lm, self.head = lm, ValueHead(hidden)

    def forward(self, values_of: torch.Tensor | None = None, **kwargs):
        if values_of is None:
            return self.lm(**kwargs)
        captured: list[torch.Tensor] = []
        hook = self.lm.get_output_embeddings().register_forward_pre_hook(lambda m, args: captured.append(args[0]))
        try:
            self.lm(**kwargs)
        finally:
            hook.remove()
        return self.head(prompt_states(captured[-1], values_of))

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm.get_output_embeddings()


class ModelCritic:
    """A separate value model with its own LoRA adapter and head, in its own DeepSpeed engine."""

    def __init__(self, model_dir: Path, config: TrainConfig, policy_tokenizer, world: int = 1):
        import deepspeed
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from lightning_otel.train.learner import LORA_TARGETS, deepspeed_config

        if AutoTokenizer.from_pretrained(model_dir).get_vocab() != policy_tokenizer.get_vocab():
            raise UserError(f"critic = {model_dir}: its tokenizer differs from the policy's, and the critic reads the "
                            f"policy's token ids; give a model of the same family (same tokenizer), or critic = base")
        lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if config.bf16 else torch.float32)
        lm.config.use_cache = False
        lm = get_peft_model(lm, LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha,
                                           target_modules=LORA_TARGETS, lora_dropout=0.0, task_type="CAUSAL_LM"))
        model = ValueModel(lm, lm.get_output_embeddings().in_features)
        params = [p for p in model.parameters() if p.requires_grad]
        self.trainable = sum(p.numel() for p in params)
        optimizer = torch.optim.AdamW(params, lr=config.critic_lr, weight_decay=0.0)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                                                 config=deepspeed_config(config))
        self.autocast, self.world = config.autocast, world

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.engine.module.parameters() if p.requires_grad]

    def values(self, batch: Batch, policy_states: States) -> torch.Tensor:
        with torch.autocast(batch.input_ids.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            return self.engine(values_of=batch.completion_len, input_ids=batch.input_ids,
                               attention_mask=batch.attention, position_ids=batch.positions,
                               logits_to_keep=batch.completion_width + 1, **prefix_arguments(self.engine, batch))

    def backward(self, loss: torch.Tensor, last_of_step: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(last_of_step)
        self.engine.backward(loss * self.world if self.world > 1 else loss, scale_wrt_gas=False)
        self.engine.step()

    def save(self, folder: Path, rank: int) -> None:
        self.engine.save_checkpoint(str(folder), tag="critic")

    def load(self, folder: Path, optimizer: bool) -> None:
        path, _ = self.engine.load_checkpoint(str(folder), tag="critic", load_module_only=not optimizer)
        if path is None:
            raise RuntimeError(f"no critic checkpoint in {folder}")

    def close(self) -> None:
        if self.engine is not None:
            self.engine.destroy()
        self.engine = self.optimizer = None


Critic = HeadCritic | ModelCritic


def critic_source(config: TrainConfig, model_dir: Path) -> Path | None:
    """The model folder of a separate critic (None: the head on the policy)."""
    if config.critic == HEAD:
        return None
    return Path(model_dir) if config.critic == BASE else Path(config.critic).expanduser()


def build_critic(config: TrainConfig, model_dir: Path, policy: torch.nn.Module, tokenizer,
                 world: int = 1) -> Critic:
    source = critic_source(config, model_dir)
    if source is None:
        layer = policy.get_output_embeddings()
        critic: Critic = HeadCritic(layer.in_features, config, layer.weight.device, world)
    else:
        critic = ModelCritic(source, config, tokenizer, world)
    log.info("critic: %s, %d trainable parameters, lr %g", config.critic if source is None else source,
             critic.trainable, config.critic_lr)
    return critic
