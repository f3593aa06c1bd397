"""Task packs: rewards registered by packs, a pack chosen by its reward or by name, per-rollout setup, outcome
classes; no task default in the generic layers."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lightning_otel.errors import UserError
from lightning_otel.rollouts import packs
from lightning_otel.rollouts.packs import TaskPack, load_pack, pack_for_reward, registered_rewards
from lightning_otel.rollouts.runner import RolloutConfig, check_inputs, load_tasks
from lightning_otel.tasks.math import PACK as MATH
from lightning_otel.tasks.spider import PACK as SPIDER

AGENT = f"{sys.executable} -c pass {{question}} {{db_path}}"


def spider_task_file(tmp_path: Path, **extra) -> Path:
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"id": "t1", "question": "How many singers?", "db_id": "singer",
                                "query": "SELECT count(*) FROM singer", **extra}) + "\n")
    return path


def test_bundled_packs_register_their_rewards():
    registered = registered_rewards()
    assert registered["spider_exec"] is SPIDER and registered["spider_shaped"] is SPIDER
    assert registered["number_match"] is MATH
    assert load_pack("spider") is SPIDER and load_pack("math") is MATH
    assert load_pack("lightning_otel.tasks.math:PACK") is MATH


def test_a_run_takes_the_pack_of_its_reward_or_the_one_named():
    assert pack_for_reward("spider_exec") is SPIDER
    assert pack_for_reward("number_match") is MATH
    assert pack_for_reward("my_module:reward") is None  # module:function rewards need no pack
    assert pack_for_reward(None) is None
    assert pack_for_reward("my_module:reward", "spider") is SPIDER
    with pytest.raises(UserError, match="task pack 'math' has no reward 'spider_exec'"):
        pack_for_reward("spider_exec", "math")


@pytest.mark.parametrize("spec, needle", [("nope", "unknown task pack 'nope'"),
                                          ("no_such_module:PACK", "cannot import task pack module"),
                                          ("lightning_otel.tasks.math:number_match", "not a lightning_otel")])
def test_a_bad_pack_name_says_what_to_give(spec, needle):
    with pytest.raises(UserError, match=needle):
        load_pack(spec)


def test_a_pack_must_be_complete():
    with pytest.raises(ValueError, match="registers no reward"):
        TaskPack(name="empty", rewards={})
    with pytest.raises(ValueError, match="not a field name"):
        TaskPack(name="x", rewards={"r": MATH.rewards["number_match"]}, group_field="a'; DROP TABLE spans; --")
    with pytest.raises(ValueError, match="needs outcome_classes"):
        TaskPack(name="x", rewards={"r": MATH.rewards["number_match"]}, classify=lambda row, data: "wrong")


def test_an_unknown_class_from_a_classifier_is_an_error():
    pack = TaskPack(name="odd", rewards={"r": MATH.rewards["number_match"]}, classify=lambda row, data: "weird",
                    outcome_classes={"bad": "a bad answer"})
    with pytest.raises(UserError, match="classified a rollout as 'weird'"):
        pack.outcome({"reward": 0.0, "status": "ok"}, None)
    assert pack.outcome({"reward": None, "status": "ok"}, None) == "unscored"


def test_db_path_comes_from_the_spider_pack_not_from_the_runner(tmp_path):
    tasks_file = spider_task_file(tmp_path)
    tasks = load_tasks(tasks_file)
    with pytest.raises(UserError, match=r"\{db_path\} is given by the 'spider' task pack: choose it with "
                                        r"--task-pack spider"):
        check_inputs(RolloutConfig(tasks=tasks_file, agent=AGENT, base_url="http://127.0.0.1:9/v1"), tasks)
    for config in (RolloutConfig(tasks=tasks_file, agent=AGENT, base_url="http://127.0.0.1:9/v1",
                                 reward="spider_exec"),
                   RolloutConfig(tasks=tasks_file, agent=AGENT, base_url="http://127.0.0.1:9/v1",
                                 reward="tests.helpers.train_rewards:concise_sql", task_pack="spider")):
        assert config.pack is SPIDER and config.data_dir == SPIDER.default_data_dir()
        check_inputs(config, tasks)
    missing = spider_task_file(tmp_path, db_id="no_such_db")
    with pytest.raises(UserError, match="no_such_db.sqlite does not exist"):
        check_inputs(RolloutConfig(tasks=missing, agent=AGENT, reward="spider_exec"), load_tasks(missing))


def test_the_spider_setup_gives_each_rollout_its_own_database(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir(), second.mkdir()
    task = {"db_id": "singer"}
    a, b = SPIDER.setup(task, first, None)["db_path"], SPIDER.setup(task, second, None)["db_path"]
    assert a != b and Path(a).read_bytes() == Path(b).read_bytes()
    assert SPIDER.setup({"question": "no database"}, first, None) == {}


def test_installed_packs_are_found_by_entry_point(monkeypatch):
    monkeypatch.setattr(packs, "_entry_points", lambda: {"gold": "tests.helpers.train_rewards:GOLD_PACK"})
    assert "gold" in packs.pack_names()
    assert registered_rewards()["gold_only"].name == "gold"
    assert pack_for_reward("gold_only").name == "gold"


def test_no_reward_no_default(tmp_path):
    from lightning_otel.eval import EvalConfig
    from lightning_otel.train.config import TrainConfig
    from lightning_otel.train.trainer import Trainer

    tasks = spider_task_file(tmp_path)
    with pytest.raises(UserError, match="reward is not set"):
        EvalConfig(tasks=tasks, agent=AGENT, report=tmp_path / "r")
    assert TrainConfig().reward == ""
    with pytest.raises(UserError, match="`reward` is not set"):
        Trainer(TrainConfig(tasks=str(tasks), agent=AGENT, output_dir=str(tmp_path / "run")))


def test_a_pack_given_as_module_attribute_brings_its_own_reward_names(tmp_path):
    from lightning_otel.rollouts.rewards import resolve_reward
    from tests.helpers.train_rewards import GOLD_PACK, gold_only

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "t", "gold": 0.5}) + "\n")
    config = RolloutConfig(tasks=tasks, agent=f"{sys.executable} -c pass", reward="gold_only",
                           task_pack="tests.helpers.train_rewards:GOLD_PACK", base_url="http://127.0.0.1:9/v1")
    assert config.pack is GOLD_PACK and resolve_reward("gold_only", config.pack) is gold_only
    with pytest.raises(UserError, match="unknown reward 'gold_only'"):
        resolve_reward("gold_only")  # no pack registers it by name


def test_rollout_serves_its_model_as_a_policy_spec_like_eval(tmp_path, monkeypatch):
    # `rollout --model` takes what eval and serve take (base, a run folder, a checkpoint, an adapter, a model
    # folder): the runner resolves it with the same resolve_policy and starts its engine through engine_for_policy.
    from contextlib import ExitStack
    from types import SimpleNamespace

    from lightning_otel.rollouts import runner
    from lightning_otel.serve import serving

    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    seen = {}

    def started(policy, engine, owned, python=None, log_path=None):
        seen.update(policy=policy, engine=engine)
        raise RuntimeError("stop before vLLM")

    monkeypatch.setattr(serving, "engine_for_policy", started)
    config = RolloutConfig(tasks=spider_task_file(tmp_path), agent=AGENT, reward="spider_exec", model=str(model))
    with ExitStack() as owned, pytest.raises(RuntimeError, match="stop before vLLM"):
        # The collector is never reached: the engine start stops the run first.
        collector = SimpleNamespace(url="http://127.0.0.1:9/v1/traces", ingest_token=None)
        runner.start_gateway(config, collector, None, owned)
    assert seen["engine"] is None and seen["policy"].base_model == model.resolve()
    assert seen["policy"].adapter is None and seen["policy"].label == "my-model"
