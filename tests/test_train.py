"""The trainer end to end on CPU: the bundled SmolLM2-135M under DeepSpeed, the real vLLM engine (shared
session fixture), rollouts stored in a real DuckDB store through a real collector. The agents run in the worker
process under opentelemetry-instrument: mostly a one-call agent (tests/helpers/inprocess_agents.py) on tasks whose
reward is fixed by their kind (tests/helpers/train_rewards.py), so every group varies and the gradient cannot be
zero. The real plain-OpenAI example agent (three calls with prompts of ~700 tokens: minutes of training on 2
cores) runs as a command in the warm-start kill test; it trains as an agent function in the demo's test."""
from __future__ import annotations

import gc
import json
import math
import os
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

import polars as pl
import pytest
import torch

from lightning_otel.errors import UserError
from lightning_otel.span_store import client
from lightning_otel.rollouts.runner import load_tasks
from lightning_otel.train.config import TrainConfig, load_config
from lightning_otel.train.pool import round_tasks
from lightning_otel.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("plain_sdk_agents")  # its agents use the plain OpenAI SDK (conftest.py)

REPO = Path(__file__).resolve().parent.parent
SPIDER = REPO / "lightning_otel" / "tasks" / "spider" / "data"
BIN = Path(sys.executable).parent
ONE_CALL = f"{REPO / 'tests' / 'helpers' / 'inprocess_agents.py'}:one_call"  # one short model call per rollout
# The example as an agent function: its rollouts run in one worker process under opentelemetry-instrument (an
# agent process start costs seconds here); the warm-start kill test runs it as a command, one process a rollout.
AGENT = f"{REPO / 'examples' / 'openai_sql' / 'agent.py'}:run"
AGENT_COMMAND = (f"{BIN / 'opentelemetry-instrument'} {BIN / 'python'} {REPO / 'examples' / 'openai_sql' / 'agent.py'} "
                 "--question {question} --db {db_path}")
REWARD = "tests.helpers.train_rewards:concise_sql"
BY_KIND = "tests.helpers.train_rewards:by_kind"  # a reward fixed by each task's kind (kind_tasks)


def spider_tasks(path: Path, count: int, db_id: str = "poker_player", **fields) -> Path:
    """The first `count` bundled dev questions on `db_id`, with `fields` added to each."""
    rows = [json.loads(line) for line in (SPIDER / "dev.jsonl").read_text().splitlines()]
    rows = [{**r, **fields} for r in rows if r["db_id"] == db_id][:count]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def small_config(tmp_path: Path, **overrides) -> TrainConfig:
    values = dict(tasks=str(spider_tasks(tmp_path / "tasks.jsonl", 4)), agent=AGENT, reward=REWARD, n=4,
                  task_pack="spider", tasks_per_round=4, rounds=1, batch_size=8, micro_batch=4, max_tokens=32, lr=1e-4,
                  lora_rank=8, output_dir=str(tmp_path / "run"), concurrency=8, rollout_timeout_s=300)
    values.update(overrides)
    return TrainConfig(**values)


# ---- configuration -------------------------------------------------------------------------------------


def test_config_layers_defaults_file_and_key_values(tmp_path):
    path = tmp_path / "train.toml"
    path.write_text('rounds = 3\nlr = 2e-5\nagents = "writer"\n')
    config = load_config(path, ["rounds=5", "full_finetune=true"])
    assert (config.rounds, config.lr, config.agents, config.full_finetune) == (5, 2e-5, "writer", True)
    config.save(tmp_path / "saved.toml")
    assert load_config(tmp_path / "saved.toml") == config


@pytest.mark.parametrize("args, message", [
    (["nope=1"], "unknown key(s) nope"),
    (["rounds"], "overrides are key=value"),
    (["n=two"], "n = 'two' is not a valid int"),
    (["clip=1.5"], "clip range must be in (0, 1)"),
    (["aggregation=mean"], "choose one of ['rollout', 'sequence', 'token']"),
    (["micro_batch=8", "batch_size=4"], "batch_size >= micro_batch"),
    (["bf16=maybe"], "is not true/false"),
    (["bf16=true", "autocast=true"], "set one of them"),
    (["micro_batch_tokens=-1"], "micro_batch_tokens >= 0"),
    (["sft_save_tasks=0"], "sft_save_tasks must be >= 1"),
    (["share_prefix=-2"], "share_prefix >= 0"),
    (["temperature=0"], "rollouts must sample"),
    (['sft_label=["{query}", 3]'], "a non-empty list of texts"),
    (["sft_label=[nope"], "is not a JSON list of texts"),
    (["sft_untrained=0"], "leave at least one call trained"),
    (['sft_label=["{query}", "OK"]', "sft_untrained=[0, 2]"], "give call positions of sft_label"),
    (["sft_untrained=first"], "is not a list of whole numbers"),
    (["pool_min_pass=0.9", "pool_max_pass=0.5"], "need 0 <= pool_min_pass <= pool_max_pass <= 1"),
    (["pool_max_pass=1.5"], "need 0 <= pool_min_pass <= pool_max_pass <= 1"),
    (["gpu_memory_utilization=1.2"], "share of GPU memory is between 0 and 1"),
    (["engine_args=--a 'b"], "engine_args = \"--a 'b\": No closing quotation"),
])
def test_bad_config_is_refused_with_what_to_do(args, message):
    with pytest.raises(UserError, match=None) as info:
        load_config(None, args)
    assert message in str(info.value)


