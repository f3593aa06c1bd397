"""GRPO after an SFT warm start starts with a fresh optimizer: SFT's Adam moments and step counts are not carried
into it, neither in the same process (Trainer.run) nor when a run resumes from its SFT checkpoint
(weights-only load). The real learner: the bundled SmolLM2-135M with LoRA under DeepSpeed ZeRO 2."""
from __future__ import annotations

import pytest
import torch

from lightning_otel.serve.model import bundled_model_dir
from lightning_otel.train.config import TrainConfig
from lightning_otel.train.learner import Learner
from lightning_otel.train.optimize import optimize


def rows(tokenizer, advantages: list[float]) -> list[dict]:
    prompt = tokenizer.encode("Write a query that counts the singers.")
    answer = tokenizer.encode("SELECT count(*) FROM singer")
    return [{"rollout_id": f"ro-{i}", "prompt_ids": prompt, "completion_ids": answer[: 4 + i],
             "completion_logprobs": None, "loss_mask": None, "advantage": a} for i, a in enumerate(advantages)]


def adam_steps(learner: Learner) -> set[int]:
    """The step counts Adam holds for the trainable parameters (empty: no state at all)."""
    return {int(state["step"]) for state in learner.base_optimizer().state.values()}


def trainable(learner: Learner) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in learner.module.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def config() -> TrainConfig:
    return TrainConfig(lora_rank=4, lr=1e-3, sft_lr=1e-3, batch_size=2, micro_batch=2, zero_stage=2)


@pytest.fixture(scope="module")
def after_sft(config, tmp_path_factory):
    """A learner after 3 SFT steps, and its saved state."""
    learner = Learner(bundled_model_dir(), config)
    sft = rows(learner.tokenizer, [0.0, 0.0])
    for _ in range(3):
        optimize(learner, sft, config, "sft", seed=0)
    folder = tmp_path_factory.mktemp("sft") / "state"
    learner.save_state(folder)
    yield learner, folder
    learner.close()


def grpo_step(learner: Learner, config: TrainConfig) -> None:
    optimize(learner, rows(learner.tokenizer, [1.0, -1.0]), config, "grpo", seed=0)


@pytest.mark.heavy
def test_sft_leaves_adam_state_behind(after_sft):
    learner, _ = after_sft
    assert adam_steps(learner) == {3}  # what GRPO would inherit without a reset


@pytest.mark.heavy
def test_a_resumed_grpo_run_loads_the_sft_weights_but_not_the_optimizer(after_sft, config):
    trained, folder = after_sft
    resumed = Learner(bundled_model_dir(), config)
    try:
        resumed.load_state(folder, optimizer=False)
        assert adam_steps(resumed) == set()
        assert resumed.optimizer_steps == trained.optimizer_steps == 3  # the run's step count goes on (step metrics)
        weights = trainable(resumed)
        assert all(torch.equal(weights[name], value) for name, value in trainable(trained).items())
        grpo_step(resumed, config)
        assert adam_steps(resumed) == {1}
        # The first step of a fresh Adam moves every parameter that has a gradient by about lr (m / sqrt(v) = +-1):
        # SFT's moments would have made it a fraction of that.
        moved = torch.cat([(resumed_p - weights[n]).abs().flatten() for n, resumed_p in trainable(resumed).items()])
        moved = moved[moved > 0]
        assert moved.numel() > 0 and torch.quantile(moved, 0.5) == pytest.approx(config.lr, rel=0.05)
    finally:
        resumed.close()
    # the same checkpoint loaded whole brings its optimizer state back (a resume in the middle of a phase)
    whole = Learner(bundled_model_dir(), config)
    try:
        whole.load_state(folder)
        assert adam_steps(whole) == {3}
    finally:
        whole.close()


@pytest.mark.heavy
def test_fresh_optimizer_in_the_same_process_makes_the_next_step_a_first_step(after_sft, config):
    learner, _ = after_sft
    learner.fresh_optimizer()
    assert adam_steps(learner) == set()
    grpo_step(learner, config)
    assert adam_steps(learner) == {1}
