"""Trackers (report_to) and the per-optimizer-step metrics.

The entropy on hand-computed logits and against torch's own Categorical on the same logits; one forward pass
of the bundled model gives the loss's logprobs and the entropy. Then real GRPO steps (the bundled model with
LoRA under DeepSpeed, short transitions so that they are quick) reported as the trainer reports them to
TensorBoard, W&B (offline mode: nothing leaves the machine) and MLflow (a file store in the run folder): every
step series is read back from each tracker's own files and has one finite point per optimizer step; a resumed
run continues the same tracker runs. (The offline and online trainers pass the same step callback to optimize;
tests/test_distributed.py runs the offline one end to end and compares the step figures over two ranks.)
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from lightning_otel.errors import UserError
from lightning_otel.train import trackers
from lightning_otel.train.batch import collate, completion_logprobs, completion_scores, token_entropy
from lightning_otel.train.config import TrainConfig, load_config
from lightning_otel.train.losses import grpo_loss
from tests.helpers import wandb_records

STEP_SERIES = ("loss", "lr", "grad_norm", "entropy", "approx_kl", "clip_fraction")


# ---- entropy ---------------------------------------------------------------------------------------------

def test_entropy_of_hand_computed_distributions():
    V = 50
    uniform = torch.log_softmax(torch.zeros(2, 3, V), dim=-1)
    assert torch.allclose(token_entropy(uniform), torch.full((2, 3), math.log(V)))
    certain = torch.log_softmax(torch.tensor([[0.0, -200.0, -200.0]]), dim=-1)
    assert float(token_entropy(certain)[0]) == pytest.approx(0.0, abs=1e-6)
    # p = (1/2, 1/4, 1/4): H = 1.5 log 2; a token the model rules out (-inf) adds nothing, and no NaN
    halves = torch.log(torch.tensor([[0.5, 0.25, 0.25, 0.0]]))
    assert float(token_entropy(halves)[0]) == pytest.approx(1.5 * math.log(2), rel=1e-6)


@pytest.mark.parametrize("chunk_elements", [1, 37 * 5, 1 << 22])
def test_entropy_equals_torchs_categorical_on_the_same_logits_in_any_chunking(chunk_elements):
    logits = torch.randn(3, 5, 37, generator=torch.Generator().manual_seed(0)) * 3
    reference = torch.distributions.Categorical(logits=logits).entropy()
    assert torch.allclose(token_entropy(torch.log_softmax(logits, -1), chunk_elements), reference, atol=1e-5)


@pytest.mark.heavy
def test_the_loss_forward_pass_also_gives_the_entropy_without_grad(learner):
    model = learner.module
    rows = [{"rollout_id": f"r{i}", "prompt_ids": list(range(300, 300 + 9 + i)),
             "completion_ids": list(range(900, 905 + 2 * i)), "completion_logprobs": None, "loss_mask": None,
             "advantage": 1.0} for i in range(3)]
    batch = collate(rows, 0)
    calls = []
    hook = model.register_forward_hook(lambda *_: calls.append(1))
    try:
        scores = completion_scores(model, batch, temperature=0.7)
    finally:
        hook.remove()
    assert len(calls) == 1  # one forward pass for the logprobs and the entropy
    assert scores.logp.requires_grad and not scores.entropy.requires_grad
    with torch.no_grad():
        assert torch.allclose(scores.logp, completion_logprobs(model, batch, temperature=0.7), atol=1e-5)
        T = batch.completion_width
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention,
                       position_ids=batch.positions).logits[:, -T - 1:-1].float() / 0.7
    reference = torch.distributions.Categorical(logits=logits).entropy()
    trained = batch.mask > 0
    assert torch.allclose(scores.entropy[trained], reference[trained], atol=1e-4)
    assert float(scores.entropy[trained].min()) > 0 and float(scores.entropy.max()) < math.log(logits.shape[-1])


def test_the_loss_reports_entropy_and_approx_kl_weighted_like_itself():
    old = torch.tensor([[-1.0, -2.0, float("nan")], [-0.5, -0.5, -0.5]])
    logp = old.clone()
    logp[0, 1] = -2.0 + math.log(2.0)  # ratio 2 on one token
    logp[0, 2] = -3.0
    weights = torch.tensor([[0.25, 0.25, 0.0], [0.5, 0.0, 0.0]])  # sums to 1; the NaN sits at weight 0
    entropy = torch.tensor([[1.0, 2.0, float("nan")], [3.0, 9.0, 9.0]])
    out = grpo_loss(logp, old, torch.tensor([1.0, -1.0]), weights, clip=0.2, entropy=entropy)
    assert out.entropy == pytest.approx(0.25 * 1.0 + 0.25 * 2.0 + 0.5 * 3.0)
    assert out.approx_kl == pytest.approx(0.25 * ((2.0 - 1.0) - math.log(2.0)))
    assert not out.has_kl
    same = grpo_loss(old.nan_to_num(), old.nan_to_num(), torch.tensor([1.0, -1.0]), weights)
    assert same.approx_kl == pytest.approx(0.0, abs=1e-7) and same.entropy is None


# ---- report_to ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, names", [
    (["tensorboard"], ["tensorboard"]), ([], []), (["none"], []), ("none", []), ("", []),
    ("wandb, mlflow", ["wandb", "mlflow"]), (["MLflow", "tensorboard", "mlflow"], ["mlflow", "tensorboard"]),
])
def test_report_to_takes_lists_texts_and_none(value, names):
    assert TrainConfig(report_to=value).report_to == names


def test_report_to_from_key_values_and_the_default():
    assert TrainConfig().report_to == ["tensorboard"]
    assert load_config(overrides=["report_to=tensorboard,wandb"]).report_to == ["tensorboard", "wandb"]
    assert load_config(overrides=["report_to=none"]).report_to == []
    assert load_config(overrides=['report_to=["mlflow"]']).report_to == ["mlflow"]


@pytest.mark.parametrize("value, message", [
    (["tensorbord"], "unknown tracker(s) 'tensorbord'; choose from tensorboard, wandb, mlflow"),
    (["none", "wandb"], '"none" turns every tracker off'),
    ([3], "give a list of tracker names"),
])
def test_a_bad_report_to_is_refused_with_what_to_do(value, message):
    with pytest.raises(UserError, match="report_to") as info:
        TrainConfig(report_to=value)
    assert message in str(info.value)


def test_a_tracker_whose_library_is_missing_says_how_to_install_it(monkeypatch):
    # wandb is installed here; a registry entry that needs a module this machine lacks stands for its absence
    monkeypatch.setitem(trackers.TRACKERS, "wandb", (trackers.WandbTracker, "no_such_wandb_module"))
    with pytest.raises(UserError, match=r"wandb.*not installed: pip install 'lightning-otel\[trackers\]'"):
        TrainConfig(report_to=["tensorboard", "wandb"])


# ---- a real run, read back from every tracker --------------------------------------------------------------

@pytest.fixture(scope="module")
def tracker_env():
    """W&B offline (nothing leaves the machine), MLflow at its default (a file store in the run folder)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_MODE", "offline")
        env.setenv("WANDB_CONSOLE", "off")
        env.delenv("MLFLOW_TRACKING_URI", raising=False)
        env.delenv("WANDB_DIR", raising=False)
        yield


