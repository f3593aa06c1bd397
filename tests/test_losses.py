"""The loss functions on hand-computed values (train/losses.py)."""
import math

import pytest
import torch

from lightning_otel.train.losses import AGGREGATIONS, grpo_loss, k3_kl, sft_loss, token_weights


def test_token_weighting_counts_every_token_the_same():
    counts = torch.tensor([1.0, 3.0])
    assert AGGREGATIONS["token"](counts, torch.tensor([0, 0])).tolist() == [0.25, 0.25]


def test_sequence_weighting_means_within_then_across_samples():
    counts = torch.tensor([1.0, 3.0, 0.0])
    scale = AGGREGATIONS["sequence"](counts, torch.tensor([0, 1, 2]))
    assert scale.tolist() == pytest.approx([0.5, 1 / 6, 0.0])


def test_rollout_weighting_gives_every_rollout_the_same_weight_however_many_turns():
    # rollout 7 has two turns (2 and 4 tokens), rollout 9 one turn (1 token)
    counts = torch.tensor([2.0, 4.0, 1.0])
    scale = AGGREGATIONS["rollout"](counts, torch.tensor([7, 7, 9]))
    assert scale.tolist() == pytest.approx([1 / 8, 1 / 16, 1 / 2])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float)
    weights = token_weights(mask, scale)
    assert float(weights.sum()) == pytest.approx(1.0)
    assert float(weights[:2].sum()) == pytest.approx(0.5)  # the two-turn rollout weighs as much as the other


def test_grpo_loss_clips_the_ratio_on_the_side_the_advantage_pushes():
    # two tokens of one sample, A = +1: ratio e^0.5 (clipped to 1.2) and e^-0.5 (unclipped: min picks it)
    logp = torch.tensor([[0.5, -0.5]], requires_grad=True)
    old = torch.zeros(1, 2)
    weights = torch.tensor([[0.5, 0.5]])
    out = grpo_loss(logp, old, torch.tensor([1.0]), weights, clip=0.2)
    assert float(out.loss) == pytest.approx(-(1.2 + math.exp(-0.5)) / 2)
    assert out.clip_fraction == pytest.approx(0.5)
    out.loss.backward()
    # the clipped token gets no gradient; the other gets -0.5 * ratio
    assert logp.grad.tolist()[0] == pytest.approx([0.0, -0.5 * math.exp(-0.5)])


def test_grpo_loss_with_negative_advantage_and_kl():
    logp = torch.tensor([[-1.0]])
    old = torch.tensor([[-1.0]])
    ref = torch.tensor([[-1.5]])
    out = grpo_loss(logp, old, torch.tensor([-2.0]), torch.tensor([[1.0]]), clip=0.2, kl_coef=0.1, ref_logp=ref)
    kl = math.exp(-0.5) + 0.5 - 1
    assert out.kl == pytest.approx(kl)
    assert float(out.loss) == pytest.approx(2.0 + 0.1 * kl)


def test_k3_kl_is_zero_at_equal_policies_and_positive_elsewhere():
    x = torch.tensor([-1.0, -2.0])
    assert k3_kl(x, x).tolist() == [0.0, 0.0]
    assert bool((k3_kl(x, x + 0.3) > 0).all())


def test_masked_tokens_do_not_count():
    logp = torch.tensor([[-1.0, -7.0]])
    weights = token_weights(torch.tensor([[1.0, 0.0]]), torch.tensor([1.0]))
    assert float(sft_loss(logp, weights).loss) == pytest.approx(1.0)
    out = grpo_loss(logp, torch.tensor([[-1.0, 0.0]]), torch.tensor([1.0]), weights)
    assert out.clip_fraction == 0.0 and out.ratio_mean == pytest.approx(1.0)

