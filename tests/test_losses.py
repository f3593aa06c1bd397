"""The loss functions on hand-computed values (train/losses.py)."""
import math

import polars as pl

import pytest
import torch

from lightning_otel.train.transitions.credit import ADVANTAGES, EPS
from lightning_otel.train.losses import (AGGREGATIONS, TOKEN_RETURNS, grpo_loss, k3_kl, kl_penalised_returns,
                                         normalise_tokens, sft_loss, token_weights)


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



def test_grpo_loss_takes_one_advantage_per_token():
    # on-policy (ratio 1), two tokens with A = +1 and -2, weights 1/2: loss -(1 - 2) / 2, gradient -A * w
    logp = torch.zeros(1, 2, requires_grad=True)
    out = grpo_loss(logp, torch.zeros(1, 2), torch.tensor([[1.0, -2.0]]), torch.tensor([[0.5, 0.5]]))
    assert float(out.loss.detach()) == pytest.approx(0.5)
    out.loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([-0.5, 1.0])


def test_reinforce_pp_token_returns_carry_the_kl_penalty_and_the_return_at_the_last_token():
    # Sample 0, three tokens: KL = old - ref = 0.5, -1.0, 0.0; beta 0.1 gives r = -0.05, 0.1, 0 + R = 1 at the
    # end, so G = 1.05, 1.1, 1.0. Sample 1, two tokens (right-aligned after one pad): KL = 1.0, 0.0, R = 0:
    # r = -0.1, 0, G = -0.1, 0.0.
    nan = math.nan
    old = torch.tensor([[-1.0, -2.0, -0.5], [nan, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5], [nan, -2.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    returns = TOKEN_RETURNS["reinforce-pp"](old, ref, torch.tensor([1.0, 0.0]), mask, 0.1)
    assert returns[0].tolist() == pytest.approx([1.05, 1.1, 1.0])
    assert returns[1, 1:].tolist() == pytest.approx([-0.1, 0.0])
    # The trained tokens 1.05 1.1 1.0 -0.1 0.0: mean 0.61, squared deviations .1936 .2401 .1521 .5041 .3721
    # summing to 1.462, sample variance 1.462 / 4.
    std = math.sqrt(1.462 / 4)
    first, second = normalise_tokens([returns[0], returns[1]], [mask[0], mask[1]])
    assert first.tolist() == pytest.approx([(0.44) / (std + EPS), 0.49 / (std + EPS), 0.39 / (std + EPS)])
    assert second.tolist() == pytest.approx([0.0, -0.71 / (std + EPS), -0.61 / (std + EPS)])  # 0 on the pad


def test_reinforce_pp_skips_untrained_gap_tokens():
    # A merged sample: completion, a tool result (mask 0, logprob 0), completion. Only trained tokens are
    # penalised: KL 1.0 then 0.0 with beta 0.5, R = 2 at the last token: G = 1.5, 2.0, 2.0.
    returns = kl_penalised_returns(torch.tensor([[-1.0, 0.0, -1.0]]), torch.tensor([[-2.0, -5.0, -1.0]]),
                                   torch.tensor([2.0]), torch.tensor([[1.0, 0.0, 1.0]]), 0.5)
    assert returns.tolist()[0] == pytest.approx([1.5, 2.0, 2.0])


def test_reinforce_pp_without_kl_is_the_sequence_advantage_on_every_token():
    # Returns 1, 0, 0.5 on completions of 3, 1 and 2 tokens, in two batches normalised together: every token
    # gets its transition's advantage from credit.py.
    frame = pl.DataFrame({"rollout_id": ["a", "b", "c"], "task_id": ["t", "t", "u"], "policy_version": [0, 0, 0],
                          "return": [1.0, 0.0, 0.5], "completion_len": [3, 1, 2]})
    sequence = ADVANTAGES["reinforce-pp"](frame)[0]["advantage"].to_list()
    mask_ab = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 1.0]])
    mask_c = torch.tensor([[1.0, 1.0]])
    ab = kl_penalised_returns(torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([1.0, 0.0]), mask_ab, 0.0)
    c = kl_penalised_returns(torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([0.5]), mask_c, 0.0)
    a_tokens, b_tokens, c_tokens = normalise_tokens([ab[0], ab[1, 2:], c[0]], [mask_ab[0], mask_ab[1, 2:], mask_c[0]])
    assert a_tokens.tolist() == pytest.approx([sequence[0]] * 3)
    assert b_tokens.tolist() == pytest.approx([sequence[1]])
    assert c_tokens.tolist() == pytest.approx([sequence[2]] * 2)
