"""PPO with a learned critic (`advantage = "ppo"`): GAE over a rollout's turns and the clipped value loss on
hand-computed numbers, the pass that gives every transition its value and advantage (train/optimize.py), the
configuration, and real steps on the bundled SmolLM2-135M with LoRA under DeepSpeed: the policy loss moves only
the policy's adapter, the value loss only the critic, the base weights neither; the critic's weights and
optimizer state survive a save and load of the learner's state (a resumed run)."""
from __future__ import annotations

import math

import polars as pl
import pytest
import torch

from lightning_otel.errors import UserError
from lightning_otel.serve.model import bundled_model_dir
from lightning_otel.train.batch import collate
from lightning_otel.train.config import TrainConfig
from lightning_otel.train.losses import clipped_value_loss, gae, ppo_advantages, turn_rewards
from lightning_otel.train.optimize import StepStats, optimize, with_critic_advantages
from lightning_otel.train.transitions.credit import ADVANTAGES, EPS


def test_gae_on_a_single_turn_is_the_reward_minus_the_value():
    assert turn_rewards([1.0], 0.9) == [1.0]
    for lam in (0.0, 0.5, 1.0):
        advantages, targets = gae([1.0], [0.4], gamma=0.9, lam=lam)
        assert advantages == pytest.approx([0.6]) and targets == pytest.approx([1.0])


def test_gae_over_three_turns_discounts_and_bootstraps_from_the_next_value():
    # Episode reward 1 after the third call, gamma 0.9: credit's returns are 0.81, 0.9, 1; per-turn rewards 0, 0, 1.
    returns = [0.81, 0.9, 1.0]
    assert turn_rewards(returns, 0.9) == pytest.approx([0.0, 0.0, 1.0])
    # V = .5 .6 .7, lam .5: delta_2 = 1 - .7 = .3; delta_1 = .9 * .7 - .6 = .03; delta_0 = .9 * .6 - .5 = .04
    # A_2 = .3; A_1 = .03 + .45 * .3 = .165; A_0 = .04 + .45 * .165 = .11425; R = A + V
    advantages, targets = ppo_advantages(returns, [0.5, 0.6, 0.7], gamma=0.9, lam=0.5)
    assert advantages == pytest.approx([0.11425, 0.165, 0.3])
    assert targets == pytest.approx([0.61425, 0.765, 1.0])
    # lam = 1: A_t = G_t - V_t whatever the values (Monte Carlo with a baseline)
    advantages, targets = ppo_advantages(returns, [0.5, 0.6, 0.7], gamma=0.9, lam=1.0)
    assert advantages == pytest.approx([0.31, 0.3, 0.3]) and targets == pytest.approx(returns)


def test_gae_takes_the_intermediate_rewards_credit_placed_on_turns():
    # Rewards .5 after turn 0 (say a tool call that worked), -.2 after turn 1, 1 at the end; gamma 1: G = 1.3 .8 1
    returns = [1.3, 0.8, 1.0]
    assert turn_rewards(returns, 1.0) == pytest.approx([0.5, -0.2, 1.0])
    assert ppo_advantages(returns, [0.0] * 3, 1.0, 1.0)[0] == pytest.approx(returns)  # no critic yet: A = G
    # lam 0: one-step advantages r_t + V_{t+1} - V_t with V = .2 .1 .3: .5 + .1 - .2, -.2 + .3 - .1, 1 - .3
    advantages, targets = ppo_advantages(returns, [0.2, 0.1, 0.3], 1.0, 0.0)
    assert advantages == pytest.approx([0.4, 0.0, 0.7]) and targets == pytest.approx([0.6, 0.1, 1.0])
    with pytest.raises(ValueError, match="2 rewards but 1 values"):
        gae([1.0, 2.0], [0.0], 1.0, 1.0)


def test_the_value_loss_clips_around_the_old_values():
    values = torch.tensor([0.5, 0.0, 0.35], requires_grad=True)
    old, targets, weights = torch.tensor([0.2, 0.2, 0.3]), torch.tensor([1.0, 1.0, 0.0]), torch.tensor([.5, .25, .25])
    # b0: V .5 clipped to .3: max((.5 - 1)^2 = .25, (.3 - 1)^2 = .49) = .49, the clipped term: no gradient
    # b1: V 0 clipped to .1: max(1, .81) = 1; b2: V .35 within .3 +- .1: .1225
    loss, fraction = clipped_value_loss(values, old, targets, weights, clip=0.1)
    assert float(loss.detach()) == pytest.approx(0.5 * 0.49 + 0.25 * 1.0 + 0.25 * 0.1225)
    assert fraction == pytest.approx(1 / 3)
    loss.backward()
    assert values.grad.tolist() == pytest.approx([0.0, 0.25 * 2 * (0.0 - 1.0), 0.25 * 2 * 0.35])
    plain, none = clipped_value_loss(values, old, targets, weights, clip=0.0)
    assert float(plain.detach()) == pytest.approx(0.5 * 0.25 + 0.25 * 1.0 + 0.25 * 0.1225) and none == 0.0