def test_the_gpu_knobs_reach_the_engine_command(tmp_path):
    from lightning_otel.serve.model import bundled_model_dir
    from lightning_otel.train.trainer import engine_config

    config = load_config(None, ["gpu_memory_utilization=0.35", "sleep_mode=true",
                                "engine_args=--enforce-eager --swap-space '4'", "lora_rank=32", "max_length=4096"])
    assert config.engine_args == ["--enforce-eager", "--swap-space", "4"]
    config.save(tmp_path / "saved.toml")
    assert load_config(tmp_path / "saved.toml") == config
    assert load_config(None, ['engine_args=["--seed", "1"]']).engine_args == ["--seed", "1"]
    engine = engine_config(config, bundled_model_dir())
    assert (engine.gpu_memory_utilization, engine.sleep_mode, engine.max_lora_rank, engine.max_model_len) == (
        0.35, True, 32, 4096)
    from lightning_otel.serve.engine import VLLMEngine

    command = VLLMEngine(engine).command()
    assert command[command.index("--gpu-memory-utilization") + 1] == "0.35" and "--enable-sleep-mode" in command
    assert command[-3:] == ["--enforce-eager", "--swap-space", "4"]
    plain = VLLMEngine(engine_config(load_config(None, []), bundled_model_dir())).command()
    assert "--gpu-memory-utilization" not in plain and "--enable-sleep-mode" not in plain


def test_an_sft_label_per_agent_call_survives_key_values_and_the_saved_toml(tmp_path):
    config = load_config(None, ['sft_label=["```sql\\n{query}\\n```", "THE QUERY IS CORRECT"]',
                                'agents=say "hi"\nthere', "sft_untrained=1"])
    assert config.sft_label == ["```sql\n{query}\n```", "THE QUERY IS CORRECT"] and config.sft_untrained == [1]
    config.save(tmp_path / "saved.toml")  # newlines and quotes in strings stay valid TOML
    assert load_config(tmp_path / "saved.toml") == config
    assert load_config(None, ["sft_label={query}"]).sft_label == "{query}"


def test_round_tasks_cover_every_task_once_per_epoch_and_depend_only_on_seed_and_round(tmp_path):
    tasks = load_tasks(spider_tasks(tmp_path / "t.jsonl", 6))
    epoch = [t.task_id for r in range(3) for t in round_tasks(tasks, r, 2, seed=7)]
    assert sorted(epoch) == sorted(t.task_id for t in tasks)
    assert [t.task_id for t in round_tasks(tasks, 1, 2, seed=7)] == epoch[2:4]
    assert epoch != [t.task_id for r in range(3) for t in round_tasks(tasks, r, 2, seed=8)]
    # More tasks asked than there are (a pool filter kept few): each round is the whole list once, reshuffled.
    rounds = [[t.task_id for t in round_tasks(tasks, r, 16, seed=7)] for r in range(3)]
    assert all(sorted(ids) == sorted(t.task_id for t in tasks) for ids in rounds) and rounds[0] != rounds[1]


@pytest.mark.parametrize("size, count", [(5, 2), (22, 16), (7, 4)])
def test_a_round_that_runs_into_the_next_epoch_holds_no_task_twice(tmp_path, size, count):
    # 22 tasks (a pool filter's keep) in rounds of 16: round 2 is the first epoch's last 6 and 10 of the next
    # shuffle, which may hold some of those 6 again; they are put off to the next round instead.
    tasks = load_tasks(spider_tasks(tmp_path / "t.jsonl", size, "world_1"))
    assert len(tasks) == size
    used = {t.task_id: 0 for t in tasks}
    for r in range(3 * size):
        ids = [t.task_id for t in round_tasks(tasks, r, count, seed=5)]
        assert len(ids) == count and len(set(ids)) == count, f"round {r}: {ids}"
        for task_id in ids:
            used[task_id] += 1
        assert max(used.values()) - min(used.values()) <= 1  # every task once an epoch, give or take the put-off
    assert set(used.values()) == {3 * count}  # 3 x size rounds of count: every task 3 x count times


def test_a_run_folder_with_other_settings_is_not_resumed(tmp_path):
    config = small_config(tmp_path)
    Path(config.output_dir).mkdir()
    (Path(config.output_dir) / "run.json").write_text(json.dumps(
        {"model": "bundled", "rounds_completed": 1, "config": {**small_config(tmp_path).__dict__, "lr": 0.5}}))
    with pytest.raises(UserError, match=r"different settings \(lr\)"):
        Trainer(config)


