"""REINFORCE++ in the trainer (`advantage = "reinforce-pp"`): the configuration, the pass that gives every
transition its token advantages before the steps (train/optimize.py), and one real update step on the bundled
SmolLM2-135M with LoRA under DeepSpeed, where the KL penalty alone moves a group whose rewards agree."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from lightning_otel.errors import UserError
from lightning_otel.serve.model import bundled_model_dir
from lightning_otel.train.batch import collate
from lightning_otel.train.config import TrainConfig
from lightning_otel.train.transitions.credit import EPS
from lightning_otel.train.optimize import StepStats, optimize, with_token_advantages


def test_the_kl_is_a_loss_term_or_a_reward_penalty_and_the_config_says_which():
    assert TrainConfig(advantage="reinforce-pp", kl_reward=0.05).kl_loss == 0.0  # no k3 term in the loss
    assert TrainConfig(kl_loss=0.05).kl_reward == 0.0
    assert TrainConfig(advantage="reinforce-pp").kl_reward == 0.0  # plain REINFORCE with a global baseline
    with pytest.raises(UserError, match="kl_reward = 0.05: it is the KL penalty in the token rewards"):
        TrainConfig(kl_reward=0.05)  # per-rollout: meaningless
    with pytest.raises(UserError, match="set kl_reward instead"):
        TrainConfig(advantage="reinforce-pp", kl_loss=0.05)
    with pytest.raises(UserError, match=r"advantage = 'reinforce\+\+': choose one of .*reinforce-pp"):
        TrainConfig(advantage="reinforce++")


def test_the_previous_releases_keys_still_work_with_a_deprecation_message(caplog, tmp_path):
    from lightning_otel.train.config import load_config, migrate_saved, render_toml

    old = TrainConfig(advantage="reinforce_pp", kl=0.05, agent_timeout_s=60.0)
    assert (old.advantage, old.kl_reward, old.kl_loss, old.rollout_timeout_s) == ("reinforce-pp", 0.05, 0.0, 60.0)
    assert old.kl is None and old.agent_timeout_s is None  # mapped, so a saved config has the new keys only
    assert TrainConfig(kl=0.1).kl_loss == 0.1
    assert "`kl` is deprecated" in caplog.text and "`agent_timeout_s` is deprecated" in caplog.text
    assert "'reinforce_pp' is spelled 'reinforce-pp'" in caplog.text
    toml = tmp_path / "train.toml"
    toml.write_text('advantage = "reinforce_pp"\nkl = 0.05\nagent_timeout_s = 60\n')
    loaded = load_config(toml, ["kl=0.07"])
    assert (loaded.kl_reward, loaded.rollout_timeout_s) == (0.07, 60.0)
    assert "kl =" not in render_toml(loaded) and "kl_reward = 0.07" in render_toml(loaded)
    assert migrate_saved({"advantage": "reinforce_pp", "kl": 0.05, "agent_timeout_s": 60.0, "lr": 1e-5}) == \
        {"advantage": "reinforce-pp", "kl_reward": 0.05, "rollout_timeout_s": 60.0, "lr": 1e-5}


class ScriptedLearner:
    """Log-probabilities as a function of the target token: the reference gives -id / 10, the policy 0.2 more."""

    pad_id = 0

    def reference_logprobs(self, batch, temperature=1.0):
        return -batch.targets.float() / 10

    def logprobs(self, batch, temperature=1.0):
        return -batch.targets.float() / 10 + 0.2


def row(rollout, completion, logprobs, ret):
    return {"rollout_id": rollout, "prompt_ids": [7, 8, 9], "completion_ids": completion,
            "completion_logprobs": logprobs, "loss_mask": None, "advantage": 0.0, "return": ret}


def test_token_advantages_are_normalised_over_the_whole_pass_not_per_micro_batch():
    # beta 0.5. r0: KL = old - ref = -0.5 + 0.1, -0.5 + 0.2 = -0.4, -0.3: r = 0.2, 0.15 + R 1: G = 1.35, 1.15.
    # r1, re-tokenised (no logprobs): old is the policy's, -0.1, KL 0.2, r = -0.1 + R 0: G = -0.1.
    # r2: old = ref: G = R = 0.5 on each token. Tokens 1.35 1.15 -0.1 .5 .5 .5: mean 0.65, squared deviations
    # .49 .25 .5625 .0225 x3 summing to 1.37, sample variance 1.37 / 5. One transition per micro-batch.
    rows = [row("r0", [1, 2], [-0.5, -0.5], 1.0), row("r1", [3], None, 0.0), row("r2", [2, 2, 2], [-0.2] * 3, 0.5)]
    config = TrainConfig(advantage="reinforce-pp", kl_reward=0.5, batch_size=1, micro_batch=1)
    stats = StepStats()
    out = with_token_advantages(ScriptedLearner(), rows, config, stats)
    std = math.sqrt(1.37 / 5) + EPS
    assert [r["token_advantages"] for r in out] == [pytest.approx([0.7 / std, 0.5 / std]),
                                                    pytest.approx([-0.75 / std]), pytest.approx([-0.15 / std] * 3)]
    assert stats.reward_kl == pytest.approx((-0.4 - 0.3 + 0.2) / 6)
    assert "token_advantages" not in rows[0]  # the caller's rows are left as they were
    batch = collate(out, 0)
    assert batch.advantages.shape == (3, 3)
    assert batch.advantages[0, 1:].tolist() == pytest.approx([0.7 / std, 0.5 / std])


def test_without_kl_no_forward_pass_runs_and_other_advantages_leave_the_rows_alone():
    class Unused:
        pad_id = 0

        def __getattr__(self, name):
            raise AssertionError(f"learner.{name} called")

    rows = [row("a", [1, 2], [-0.5, -0.5], 1.0), row("b", [3], None, 0.0)]
    out = with_token_advantages(Unused(), rows, TrainConfig(advantage="reinforce-pp"), StepStats())
    # tokens 1 1 0: mean 2/3, sample std sqrt((2/9 + 4/9) / 2) = sqrt(1/3)
    std = math.sqrt(1 / 3) + EPS
    assert [r["token_advantages"] for r in out] == [pytest.approx([1 / 3 / std] * 2), pytest.approx([-2 / 3 / std])]
    assert with_token_advantages(Unused(), rows, TrainConfig(kl=0.5), StepStats()) is rows


@pytest.mark.heavy
def test_a_reinforce_pp_step_with_kl_moves_the_policy_of_a_group_whose_rewards_agree():
    from lightning_otel.train.learner import Learner

    with_kl = TrainConfig(lora_rank=4, lr=1e-3, batch_size=2, micro_batch=2, advantage="reinforce-pp", kl_reward=0.5)
    learner = Learner(bundled_model_dir(), with_kl)
    try:
        prompt = learner.tokenizer.encode("Write a query that counts the singers.")
        answer = learner.tokenizer.encode("SELECT count(*) FROM singer")
        # both rewarded 1, sampled (say) at logprob -1 per token: only the KL to the reference tells them apart
        rows = [row(f"ro-{i}", answer[:4 + i], [-1.0] * (4 + i), 1.0) | {"prompt_ids": prompt} for i in range(2)]

        def weights() -> torch.Tensor:
            return torch.cat([p.detach().flatten().clone() for p in learner.module.parameters() if p.requires_grad])

        before = weights()
        flat = optimize(learner, rows, replace(with_kl, kl=0.0), "grpo", seed=0)
        assert flat.steps == 1 and torch.equal(weights(), before)  # no KL, equal returns: every advantage is 0
        stats = optimize(learner, rows, with_kl, "grpo", seed=0)
        assert stats.steps == 1 and math.isfinite(stats.loss[0]) and stats.kl == [0.0]  # no k3 term in the loss
        assert stats.reward_kl is not None and math.isfinite(stats.reward_kl) and stats.reward_kl != 0
        assert float((weights() - before).abs().max()) > 0
    finally:
        learner.close()


def test_compile_and_offline_training_take_reinforce_pp(tmp_path):
    """`lightning-otel compile --advantage reinforce-pp` on rollouts recorded through the gateway: one baseline
    over every completion token of the store, groups whose rewards agree kept. Offline GRPO uses it when the
    config names it (else its batch baseline)."""
    import polars as pl

    from lightning_otel.cli import main
    from lightning_otel.train.offline import offline_advantage
    from test_retokenize import load_rollouts

    db, out = tmp_path / "traces.duckdb", tmp_path / "t.parquet"
    load_rollouts(db)
    assert main(["compile", "--db", str(db), "--out", str(out), "--reward", "sql_form",
                 "--advantage", "reinforce-pp"]) == 0
    frame = pl.read_parquet(out).with_columns(pl.col("completion_ids").list.len().alias("n"))
    weighted_mean = float((frame["advantage"] * frame["n"]).sum() / frame["n"].sum())
    assert abs(weighted_mean) < 1e-6 and frame["advantage"].std() > 0.5
    assert frame["rollout_id"].n_unique() == 48  # no group left out, not even one whose rewards agree
    with pytest.raises(SystemExit) as info:  # not one of the choices
        main(["compile", "--db", str(db), "--out", str(out), "--advantage", "bogus"])
    assert info.value.code == 2

    assert offline_advantage(TrainConfig(advantage="reinforce-pp"), "grpo") == "reinforce-pp"
    assert offline_advantage(TrainConfig(), "grpo") == "batch-baseline"
    assert offline_advantage(TrainConfig(advantage="reinforce-pp"), "sft") == "none"
    with pytest.raises(UserError, match="--objective"):
        offline_advantage(TrainConfig(), "dpo")