def test_compile_gives_ppo_the_return_as_its_advantage_and_drops_no_group():
    frame = pl.DataFrame({"rollout_id": ["a", "b"], "task_id": ["t", "t"], "policy_version": [0, 0],
                          "reward": [1.0, 1.0], "return": [0.9, 1.0]})
    out, dropped = ADVANTAGES["ppo"](frame)
    assert out["advantage"].to_list() == [0.9, 1.0] and dropped == 0
    from lightning_otel.train.offline import offline_advantage

    assert offline_advantage(TrainConfig(advantage="ppo"), "grpo") == "ppo"  # offline PPO needs no groups either


def test_ppo_config_checks():
    assert TrainConfig(advantage="ppo").critic == "head"
    TrainConfig(advantage="ppo", critic="base", lam=0.95, value_clip=0.0)
    with pytest.raises(UserError, match="critic = 'base': only advantage = ppo trains a critic"):
        TrainConfig(critic="base")
    with pytest.raises(UserError, match="critic = '/no/such/model': not head, base or a model folder"):
        TrainConfig(advantage="ppo", critic="/no/such/model")
    with pytest.raises(UserError, match=r"lam = 1.5: GAE's lambda is in \[0, 1\]"):
        TrainConfig(advantage="ppo", lam=1.5)
    with pytest.raises(UserError, match="value_clip = -0.1"):
        TrainConfig(advantage="ppo", value_clip=-0.1)
    with pytest.raises(UserError, match="critic_lr = 0"):
        TrainConfig(advantage="ppo", critic_lr=0)
    with pytest.raises(UserError, match="kl_reward = 0.1: it is the KL penalty in the token rewards"):
        TrainConfig(advantage="ppo", kl_reward=0.1)


class ScriptedCritic:
    """Values by the prompt's last token: V = token / 10."""

    pad_id = 0

    def values(self, batch):
        return batch.input_ids[torch.arange(batch.input_ids.shape[0]), -1 - batch.completion_len].float() / 10


def row(rollout, turn, prompt, ret, completion=(1, 2)):
    return {"rollout_id": rollout, "turn": turn, "prompt_ids": list(prompt), "completion_ids": list(completion),
            "completion_logprobs": [-1.0] * len(completion), "loss_mask": None, "advantage": 0.0, "return": ret}


def test_the_pass_gives_each_transition_its_value_target_and_a_normalised_advantage():
    # Rollout a: two turns (given in reverse order), V = .5 then .2, gamma 1, lam 1: A = G - V = 1 - .5, 1 - .2.
    # Rollout b: one turn, V = .3, G = 0: A = -.3. Normalised over the three: mean 1/3, sample std.
    rows = [row("a", 1, [9, 2], 1.0), row("a", 0, [9, 5], 1.0), row("b", 0, [3], 0.0, completion=(4,))]
    config = TrainConfig(advantage="ppo", batch_size=2, micro_batch=1)
    stats = StepStats()
    out = with_critic_advantages(ScriptedCritic(), rows, config, stats)
    raw = [0.8, 0.5, -0.3]
    mean, std = sum(raw) / 3, math.sqrt(sum((x - sum(raw) / 3) ** 2 for x in raw) / 2)
    assert [r["value_old"] for r in out] == pytest.approx([0.2, 0.5, 0.3])
    assert [r["value_target"] for r in out] == pytest.approx([1.0, 1.0, 0.0])
    assert [r["advantage"] for r in out] == pytest.approx([(x - mean) / (std + EPS) for x in raw])
    assert stats.value_mean == pytest.approx(1 / 3)
    # 1 - Var(R - V) / Var(R): Var(.8, .5, -.3) = .97 / 3, Var(1, 1, 0) = 1 / 3
    assert stats.explained_variance == pytest.approx(1 - 0.97, abs=1e-6)
    assert "value_old" not in rows[0]  # the caller's rows are left as they were
    batch = collate(out, 0)
    assert batch.old_values.tolist() == pytest.approx([0.2, 0.5, 0.3])
    assert batch.value_targets.tolist() == pytest.approx([1.0, 1.0, 0.0]) and collate(rows, 0).value_targets is None
    # other advantages: untouched, no forward pass
    assert with_critic_advantages(None, rows, TrainConfig(advantage="reinforce-pp"), StepStats()) is rows


@pytest.fixture(scope="module")
def ppo_learner():
    from lightning_otel.train.learner import Learner

    config = TrainConfig(lora_rank=4, lr=1e-3, critic_lr=1e-2, batch_size=4, micro_batch=2, advantage="ppo")
    learner = Learner(bundled_model_dir(), config)
    yield learner, config
    learner.close()


def rollout_rows(learner):
    encode = learner.tokenizer.encode
    answer = encode("SELECT count(*) FROM singer")
    return [row("good", 0, encode("Count the singers."), 1.0, answer[:5]),
            row("good", 1, encode("Count the singers. Now the concerts."), 1.0, answer[:6]),
            row("bad", 0, encode("How many stadiums are there?"), 0.0, answer[:4]),
            row("bad", 1, encode("How many stadiums are there? And the concerts?"), 0.0, answer[:3])]


def snapshot(parameters) -> list[torch.Tensor]:
    return [p.detach().clone() for p in parameters]