@pytest.fixture(scope="module")
def learner(tmp_path_factory, tracker_env):
    from lightning_otel.serve.model import bundled_model_dir
    from lightning_otel.train.learner import Learner

    out = tmp_path_factory.mktemp("trackers") / "run"
    config = load_config(overrides=[f"output_dir={out}", "batch_size=2", "micro_batch=1", "lora_rank=4", "lr=1e-3",
                                    "report_to=tensorboard,wandb,mlflow", "tracker_project=tests"])
    learner = Learner(bundled_model_dir(), config)
    yield learner
    learner.close()


def short_rows(learner) -> list[dict]:
    """6 transitions (3 steps of 2) whose sampling logprobs are the starting policy's own: the first step is
    on-policy (approx_kl 0), the later ones are not."""
    encode = learner.tokenizer.encode
    rows = [{"rollout_id": f"ro-{i}", "prompt_ids": encode(f"Question {i}: how many singers are there?"),
             "completion_ids": encode(["SELECT count(*) FROM singer", "SELECT name FROM singer"][i % 2])[: 5 + i],
             "loss_mask": None, "advantage": 1.0 if i % 2 else -1.0} for i in range(6)]
    with torch.no_grad():
        logp = learner.logprobs(collate([{**row, "completion_logprobs": None} for row in rows], 0))
    for row, values in zip(rows, logp):  # completions are right-aligned
        row["completion_logprobs"] = values[len(values) - len(row["completion_ids"]):].tolist()
    return rows


