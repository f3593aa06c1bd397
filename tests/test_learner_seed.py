"""The seed fixes where a LoRA run starts: the adapters' A matrices are drawn at random when the learner is
built, so two learners with one seed (a rerun, or the ranks of a multi-process run before DeepSpeed's
broadcast) hold the same adapters, and another seed draws others. The real learner on the bundled model."""
from __future__ import annotations

import pytest
import torch

from lightning_otel.serve.model import bundled_model_dir
from lightning_otel.train.config import TrainConfig
from lightning_otel.train.learner import Learner


def adapters(seed: int) -> dict[str, torch.Tensor]:
    learner = Learner(bundled_model_dir(), TrainConfig(lora_rank=4, seed=seed))
    try:
        return {n: p.detach().clone() for n, p in learner.module.named_parameters() if p.requires_grad}
    finally:
        learner.close()


@pytest.mark.heavy
def test_one_seed_draws_the_same_adapters_and_another_seed_others():
    first, again, other = adapters(3), adapters(3), adapters(4)
    a_matrices = [n for n in first if "lora_A" in n]
    assert a_matrices and first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[n], again[n]) for n in first)
    assert all(first[n].abs().max() > 0 and not torch.equal(first[n], other[n]) for n in a_matrices)
