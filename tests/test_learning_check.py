"""The learning-loop check in small form (benchmarks/learning_check.py): on a fixed pool of Spider questions,
GRPO from the bundled model raises the continuous reward it is trained on, and the control trained on the
inverted reward lowers it; every round is served the checkpoint of the round before, and the first
micro-batch of every round finds the learner agreeing with the engine that sampled (ratio ~1).

Real parts throughout: the shared vLLM engine on the bundled SmolLM2-135M, the gateway, the plain-OpenAI
example agent, the collector and DuckDB store, DeepSpeed with LoRA."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lightning_otel.span_store import client

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import learning_check  # noqa: E402


def test_rise_and_served_versions_read_the_curve():
    points = [{"round": 1, "reward_mean": 0.2, "served_policy_versions": [0]},
              {"round": 2, "reward_mean": 0.3, "served_policy_versions": [1]},
              {"round": 3, "reward_mean": 0.5, "served_policy_versions": [2]},
              {"round": 4, "reward_mean": 0.4, "served_policy_versions": [3]}]
    assert learning_check.rise(points) == pytest.approx(0.25)
    assert learning_check.rise(points[:2]) is None  # too short to tell
    assert learning_check.rise(points, start=0.3) == pytest.approx(0.15)
    control = [{**p, "reward_mean": m} for p, m in zip(points, (0.4, 0.3, 0.2, 0.1))]
    # both first rounds sample the base policy: the start is their mean
    assert learning_check.start_level({"reward": points, "inverted": control}) == pytest.approx(0.3)
    assert learning_check.start_level({"reward": points[1:]}) is None  # no round 1: no start
    assert learning_check.served_each_round(points)
    stale = [*points[:3], {**points[3], "served_policy_versions": [2, 3]}]  # part of round 4 on the old policy
    assert not learning_check.served_each_round(stale)


def test_the_reward_is_continuous_and_the_control_its_mirror():
    task = {"db_id": "singer", "query": "SELECT count(*) FROM singer"}
    short = learning_check.reward(task, {"final_output": "SELECT count(*) FROM singer"})
    wordy = learning_check.reward(task, {"final_output": "I think the answer is SELECT count(*) FROM singer ok"})
    prose = learning_check.reward(task, {"final_output": "There are six singers in the database I think."})
    assert 1.0 > short > 0.5 > prose > 0 and short > wordy
    assert learning_check.inverted(task, {"final_output": "SELECT count(*) FROM singer"}) == pytest.approx(1 - short)


@pytest.mark.heavy
def test_grpo_raises_the_reward_it_is_given_and_the_inverted_control_lowers_it(engine, tmp_path):
    # The benchmark's defaults (its one-call SQL agent, lr 1e-3, 2 epochs a round, temperature 0.7), smaller: 5
    # rounds of 16 rollouts. One round's mean of 16 rewards moves by 0.05-0.1 by chance, so the directions are
    # read from the start level (both runs' first rounds: the base policy, 32 rewards) to each run's last two
    # rounds, and the gap between the two runs (the effect of both, twice either) must be at least 0.1.
    rounds = 5
    args = learning_check.parse(["--out", str(tmp_path), "--rounds", str(rounds), "--pool", "4", "--val", "0",
                                 "-n", "4", "--min-rise", "0"])
    result = learning_check.check(args, engine)
    assert engine.policy_version == 0 and engine.model_name == engine.base_name  # the shared engine, as found
    detail = json.dumps(result["curves"], indent=1)
    assert result["checks"] == {"reward run rises": True, "control falls": True,
                                "new policy served every round": True}, detail
    last_two = {arm: sum(p["reward_mean"] for p in points[-2:]) / 2 for arm, points in result["curves"].items()}
    assert last_two["reward"] - last_two["inverted"] >= 0.1, detail
    for points in result["curves"].values():
        assert [p["round"] for p in points] == list(range(1, rounds + 1))
        # Before each round's first update the learner is the policy that sampled. (A round whose groups all
        # scored alike trains nothing and has no first micro-batch: the policy may converge within 5 rounds.)
        trained = [p for p in points if p["first_ratio_mean"] is not None]
        assert len(trained) >= 3, detail
        for p in trained:
            assert abs(p["first_ratio_mean"] - 1.0) < 0.05 and p["first_clip_fraction"] < 0.05, detail
    for arm in result["curves"]:  # the agent function ran in one worker process (one SDK) for the whole run
        sdks = client.query("SELECT count(DISTINCT json_extract_string(resource, '$.\"service.instance.id\"')) AS n, "
                            "count(*) AS calls FROM spans WHERE name = 'openai.chat'", tmp_path / arm / "traces.duckdb")
        assert sdks["n"][0] == 1 and sdks["calls"][0] == rounds * 4 * 4  # rounds x pool x samples, one call each
