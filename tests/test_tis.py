"""Truncated importance sampling (`tis_cap`): the weights and the loss on hand-computed tokens (train/losses.py),
the pass that gives each transition its proximal logprobs and the metrics of the steps (train/optimize.py), the
config keys, and one real step on the bundled SmolLM2-135M with LoRA under DeepSpeed."""
from __future__ import annotations

import math

import pytest
import torch

from lightning_otel.errors import UserError
from lightning_otel.serve.model import bundled_model_dir
from lightning_otel.train.batch import Scores, collate
from lightning_otel.train.config import TrainConfig
from lightning_otel.train.losses import grpo_loss, truncated_is_weights
from lightning_otel.train.optimize import StepStats, grpo_objective, optimize, with_proximal_logprobs

NAN = math.nan


def test_the_weights_are_truncated_at_the_cap_and_1_without_a_record():
    prox = torch.tensor([[-1.0, -0.5, -2.0, -3.0]])
    behaviour = torch.tensor([[-1.2, -2.0, NAN, -2.0]])
    weights, truncated = truncated_is_weights(prox, behaviour, cap=2.0)
    # e^0.2; e^1.5 = 4.48 truncated to 2; no record: 1; e^-1 (below 1: never raised)
    assert weights.tolist()[0] == pytest.approx([math.exp(0.2), 2.0, 1.0, math.exp(-1.0)])
    assert truncated.tolist() == [[False, True, False, False]]


def three_tokens():
    """A = +1, clip 0.2, one sample of three trained tokens weighing 1/3 each:
    t0: behaviour -1.2, prox -1.0, logp -0.9: ratio e^0.1 inside the range (against behaviour e^0.3 would clip);
        w = e^0.2
    t1: behaviour -2.0, prox -0.5, logp 0.0: ratio e^0.5 above 1.2 with A > 0: clipped; w = e^1.5 truncated to 2
    t2: no behaviour logprob, prox -2.0, logp -2.1: ratio e^-0.1 (min picks it); w = 1"""
    logp = torch.tensor([[-0.9, 0.0, -2.1]], requires_grad=True)
    prox = torch.tensor([[-1.0, -0.5, -2.0]])
    behaviour = torch.tensor([[-1.2, -2.0, NAN]])
    return logp, prox, behaviour, torch.tensor([1.0]), torch.full((1, 3), 1 / 3)


def test_the_loss_clips_around_the_proximal_policy_and_weights_each_token():
    logp, prox, behaviour, adv, weights = three_tokens()
    out = grpo_loss(logp, prox, adv, weights, clip=0.2, behaviour_logp=behaviour, tis_cap=2.0)
    w0, r0, r2 = math.exp(0.2), math.exp(0.1), math.exp(-0.1)
    assert float(out.loss.detach()) == pytest.approx(-(w0 * r0 + 2.0 * 1.2 + 1.0 * r2) / 3)
    assert out.clip_fraction == pytest.approx(1 / 3)  # t1 only
    assert (out.tis_tokens, out.tis_truncated) == (3.0, 1.0)
    assert out.tis_weight_sum == pytest.approx(w0 + 2.0 + 1.0)
    assert out.logprob_gap == pytest.approx((0.3 + 2.0 + 0.0) / 3)  # learner against the sampler, not prox
    out.loss.backward()
    # d/dlogp of -w * ratio * A / 3 is -w * ratio / 3; the clipped token gets none
    assert logp.grad.tolist()[0] == pytest.approx([-w0 * r0 / 3, 0.0, -r2 / 3])
    # Without TIS the same logprobs are measured against the sampler: t0's ratio e^0.3 clips too.
    untouched = torch.where(torch.isnan(behaviour), logp.detach(), behaviour)
    assert grpo_loss(logp, untouched, adv, weights, clip=0.2).clip_fraction == pytest.approx(2 / 3)


def test_masked_tokens_count_neither_in_the_share_nor_in_the_mean():
    logp, prox, behaviour, adv, _ = three_tokens()
    out = grpo_loss(logp, prox, adv, torch.tensor([[0.5, 0.0, 0.5]]), behaviour_logp=behaviour, tis_cap=2.0)
    assert (out.tis_tokens, out.tis_truncated) == (2.0, 0.0)
    assert out.tis_weight_sum == pytest.approx(math.exp(0.2) + 1.0)


def todays_loss(logp, old, adv, weights, clip):
    """The clipped objective as written before TIS existed, op for op."""
    ratio = torch.exp(logp - old)
    return (-torch.minimum(ratio * adv[:, None], torch.clamp(ratio, 1 - clip, 1 + clip) * adv[:, None])
            * weights).sum()