def test_sft_labels_that_do_not_fit_the_labelled_tasks_fail_before_the_engine_starts(tmp_path):
    sft_tasks = str(spider_tasks(tmp_path / "sft.jsonl", 2, "singer"))
    with pytest.raises(UserError, match=r"sft_label '\{gold\}' needs field 'gold' which task .* does not have"):
        Trainer(small_config(tmp_path, sft_tasks=sft_tasks, sft_label=["{query}", "{gold}"]))
    with pytest.raises(UserError, match=r"sft_label 'SELECT \{' is not a str.format template"):
        Trainer(small_config(tmp_path, sft_tasks=sft_tasks, sft_label="SELECT {"))
    assert not (tmp_path / "run").exists()


# ---- one real round ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(engine, tmp_path_factory):
    """SFT warm start on 2 labelled tasks, then one GRPO round of 2 tasks x 4 samples, in steps of 4. The one-call
    agent on Spider questions whose reward is fixed by their kind (half: every group varies); the three-call SQL
    example trains in the warm-start kill and demo tests (its prompts of ~700 tokens made this 214 s of the 2-core
    suite)."""
    tmp_path = tmp_path_factory.mktemp("train")
    tasks = spider_tasks(tmp_path / "halves.jsonl", 4, kind="half")
    config = small_config(tmp_path, tasks=str(tasks), agent=ONE_CALL, reward=BY_KIND, max_tokens=8,
                          sft_tasks=str(spider_tasks(tmp_path / "sft.jsonl", 2, "singer")), tasks_per_round=2,
                          batch_size=4)
    with Trainer(config, engine=engine) as trainer:
        trainable = {n: p.detach().clone() for n, p in trainer.learner.module.named_parameters() if p.requires_grad}
        state = trainer.run()
        after = {n: p.detach().clone() for n, p in trainer.learner.module.named_parameters() if p.requires_grad}
        module = weakref.ref(trainer.learner.module)
        adam_steps = {int(s["step"]) for s in trainer.learner.base_optimizer().state.values()}
    return config, state, trainable, after, module, adam_steps


def test_a_round_trains_every_parameter_with_a_finite_loss(trained):
    config, state, before, after, *_ = trained
    assert state.rounds_completed == 1 and state.policy_version == 2  # v1 = SFT, v2 = round 1
    unchanged = [n for n in before if torch.equal(before[n], after[n])]
    assert not unchanged, f"{len(unchanged)} trainable tensors did not change, e.g. {unchanged[:3]}"
    records = [json.loads(line) for line in (Path(config.output_dir) / "metrics.jsonl").read_text().splitlines()]
    sft, grpo = records
    assert sft["phase"] == "sft" and sft["sft_examples"] == 2 and math.isfinite(sft["loss"])
    assert grpo["phase"] == "grpo" and grpo["rollouts"] == 8 and grpo["steps"] >= 2
    assert math.isfinite(grpo["loss"]) and grpo["transitions"] > 0 and grpo["trained_tokens"] > 0
    assert grpo["zero_variance_groups"] < 2 and grpo["transitions_per_episode"] >= 1
    assert grpo["reward_mean"] is not None and grpo["reward_std"] > 0