def changed(before, parameters) -> bool:
    return any(not torch.equal(b, p.detach()) for b, p in zip(before, parameters))


@pytest.mark.heavy
def test_a_ppo_step_moves_the_policy_adapter_and_the_critic_and_nothing_else(ppo_learner):
    learner, config = ppo_learner
    module = learner.module
    lora = [p for p in module.parameters() if p.requires_grad]
    base = [p for p in module.parameters() if not p.requires_grad]
    head = learner.critic.parameters()
    rows = rollout_rows(learner)
    # The gradients' paths, from one forward pass: values reach the head only, log-probs the adapter only.
    prepared = with_critic_advantages(learner, rows, config, StepStats())
    scores, values = learner.scores_and_values(collate(prepared, learner.pad_id), config.temperature)
    logp = scores.logp
    assert all(g is None for g in torch.autograd.grad(values.sum(), lora, retain_graph=True, allow_unused=True))
    assert all(g is None for g in torch.autograd.grad(logp.sum(), head, retain_graph=True, allow_unused=True))
    assert all(g is not None for g in torch.autograd.grad(values.sum(), head, retain_graph=True))
    del scores, logp, values
    before_lora, before_base, before_head = snapshot(lora), snapshot(base), snapshot(head)
    stats = optimize(learner, rows, config, "grpo", seed=0)
    assert stats.steps == 1 and math.isfinite(stats.loss[0]) and stats.value_loss[0] == pytest.approx(0.5)
    assert stats.value_mean == 0.0  # a fresh head: V = 0, so the value loss is the mean of R^2 = (1 + 1) / 4
    assert changed(before_lora, lora) and changed(before_head, head) and not changed(before_base, base)
    # After the step the critic's values are nearer their targets (R = 1 1 0 0, equal weights) than V = 0 was.
    after = learner.values(collate(rows, learner.pad_id))
    assert float(((after - torch.tensor([1.0, 1.0, 0.0, 0.0])) ** 2).mean()) < 0.5


@pytest.mark.heavy
def test_the_critic_is_saved_and_loaded_with_the_learners_state(ppo_learner, tmp_path):
    from lightning_otel.train.learner import Learner

    learner, config = ppo_learner
    rows = rollout_rows(learner)
    optimize(learner, rows, config, "grpo", seed=1)  # the head has weights and Adam moments
    learner.save_state(tmp_path / "state")
    assert (tmp_path / "state" / "critic").is_dir()
    saved_head = snapshot(learner.critic.parameters())
    saved_moments = {k: v.clone() for k, v in learner.critic.optimizer.state[learner.critic.head.linear.weight].items()}
    resumed = Learner(bundled_model_dir(), config)
    try:
        assert not any(float(p.abs().sum()) for p in resumed.critic.parameters())  # a fresh critic: zeros
        resumed.load_state(tmp_path / "state")
        assert not changed(saved_head, resumed.critic.parameters())
        moments = resumed.critic.optimizer.state[resumed.critic.head.linear.weight]
        assert set(moments) == set(saved_moments)
        assert all(torch.equal(moments[k], saved_moments[k]) for k in saved_moments)
        batch = collate(rows, learner.pad_id)
        assert torch.allclose(resumed.values(batch), learner.values(batch))
    finally:
        resumed.close()


@pytest.mark.heavy  # two models, two DeepSpeed engines
def test_a_separate_critic_model_trains_its_own_adapter_and_head_and_resumes(tmp_path):
    """critic = base: the base model again, with its own LoRA adapter and head in its own DeepSpeed engine."""
    from lightning_otel.train.learner import Learner

    config = TrainConfig(lora_rank=4, lr=1e-3, critic_lr=1e-3, batch_size=4, micro_batch=4, advantage="ppo",
                         critic="base")
    learner = Learner(bundled_model_dir(), config)
    try:
        critic = learner.critic.engine.module
        assert critic.lm is not learner.module.base_model.model  # its own copy of the weights
        trained = [p for p in critic.parameters() if p.requires_grad]
        frozen = [p for p in critic.parameters() if not p.requires_grad]
        policy = [p for p in learner.module.parameters() if p.requires_grad]
        assert {id(p) for p in trained} == {id(p) for p in learner.critic.parameters()}
        assert any(p is critic.head.linear.weight for p in trained) and len(trained) > 2  # head and adapter
        rows = rollout_rows(learner)
        before = snapshot(trained), snapshot(frozen), snapshot(policy)
        stats = optimize(learner, rows, config, "grpo", seed=0)
        assert stats.steps == 1 and stats.value_loss[0] == pytest.approx(0.5)  # V = 0: (1 + 1) / 4
        assert changed(before[0], trained) and not changed(before[1], frozen) and changed(before[2], policy)
        # A LoRA adapter starts with B = 0: the head's first step moves V; the adapter's A matrices moved too.
        learner.save_state(tmp_path / "state")
        saved = snapshot(trained)
        optimize(learner, rows, config, "grpo", seed=1)
        assert changed(saved, trained)
        learner.load_state(tmp_path / "state")
        assert not changed(saved, trained)
    finally:
        learner.close()