def test_with_tis_off_the_loss_and_gradient_are_bit_for_bit_todays():
    logp, _, behaviour, adv, weights = three_tokens()
    old = torch.where(torch.isnan(behaviour), logp.detach(), behaviour)
    expected = todays_loss(logp, old, adv, weights, 0.2)
    (expected_grad,) = torch.autograd.grad(expected, logp)
    for out in (grpo_loss(logp, old, adv, weights, clip=0.2),
                grpo_loss(logp, old, adv, weights, clip=0.2, behaviour_logp=behaviour, tis_cap=0.0)):
        assert torch.equal(out.loss, expected) and out.tis_tokens is None
        assert torch.equal(torch.autograd.grad(out.loss, logp)[0], expected_grad)
    # With TIS on and the learner agreeing with the sampler (prox = behaviour), every weight is exactly 1.
    agreeing = grpo_loss(logp, old, adv, weights, clip=0.2, behaviour_logp=old, tis_cap=2.0)
    assert torch.equal(agreeing.loss, expected) and agreeing.tis_weight_sum == 3.0


class TinyPolicy:
    """A learner over a 4-token vocabulary whose log-probabilities ignore the context: log_softmax(theta)[token].
    Plain SGD at each step's end; enough of the Learner's surface for optimize()."""

    pad_id = 0
    rank, world = 0, 1

    def __init__(self, lr: float = 0.5):
        self.theta = torch.zeros(4, requires_grad=True)
        self.lr, self.optimizer_steps, self.calls = lr, 0, []

    def train_mode(self, on: bool) -> None:
        pass

    def scores(self, batch, temperature=1.0):
        self.calls.append("scores")
        logp = torch.log_softmax(self.theta / temperature, dim=0)[batch.targets]
        return Scores(logp, torch.zeros_like(logp))

    def logprobs(self, batch, temperature=1.0):
        self.calls.append("logprobs")
        return self.scores(batch, temperature).logp.detach()

    def backward(self, loss, last_of_step, critic_loss=None):
        loss.backward()
        if last_of_step:
            with torch.no_grad():
                self.theta -= self.lr * self.theta.grad
            self.theta.grad = None
            self.optimizer_steps += 1

    def learning_rate(self):
        return self.lr

    def grad_norm(self):
        return None


def row(rollout, completion, logprobs, advantage):
    return {"rollout_id": rollout, "prompt_ids": [3, 3, 3], "completion_ids": completion,
            "completion_logprobs": logprobs, "loss_mask": None, "advantage": advantage}


def test_the_pass_gives_each_transition_the_learners_logprobs_before_any_update():
    rows = [row("a", [1, 2], [-1.0, -1.0], 1.0), row("b", [3], None, -1.0)]
    policy = TinyPolicy()
    with torch.no_grad():
        policy.theta += torch.tensor([0.0, 1.0, 0.0, -1.0])
    expected = torch.log_softmax(policy.theta.detach(), dim=0)
    out = with_proximal_logprobs(policy, rows, TrainConfig(tis_cap=2.0, micro_batch=1, batch_size=2), StepStats())
    assert out[0]["prox_logprobs"] == pytest.approx([float(expected[1]), float(expected[2])])
    assert out[1]["prox_logprobs"] == pytest.approx([float(expected[3])])
    assert "prox_logprobs" not in rows[0]  # the caller's rows are left as they were
    batch = collate(out, 0)
    assert batch.prox_logp[0].tolist() == pytest.approx([float(expected[1]), float(expected[2])])
    assert math.isnan(float(batch.prox_logp[1, 0])) and collate(rows, 0).prox_logp is None
    # Off: no forward pass, the rows as given.
    policy.calls.clear()
    assert with_proximal_logprobs(policy, rows, TrainConfig(), StepStats()) is rows and not policy.calls