def test_grpo_after_the_warm_start_starts_with_a_fresh_optimizer(trained):
    config, *_, adam_steps = trained
    sft, grpo = [json.loads(line) for line in (Path(config.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert sft["steps"] >= 1 and grpo["optimizer_steps_total"] == sft["steps"] + grpo["steps"]
    assert adam_steps == {grpo["steps"]}  # Adam counted GRPO's steps only: SFT's state was dropped


def test_every_optimizer_step_of_sft_and_grpo_is_one_point_of_the_step_series(trained):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config, *_ = trained
    folder = Path(config.output_dir)
    sft, grpo = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    steps = [json.loads(line) for line in (folder / "steps.jsonl").read_text().splitlines()]
    total = sft["steps"] + grpo["steps"]
    assert [s["optimizer_step"] for s in steps] == list(range(1, total + 1))  # GRPO's steps count on after SFT's
    assert [s["lr"] for s in steps] == [config.sft_lr] * sft["steps"] + [config.lr] * grpo["steps"]
    sft_steps, grpo_steps = steps[:sft["steps"]], steps[sft["steps"]:]
    assert all("approx_kl" in s for s in grpo_steps) and not any("approx_kl" in s for s in sft_steps)  # ratio loss
    events = EventAccumulator(str(folder / "tensorboard"))  # the default tracker
    events.Reload()
    entropy = [(e.step, e.value) for e in events.Scalars("train/entropy")]
    assert [x for x, _ in entropy] == list(range(1, total + 1)) and all(0 < v < 20 for _, v in entropy)
    assert [e.step for e in events.Scalars("grpo/reward_mean")] == [1]


def test_a_round_reports_the_first_micro_batch_and_the_policy_it_was_served(trained):
    config, *_ = trained
    grpo = [json.loads(line) for line in (Path(config.output_dir) / "metrics.jsonl").read_text().splitlines()][-1]
    # Before any update the learner is the policy that sampled (the SFT checkpoint, version 1): the recorded and
    # recomputed logprobs of its tokens agree, so the PPO ratio is ~1 and nothing is clipped.
    assert grpo["served_policy_versions"] == [1]
    # What the round trained on is kept as compile writes it (the viewer reads it from the run folder).
    kept = pl.read_parquet(Path(config.output_dir) / "rounds" / "round-0001" / "transitions.parquet")
    assert kept.height == grpo["transitions"] and {"rollout_id", "advantage", "completion_ids"} <= set(kept.columns)
    assert abs(grpo["first_ratio_mean"] - 1.0) < 0.05 and grpo["first_clip_fraction"] < 0.05
    assert 0 <= grpo["first_logprob_gap"] < 0.1


def test_a_finished_run_gives_its_model_back(trained):
    # A process that trains twice (a warm start, then a continued run from it) must not hold both learners.
    module = trained[4]
    gc.collect()
    assert module() is None, "the learner's model is still reachable after the run closed"


def test_the_checkpoint_loads_as_the_trained_adapter(trained):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config, state, _, after, *_ = trained
    run = Path(config.output_dir)
    base = AutoModelForCausalLM.from_pretrained(state.model)
    loaded = PeftModel.from_pretrained(base, run / state.last / "adapter")
    weights = dict(loaded.named_parameters())
    for name, value in after.items():
        match = [k for k in weights if k.replace(".default", "") == name.replace(".default", "")]
        assert match and torch.allclose(weights[match[0]], value), name
    assert (run / "config.toml").is_file() and (run / "reward_curve.png").stat().st_size > 0
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))


def test_the_engine_serves_the_new_policy_and_records_its_version(trained, engine):
    _, state, *_ = trained
    assert engine.policy_version == state.policy_version and engine.model_name.endswith(f"-v{state.policy_version}")
    result = engine.generate("/v1/chat/completions", {"messages": [{"role": "user", "content": "SELECT"}],
                                                      "max_tokens": 4})
    assert result["model"] == engine.model_name and result["choices"][0]["token_ids"]


def test_offline_training_on_the_stored_traces(trained, tmp_path):
    from lightning_otel.train.offline import train_offline

    config, *_ = trained
    db = Path(config.output_dir) / "traces.duckdb"
    offline = TrainConfig(**{**config.__dict__, "output_dir": str(tmp_path / "offline"), "sft_tasks": "",
                             "epochs": 1})
    # One GRPO task's group of 4 rollouts (half the round; the store also holds the SFT walk's): a step's worth.
    first = json.loads((Path(config.output_dir) / "rounds" / "round-0001" / "tasks.jsonl").read_text().split("\n")[0])
    state = train_offline(offline, db, where=f"status = 'ok' AND task_id = '{first['id']}'", objective="grpo")
    assert (tmp_path / "offline" / state.best / "adapter" / "adapter_model.safetensors").is_file()
    record = json.loads((tmp_path / "offline" / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["phase"] == "offline-grpo" and record["transitions"] > 0 and math.isfinite(record["loss"])
    assert record["rollouts"] <= 4
    with pytest.raises(UserError, match="no transitions to train on"):
        train_offline(TrainConfig(**{**offline.__dict__, "output_dir": str(tmp_path / "none")}), db,
                      objective="sft", min_reward=99.0)


# ---- resume after a real kill ----------------------------------------------------------------------------


def kind_tasks(path: Path, kinds: list[str]) -> Path:
    path.write_text("".join(json.dumps({"id": f"{kind}-{i}", "kind": kind, "question": f"Say {kind}."}) + "\n"
                            for i, kind in enumerate(kinds)))
    return path


def test_a_round_with_no_optimizer_step_says_so_and_the_policy_version_stays(engine, tmp_path):
    # Every task's rollouts get one reward (by_kind: always 1, never 0), so no group has an advantage: the rounds
    # take no step, save no checkpoint, and the engine goes on serving the policy it served.
    tasks = kind_tasks(tmp_path / "kinds.jsonl", ["always", "never"])
    config = small_config(tmp_path, tasks=str(tasks), agent=ONE_CALL, reward="tests.helpers.train_rewards:by_kind",
                          n=2, tasks_per_round=2, rounds=2, max_tokens=4)
    engine.use_base()
    with Trainer(config, engine=engine) as trainer:
        state = trainer.run()
    assert (state.rounds_completed, state.rounds_without_step, state.policy_version, state.last) == (2, 2, 0, None)
    assert engine.policy_version == 0 and not list((Path(config.output_dir) / "checkpoints").glob("round-*"))
    records = [json.loads(line) for line in (Path(config.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [(r["round"], r["steps"], r["policy_version"]) for r in records] == [(1, 0, 0), (2, 0, 0)]
    assert all("same reward" in r["no_step"] and "zero-variance group" in r["no_step"] for r in records)
    from lightning_otel.cli.train import no_step_note

    note = no_step_note(state, config.output_dir)
    assert "2 of 2 round(s) took no optimizer step" in note and "version 0 (the starting policy" in note


def test_the_pool_filter_keeps_the_tasks_the_starting_policy_sometimes_solves(engine, tmp_path):
    # tests.helpers.train_rewards:by_kind fixes each task's pass rate: always 1, never 0, half 1/2; with [1/8, 7/8]
    # only the half tasks are kept, measured once and read back by the resumed run.
    tasks = kind_tasks(tmp_path / "kinds.jsonl", ["always", "half", "never", "half", "always", "never"])
    config = small_config(tmp_path, tasks=str(tasks), agent=ONE_CALL,
                          reward="tests.helpers.train_rewards:by_kind", n=4, tasks_per_round=2, max_tokens=8,
                          pool_min_pass=0.125, pool_max_pass=0.875)
    with Trainer(config, engine=engine) as trainer:
        trainer.run()
    run = Path(config.output_dir)
    pool = {row["task_id"]: row for row in map(json.loads, (run / "pool.jsonl").read_text().splitlines())}
    assert {k: (row["samples"], row["pass_rate"], row["kept"]) for k, row in pool.items()} == {
        "always-0": (4, 1.0, False), "half-1": (4, 0.5, True), "never-2": (4, 0.0, False),
        "half-3": (4, 0.5, True), "always-4": (4, 1.0, False), "never-5": (4, 0.0, False)}
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in records] == ["pool", "grpo"]
    assert (records[0]["pool_tasks"], records[0]["pool_kept"], records[0]["pool_never"],
            records[0]["pool_always"]) == (6, 2, 2, 2)
    assert records[1]["rollouts"] == 8 and records[1]["zero_variance_groups"] == 0
    round_ids = lambda r: {json.loads(x)["id"] for x in (run / "rounds" / f"round-{r:04d}" / "tasks.jsonl")
                           .read_text().splitlines()}
    assert round_ids(1) == {"half-1", "half-3"}
    # Resumed for a second round: the pool is read back, not measured again.
    config2 = TrainConfig(**{**config.__dict__, "rounds": 2})
    with Trainer(config2, engine=engine) as trainer:
        trainer.run()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in records] == ["pool", "grpo", "grpo"] and round_ids(2) == {"half-1", "half-3"}
    engine.use_base()


def test_a_pool_filter_that_keeps_nothing_says_what_it_measured(engine, tmp_path):
    tasks = kind_tasks(tmp_path / "kinds.jsonl", ["always", "never"])
    config = small_config(tmp_path, tasks=str(tasks), agent=ONE_CALL,
                          reward="tests.helpers.train_rewards:by_kind", n=2, max_tokens=4, pool_min_pass=0.125,
                          pool_max_pass=0.875)
    with pytest.raises(UserError) as info, Trainer(config, engine=engine) as trainer:
        trainer.run()
    assert "kept no task: of 2 tasks" in str(info.value) and "pass rates from 0.0 to 1.0" in str(info.value)
    assert "widen the range" in str(info.value)


def test_a_killed_run_resumes_from_its_last_completed_round(engine, tmp_path):
    tasks = kind_tasks(tmp_path / "tasks.jsonl", ["half"] * 4)  # every group varies: each round takes a step
    run = tmp_path / "run"
    command = [str(BIN / "lightning-otel"), "train", f"tasks={tasks}", f"agent={ONE_CALL}", f"reward={BY_KIND}",
               "n=2", "tasks_per_round=2", "rounds=2", "batch_size=4", "micro_batch=4",
               "max_tokens=16", "lora_rank=8",
               f"output_dir={run}", f"engine_url={engine.url}", "seed=3", "concurrency=4"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    first = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and first.poll() is None:
        if (run / "run.json").is_file() and json.loads((run / "run.json").read_text())["rounds_completed"] == 1:
            break
        time.sleep(0.5)
    assert first.poll() is None, f"the run ended before it could be killed:\n{first.stdout.read().decode()[-3000:]}"
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(30)
    killed_at = json.loads((run / "run.json").read_text())
    assert killed_at["rounds_completed"] == 1
    steps_round_1 = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["optimizer_steps_total"]

    second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    state = json.loads((run / "run.json").read_text())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2] and state["rounds_completed"] == 2
    resumed = f"resuming {run} at round 2 of 2, from checkpoints/round-0001 (policy version 1)"
    assert resumed in second.stdout, second.stdout[-2000:]
    # optimizer state came back: DeepSpeed's step count continues from round 1's
    assert records[1]["optimizer_steps_total"] == steps_round_1 + records[1]["steps"]
    # the same data order: round 2 drew the tasks that seed 3 gives round 2
    expected = [t.task_id for t in round_tasks(load_tasks(tasks), 1, 2, seed=3)]
    drawn = [json.loads(line)["id"]
             for line in (run / "rounds" / "round-0002" / "tasks.jsonl").read_text().splitlines()]
    assert drawn == expected
    assert not (run / killed_at["last"] / "state").exists()  # round 1's optimizer state was dropped after round 2



def killed_once(command: list[str], ready: Path, env: dict | None = None) -> None:
    """Start `command` and SIGKILL it (its whole process group) as soon as `ready` exists."""
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                           env=env)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and run.poll() is None and not ready.is_file():
        time.sleep(0.05)
    assert run.poll() is None, f"the run ended before it could be killed:\n{run.stdout.read().decode()[-3000:]}"
    os.killpg(run.pid, signal.SIGKILL)
    run.wait(30)


def test_a_warm_start_killed_twice_walks_and_trains_only_what_it_had_not_saved(engine, tmp_path):
    sft = spider_tasks(tmp_path / "sft.jsonl", 6, "singer")
    run = tmp_path / "run"
    walked, trained = run / "rounds" / "sft" / "walked.jsonl", run / "rounds" / "sft" / "trained.json"
    command = [str(BIN / "lightning-otel"), "train", f"agent={AGENT_COMMAND}", f"sft_tasks={sft}", "sft_save_tasks=2",
               "sft_save_steps=2", "sft_epochs=2", "rounds=0", "batch_size=2", "micro_batch=2", "max_tokens=16",
               "lora_rank=8", f"output_dir={run}", f"engine_url={engine.url}", "concurrency=2", "task_pack=spider"]
    # 1. killed while walking the labelled tasks, after the first stretch of 2 was saved
    killed_once(command, walked)
    saved = [json.loads(line) for line in walked.read_text().splitlines()]
    assert 2 <= len(saved) < 6, f"killed after {len(saved)} of 6 tasks were saved"
    changed = saved[0]["task_id"]  # a task edited since: its saved walk no longer fits it, it is walked again
    rows = [json.loads(line) for line in sft.read_text().splitlines()]
    next(r for r in rows if r["id"] == changed)["question"] += " List them."
    sft.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # 2. killed while training (6 steps: 2 epochs of 6 demonstrations in steps of 2), after a saved state
    killed_once(command, trained)
    steps_saved = json.loads(trained.read_text())["steps"]
    assert steps_saved in (2, 4)
    # 3. to the end
    third = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert third.returncode == 0, third.stdout[-2000:] + third.stderr[-3000:]
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["phase"] == "sft" and record["sft_examples"] == 6 and math.isfinite(record["loss"])
    assert record["sft_walked_earlier"] == 6 and record["sft_resumed_at_step"] == steps_saved  # walked nothing
    assert record["steps"] == 6 - steps_saved and record["optimizer_steps_total"] == 6  # the optimizer state came back
    final = {e["task_id"]: e["rollout_id"] for e in map(json.loads, walked.read_text().splitlines())}
    assert list(final) == [r["id"] for r in rows]  # every task once, in the file's order
    kept = {e["task_id"]: e["rollout_id"] for e in saved[1:]}
    assert {t: final[t] for t in kept} == kept and final[changed] != saved[0]["rollout_id"]
    walks = dict(client.query("SELECT task_id, count(*) AS n FROM rollout_runs GROUP BY 1", run / "traces.duckdb")
                 .iter_rows())
    assert all(walks[t] == 1 for t in kept) and walks[changed] == 2
    assert not trained.exists() and not list((run / "checkpoints").glob("sft-partial-*"))


@pytest.mark.heavy
def test_a_full_fine_tune_round_serves_the_new_weights_without_restarting_the_engine(engine, tmp_path):
    """full_finetune: every weight trains and the engine serves the saved model after, its weights loaded into
    the running engine (same architecture and tokenizer: no restart)."""
    from safetensors.torch import load_file

    from lightning_otel.serve.model import bundled_model_dir

    engine.use_base()
    restarts = engine.restarts
    try:
        config = small_config(tmp_path, tasks=str(kind_tasks(tmp_path / "kinds.jsonl", ["half"] * 2)),
                              agent=ONE_CALL, reward=BY_KIND, full_finetune=True, n=2, tasks_per_round=2,
                              batch_size=4, micro_batch=2, max_tokens=8, lr=1e-5)
        with Trainer(config, engine=engine) as trainer:
            state = trainer.run()
        saved = Path(config.output_dir) / state.last / "model"
        assert state.policy_version == 1 and (saved / "config.json").is_file()
        assert Path(engine.config.model_dir) == saved and engine.policy_version == 1
        assert engine.restarts == restarts  # loaded in place
        result = engine.generate("/v1/chat/completions", {"messages": [{"role": "user", "content": "SELECT"}],
                                                          "max_tokens": 4})
        assert result["choices"][0]["token_ids"]  # the engine answers on the trained weights
        before = load_file(str(bundled_model_dir() / "model.safetensors"))
        after = {}
        for shard in saved.glob("*.safetensors"):
            after.update(load_file(str(shard)))
        changed = [k for k in before if k in after and not torch.equal(before[k], after[k])]
        assert len(changed) > len(before) // 2, f"only {len(changed)} of {len(before)} tensors changed"
    finally:
        engine.use_base()


@pytest.mark.heavy
def test_serve_merged_serves_each_lora_checkpoint_as_full_weights_and_eval_goes_back_to_the_base(engine, tmp_path):
    """serve_merged: after each round the engine serves base + adapter merged (loaded into the running engine);
    the previous round's merged copy is dropped, its adapter kept; eval on the run brings the engine back to the
    base model with the adapter hot-loaded."""
    from lightning_otel.eval import EvalConfig, evaluate
    from lightning_otel.span_store import client

    engine.use_base()
    base, restarts = engine.base_dir, engine.restarts
    try:
        config = small_config(tmp_path, tasks=str(kind_tasks(tmp_path / "kinds.jsonl", ["half"] * 4)),
                              agent=ONE_CALL, reward=BY_KIND, serve_merged=True, rounds=2, n=2, tasks_per_round=2,
                              batch_size=4, micro_batch=2, max_tokens=8, temperature=0.7)
        with Trainer(config, engine=engine) as trainer:
            state = trainer.run()
        run = Path(config.output_dir)
        assert state.policy_version == 2
        assert Path(engine.config.model_dir) == run / state.last / "merged" and engine.policy_version == 2
        assert not (run / "checkpoints" / "round-0001" / "merged").exists()  # a serving copy, dropped
        assert (run / "checkpoints" / "round-0001" / "adapter" / "adapter_config.json").is_file()
        versions = client.query("SELECT policy_version, count(*) AS n FROM generations GROUP BY 1 ORDER BY 1",
                                run / "traces.duckdb")["policy_version"].to_list()
        assert versions == [0, 1]  # round 2 sampled from the merged round-1 policy
        merged = run / state.last / "merged"

        def evaluated(model: str, name: str) -> tuple[dict, list[int]]:
            summary = evaluate(EvalConfig(tasks=Path(config.tasks), agent=ONE_CALL, report=tmp_path / name,
                                          model=model, reward=REWARD, n=1, max_tokens=8, temperature=0.0),
                               engine=engine).summary
            versions = client.query("SELECT DISTINCT policy_version FROM generations",
                                    tmp_path / name / "traces.duckdb")["policy_version"].to_list()
            return summary, versions

        # The run's checkpoint, with the engine still on its merged copy: served as is, no restart.
        summary, versions = evaluated(str(run), "report-run")
        assert summary["rollouts"] == 4 and versions == [2]
        assert summary["policy"]["adapter"] == str((run / state.last / "adapter").resolve())
        assert Path(engine.config.model_dir) == merged
        # The base model: the engine goes back to what it started on.
        summary, versions = evaluated("base", "report-base")
        assert Path(engine.config.model_dir).resolve() == base.resolve() and versions == [0]
        # A model folder it does not run: refused, unless loaded first.
        with pytest.raises(UserError, match="let the command start its own engine"):
            evaluated(str(merged), "report-refused")
        engine.load_model(merged, 0)
        summary, versions = evaluated(str(merged), "report-merged")
        assert Path(engine.config.model_dir).resolve() == merged.resolve()
        assert summary["policy"]["adapter"] is None and versions == [2]
        assert engine.restarts == restarts  # every move between weights was a load into the running engine
    finally:
        engine.use_base()


# ---- using the result ------------------------------------------------------------------------------------


def test_export_merges_the_adapter_into_a_model_that_computes_the_same_logits(trained, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lightning_otel.train.checkpoints import export_policy

    config, state, *_ = trained
    out = export_policy(config.output_dir, tmp_path / "merged", merge=True)
    ids = torch.tensor([[1, 520, 3316, 28, 34, 9]])
    merged = AutoModelForCausalLM.from_pretrained(out)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(state.model),
                                        Path(config.output_dir) / state.best / "adapter")
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, adapted(ids).logits, atol=1e-4)
    assert (out / "tokenizer.json").is_file()
    assert "exported as a merged model folder" in (out / "README.md").read_text()  # the model card
    assert export_policy(config.output_dir, tmp_path / "adapter").joinpath("adapter_config.json").is_file()
    with pytest.raises(UserError, match="not empty"):
        export_policy(config.output_dir, tmp_path / "adapter")


def test_serve_puts_the_trained_policy_behind_the_gateway_and_records_its_calls(trained, engine, tmp_path):
    import threading
    import urllib.request

    from lightning_otel.serve.serving import serve_policy
    from lightning_otel.span_store import client

    config, state, *_ = trained
    stop, urls = threading.Event(), []
    db = tmp_path / "served.duckdb"
    thread = threading.Thread(target=serve_policy, kwargs=dict(spec=config.output_dir, port=0, db=db,
                                                                ready=urls.append, stop=stop, engine=engine))
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while not urls and time.monotonic() < deadline and thread.is_alive():
            time.sleep(0.2)
        assert urls, "serve did not come up"
        request = urllib.request.Request(urls[0] + "/chat/completions", data=json.dumps({
            "model": "gpt-4o", "messages": [{"role": "user", "content": "How many singers?"}],
            "max_tokens": 8}).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
        assert answer["model"] == "gpt-4o" and answer["choices"][0]["message"]["content"] is not None
        versions: list = []
        deadline = time.monotonic() + 60
        while not versions and time.monotonic() < deadline:  # the gateway exports its spans in the background
            versions = client.query("SELECT policy_version FROM generations", db)["policy_version"].to_list()
            time.sleep(0.2)
        assert versions == [engine.policy_version] and versions[0] >= 1
    finally:
        stop.set()
        thread.join(60)


@pytest.mark.heavy
def test_a_child_process_does_not_reuse_the_parents_rendezvous_port():
    import subprocess
    import sys

    # The parent runs in a fresh process too: this test process may already hold a process group.
    parent = r"""
import os, subprocess, sys
for key in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LIGHTNING_OTEL_DIST_OWNER"):
    os.environ.pop(key, None)
from lightning_otel.train.learner import distributed_env
distributed_env()
code = ("import os; from lightning_otel.train.learner import distributed_env; distributed_env(); "
        "print(os.environ['MASTER_PORT'])")
inherited = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
launcher = {k: v for k, v in os.environ.items() if k != "LIGHTNING_OTEL_DIST_OWNER"}
kept = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                      env=launcher).stdout.strip()
print(os.environ["MASTER_PORT"], inherited, kept)
"""
    out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, check=True)
    parent_port, inherited, kept = out.stdout.split()
    assert inherited != parent_port  # a lightning-otel parent's port is not reused
    assert kept == parent_port  # a launcher's settings are kept


def test_grpo_under_an_optimised_prompt_reports_the_prompt_version_of_its_rounds(engine, tmp_path):
    # APO then RL: a patch file (as `optimize` writes best_prompt.json) stays applied during the rounds' rollouts,
    # the gateway records carry its version, and the round's record says which prompt version it ran under.
    from lightning_otel.serve.prompts import fingerprint, load_patches
    from lightning_otel.train.trainer import keep_prompt
    from tests.helpers.apo_agents import SYSTEM

    prompt = tmp_path / "best_prompt.json"
    prompt.write_text(json.dumps({"patches": [{"id": "apo-answer", "version": "c0ffee", "target": {
        "system_sha256": fingerprint(SYSTEM)}, "action": {"append": "Answer with one word."}}]}))
    # always/never: no group varies, so the round takes no optimizer step (what is tested is what it ran under)
    config = small_config(tmp_path, tasks=str(kind_tasks(tmp_path / "kinds.jsonl", ["always", "never"])),
                          agent=f"{REPO / 'tests' / 'helpers' / 'apo_agents.py'}:answer", prompt=str(prompt),
                          reward="tests.helpers.train_rewards:by_kind", n=2, tasks_per_round=2, max_tokens=4)
    engine.use_base()
    with Trainer(config, engine=engine) as trainer:
        state = trainer.run()
    run = Path(config.output_dir)
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert state.rounds_completed == 1 and record["prompt_versions"] == {"c0ffee": record["rollouts"]} == {"c0ffee": 4}
    assert (run / "prompt.json").read_text() == prompt.read_text()
    # the policy learned from the patched prompt: the records' prompt ids are those of the patched conversation
    patches = load_patches(prompt)
    expected = set()
    for question in ("Say always.", "Say never."):
        patched = patches.apply({"messages": [{"role": "system", "content": SYSTEM},
                                              {"role": "user", "content": question}]})[0]["messages"]
        assert patched[0]["content"].endswith("Answer with one word.")
        expected.add(tuple(engine.tokenize_chat({"messages": patched, "add_generation_prompt": True})["tokens"]))
    ids = client.query("SELECT prompt_ids FROM generations", run / "traces.duckdb").to_dicts()
    assert {tuple(r["prompt_ids"]) for r in ids} == expected
    # a resumed run must find the patch file it started under
    prompt.write_text(prompt.read_text().replace("one word", "two words"))
    with pytest.raises(UserError, match="changed since this run started"):
        keep_prompt(prompt, run, resumed=True)