@pytest.fixture(scope="module")
def reported_run(learner):
    """3 optimizer steps of GRPO reported as the trainer reports them (open_metrics, a step callback, the round
    record) to all three trackers."""
    from lightning_otel.train.metrics import open_metrics
    from lightning_otel.train.optimize import optimize

    config = learner.config
    out = Path(config.output_dir)
    out.mkdir(parents=True)
    metrics = open_metrics(config, out)
    try:
        stats = optimize(learner, short_rows(learner), config, "grpo", seed=0, on_step=metrics.write_step)
        metrics.write({"round": 1, "phase": "grpo", **stats.summary()})
    finally:
        metrics.close()
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    return config, out, record


def assert_one_finite_point_per_step(points: dict[str, list[tuple[int, float]]], steps: int) -> None:
    for name in STEP_SERIES:
        series = points.get(f"train/{name}")
        assert series is not None, f"no train/{name} series"
        assert [step for step, _ in series] == list(range(1, steps + 1)), name
        assert all(math.isfinite(value) for _, value in series), name


@pytest.mark.heavy
def test_every_step_is_in_steps_jsonl_with_the_round_record_agreeing(reported_run):
    _, out, record = reported_run
    assert record["steps"] == 3 and record["samples"] == 6
    lines = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [line["optimizer_step"] for line in lines] == [1, 2, 3]
    assert all(line["lr"] == 1e-3 and line["grad_norm"] > 0 and 0 <= line["clip_fraction"] <= 1 for line in lines)
    assert "kl" not in lines[0]  # kl_loss = 0: the loss has no KL term to report
    assert record["entropy"] == pytest.approx(sum(line["entropy"] for line in lines) / 3)
    assert record["approx_kl"] == pytest.approx(sum(line["approx_kl"] for line in lines) / 3)
    assert record["loss"] == pytest.approx(sum(line["loss"] for line in lines) / 3)
    assert 0 < record["entropy"] < math.log(49152)
    # the first step's policy is the one that sampled; by the last, two updates moved it
    assert lines[0]["approx_kl"] == pytest.approx(0.0, abs=1e-6) and lines[-1]["approx_kl"] > 1e-6