def test_a_step_reports_the_truncated_share_and_the_mean_weight():
    # theta = 0: the learner gives every token log(1/4). Behaviour logprobs: 1 below it (w = e^1, truncated to 2),
    # 0.5 above (w = e^-0.5), equal (w = 1), and none recorded (w = 1).
    base = math.log(0.25)
    rows = [row("a", [1, 2], [base - 1.0, base + 0.5], 1.0), row("b", [3, 1], [base, None], -1.0)]
    config = TrainConfig(tis_cap=2.0, batch_size=2, micro_batch=1, share_prefix=0)
    steps: list[dict] = []
    stats = optimize(TinyPolicy(), rows, config, "grpo", seed=0, on_step=lambda n, m: steps.append(m))
    mean = (2.0 + math.exp(-0.5) + 1.0 + 1.0) / 4
    assert stats.steps == 1 and steps[0]["tis_truncated_fraction"] == pytest.approx(0.25)
    assert steps[0]["tis_weight_mean"] == pytest.approx(mean)
    summary = stats.summary()
    assert summary["tis_truncated_fraction"] == pytest.approx(0.25)
    assert summary["tis_weight_mean"] == pytest.approx(mean)
    # the first micro-batch runs before any update: its ratio against the proximal policy is exactly 1
    assert summary["first_ratio_mean"] == 1.0 and summary["first_clip_fraction"] == 0.0
    # Off: the same step reports nothing of TIS, and the first ratio is against the sampler's logprobs.
    plain_steps: list[dict] = []
    plain = optimize(TinyPolicy(), rows, TrainConfig(batch_size=2, micro_batch=1, share_prefix=0), "grpo", seed=0,
                     on_step=lambda n, m: plain_steps.append(m))
    assert "tis_weight_mean" not in plain_steps[0] and plain.summary()["tis_weight_mean"] is None


def test_the_objective_takes_the_ratio_against_prox_only_when_the_rows_carry_it():
    policy = TinyPolicy()
    rows = [row("a", [1, 2], [-3.0, -0.5], 1.0)]
    config = TrainConfig(tis_cap=2.0)
    weights = torch.full((1, 2), 0.5)
    with_prox = with_proximal_logprobs(policy, rows, config, StepStats())
    out = grpo_objective(policy, collate(with_prox, 0), weights, config)
    assert out.ratio_mean == 1.0 and out.tis_tokens == 2.0
    # w = min(e^(log .25 + 3), 2) = 2 (truncated), e^(log .25 + .5) = 0.412
    assert out.tis_truncated == 1.0 and out.tis_weight_sum == pytest.approx(2.0 + math.exp(math.log(0.25) + 0.5))
    plain = grpo_objective(policy, collate(rows, 0), weights, TrainConfig())
    assert plain.tis_tokens is None and plain.ratio_mean != 1.0


def test_the_config_keys_are_checked():
    assert TrainConfig().tis_cap == 0.0 and TrainConfig().max_staleness == 0
    assert TrainConfig(tis_cap=2.0).tis_cap == 2.0
    for bad in (-1.0, 0.5, math.inf):
        with pytest.raises(UserError, match=f"tis_cap = {bad}: the cap on the importance weights must be 0"):
            TrainConfig(tis_cap=bad)
    with pytest.raises(UserError, match="max_staleness = -1: give a whole number"):
        TrainConfig(max_staleness=-1)
    with pytest.raises(UserError, match="max_staleness = 1: async rounds train on rollouts up to 1 policy "
                                        "version.* set tis_cap"):
        TrainConfig(max_staleness=1)


@pytest.mark.heavy
def test_a_real_step_with_tis_scores_the_rows_first_and_starts_at_ratio_1():
    """On the bundled model: the proximal pass (its own micro-batches, prefix sharing) gives the same logprobs as
    the first step's forward pass, so the first ratio is ~1; the behaviour logprobs (-1 per token, far from the
    model's) give weights, some truncated; the step moves the adapter."""
    from lightning_otel.train.learner import Learner

    config = TrainConfig(lora_rank=4, lr=1e-3, batch_size=4, micro_batch=2, tis_cap=2.0)
    learner = Learner(bundled_model_dir(), config)
    try:
        encode = learner.tokenizer.encode
        prompt, answer = encode("Write a query that counts the singers."), encode("SELECT count(*) FROM singer")
        rows = [row(f"r{i % 2}", answer[:3 + i], [-1.0] * (3 + i), 1.0 if i % 2 else -1.0) | {"prompt_ids": prompt}
                for i in range(4)]
        trained = [p for p in learner.module.parameters() if p.requires_grad]
        before = [p.detach().clone() for p in trained]
        stats = optimize(learner, rows, config, "grpo", seed=0)
        summary = stats.summary()
        assert stats.steps == 1 and math.isfinite(stats.loss[0])
        assert summary["first_ratio_mean"] == pytest.approx(1.0, abs=1e-4)
        assert 0 < summary["tis_weight_mean"] and 0 <= summary["tis_truncated_fraction"] <= 1
        assert any(not torch.equal(b, p.detach()) for b, p in zip(before, trained))
    finally:
        learner.close()