@pytest.mark.heavy
def test_tensorboard_has_the_step_series_and_the_round_record(reported_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, out, record = reported_run
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert_one_finite_point_per_step({t: [(e.step, e.value) for e in events.Scalars(t)] for t in tags}, 3)
    (point,) = events.Scalars("grpo/entropy")  # the round record, at its round
    assert point.step == 1 and point.value == pytest.approx(record["entropy"], rel=1e-6)


@pytest.mark.heavy
def test_mlflow_has_the_step_series_and_the_config_as_params(reported_run):
    from mlflow.tracking import MlflowClient

    _, out, record = reported_run
    saved = json.loads((out / trackers.STATE_FILE).read_text())["mlflow"]
    assert saved["tracking_uri"] == (out / "mlruns").resolve().as_uri()
    client = MlflowClient(saved["tracking_uri"])
    run = client.get_run(saved["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert client.get_experiment(run.info.experiment_id).name == "tests"
    assert run.data.params["lr"] == "0.001" and run.data.params["report_to"] == str(["tensorboard", "wandb",
                                                                                       "mlflow"])
    points = {f"train/{n}": [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, f"train/{n}")]
              for n in STEP_SERIES}
    assert_one_finite_point_per_step(points, 3)
    assert run.data.metrics["grpo/loss"] == pytest.approx(record["loss"])


def wandb_file(out: Path, run_id: str) -> Path:
    files = sorted(out.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert files, f"no offline W&B run {run_id} in {out / 'wandb'}"
    return files[-1]


@pytest.mark.heavy
def test_wandb_offline_has_the_step_series_against_the_optimizer_step(reported_run):
    config, out, record = reported_run
    run_id = json.loads((out / trackers.STATE_FILE).read_text())["wandb"]["id"]
    path = wandb_file(out, run_id)
    rows = wandb_records.history_until(path, lambda rows: sum("optimizer_step" in row for row in rows) >= 3
                                       and any("round" in row for row in rows))
    step_rows = [row for row in rows if "optimizer_step" in row]
    points = {f"train/{n}": [(row["optimizer_step"], row[f"train/{n}"]) for row in step_rows]
              for n in STEP_SERIES}
    assert_one_finite_point_per_step(points, 3)
    (round_row,) = [row for row in rows if "round" in row]
    assert round_row["round"] == 1 and round_row["grpo/entropy"] == pytest.approx(record["entropy"])
    axes = wandb_records.step_metrics(path)
    assert axes["train/entropy"] == "optimizer_step" and axes["grpo/entropy"] == "round"
    logged = wandb_records.config(path)
    assert logged["lr"] == config.lr and logged["report_to"] == config.report_to


@pytest.mark.heavy
def test_a_resumed_run_continues_its_tracker_runs_and_a_new_one_starts_others(reported_run):
    from mlflow.tracking import MlflowClient

    from lightning_otel.train.metrics import open_metrics

    config, out, _ = reported_run
    before = json.loads((out / trackers.STATE_FILE).read_text())
    metrics = open_metrics(config, out, resume=True)
    metrics.write_step(4, {"loss": 0.5, "entropy": 1.25})
    metrics.close()
    after = json.loads((out / trackers.STATE_FILE).read_text())
    assert after == before  # the same W&B id and MLflow run
    client = MlflowClient(after["mlflow"]["tracking_uri"])
    history = client.get_metric_history(after["mlflow"]["run_id"], "train/entropy")
    assert [m.step for m in history] == [1, 2, 3, 4] and history[-1].value == 1.25
    rows = wandb_records.history_until(wandb_file(out, after["wandb"]["id"]),
                                       lambda rows: any("optimizer_step" in row for row in rows))
    resumed = [row for row in rows if "optimizer_step" in row]
    assert [row["optimizer_step"] for row in resumed] == [4]  # this process's part of the same W&B run

    fresh = open_metrics(config, out, resume=False)
    fresh.close()
    again = json.loads((out / trackers.STATE_FILE).read_text())
    assert again["mlflow"]["run_id"] != before["mlflow"]["run_id"] and again["wandb"]["id"] != before["wandb"]["id"]


def test_a_tracker_that_cannot_start_stops_the_run_before_the_learner_and_closes_the_store(tmp_path, monkeypatch):
    from lightning_otel.train.trainer import Trainer

    # no W&B login here: no key in the environment, an empty .netrc and settings folder
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    for name in ("WANDB_API_KEY", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setattr("lightning_otel.train.learner.Learner.__init__",
                        lambda *_, **__: pytest.fail("the learner was built before the trackers started"))
    config = TrainConfig(output_dir=str(tmp_path / "run"), rounds=0, report_to=["wandb"])
    with pytest.raises(UserError, match=r"wandb login.*WANDB_MODE=offline"):
        with Trainer(config):
            pytest.fail("the run started without its tracker")
    assert not (tmp_path / "run" / "traces.duckdb.collector.json").exists()  # the store's collector stopped
