"""Training on two processes under a launcher (torchrun; DeepSpeed's own) is training on one: the same steps,
losses, gradient norms and weights on the same transitions. Offline GRPO (`lightning-otel train --offline`) on
rollouts recorded through the gateway (tests/fixtures/rollouts), the bundled model, gloo on this CPU.

Steps of 2 transitions in micro-batches of 1: the first step gives each rank one, the last (the third
transition) gives rank 1 a zero-weight one, so the uneven split is exercised too."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from lightning_otel.lifetime import free_port
from test_retokenize import load_rollouts

# Three one-call rollouts of one task (a tool-calling example agent), rewards 0.5, 0.0 and 1.0 under sql_form: 3
# transitions of about 600 prompt tokens. (Two rollouts of the three-call plain-SDK agent, 6 transitions and 2,900
# prompt tokens, took 73 s in one process alone on a 2-core AVX2 machine.)
WHERE = "rollout_id IN ('ro-47661bccf9264268', 'ro-9aac9b6a79ec4fa4', 'ro-dd5720f8ca0748c7')"
SETTINGS = ["reward=sql_form", "batch_size=2", "micro_batch=1", "seed=3", "lr=1e-4"]
PYTHON = Path(sys.executable)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    db = tmp_path_factory.mktemp("distributed") / "traces.duckdb"
    load_rollouts(db)
    return db


def launch(launcher: list[str], store: Path, out: Path, where: str = WHERE) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_SIZE")}
    env["OMP_NUM_THREADS"] = "1"  # two ranks on two cores
    # torch's build lock for DeepSpeed's CPU collective, as a process killed while compiling it leaves it: torch
    # would wait for it forever. The ranks start their process group without that op, and build nothing.
    extensions = store.parent / "torch_extensions"
    (extensions / "deepspeed_shm_comm").mkdir(parents=True, exist_ok=True)
    (extensions / "deepspeed_shm_comm" / "lock").touch()
    env["TORCH_EXTENSIONS_DIR"] = str(extensions)
    command = [*launcher, "lightning_otel.cli", "train", "--offline", "--db", str(store), "--where", where,
               f"output_dir={out}", *SETTINGS]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert not [p.name for p in extensions.rglob("*") if p.name != "lock" and p.is_file()]  # nothing compiled
    return result


def trained(result: subprocess.CompletedProcess, out: Path) -> tuple[dict, dict]:
    assert result.returncode == 0, result.stderr[-4000:]
    assert "terminate called" not in result.stderr  # every rank left its process group before exiting
    metrics = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [s["optimizer_step"] for s in steps] == list(range(1, metrics["steps"] + 1))  # rank 0 alone writes
    return metrics, load_file(out / "checkpoints" / "offline" / "adapter" / "adapter_model.safetensors")


def assert_same_training(one: tuple[dict, dict], two: tuple[dict, dict]) -> None:
    (m1, w1), (m2, w2) = one, two
    assert (m1["ranks"], m2["ranks"]) == (1, 2)
    assert m1["steps"] == m2["steps"] == 2 and m1["samples"] == m2["samples"] == 3
    assert m1["trained_tokens"] == m2["trained_tokens"]
    assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-5, abs=1e-7)
    # Adam's update hardly depends on the gradient's scale: the norm is what shows a gradient summed wrong.
    assert m1["grad_norm"] > 0 and m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-4)
    # the step metrics are summed over the ranks' micro-batches like the loss
    assert m1["entropy"] > 0 and m2["entropy"] == pytest.approx(m1["entropy"], rel=1e-5)
    assert m2["approx_kl"] == pytest.approx(m1["approx_kl"], rel=1e-4, abs=1e-8)
    assert w1.keys() == w2.keys()
    moved = 0
    for key in w1:
        assert (w1[key] - w2[key]).abs().max() <= 1e-6, key
        moved += bool(w1[key].abs().max() > 0) if "lora_B" in key else 0
    assert moved == sum("lora_B" in k for k in w1)  # every adapter trained (B starts at zero)


@pytest.fixture(scope="module")
def one_process(store, tmp_path_factory) -> tuple[dict, dict]:
    out = tmp_path_factory.mktemp("one") / "run"
    return trained(launch([str(PYTHON), "-m"], store, out), out)


@pytest.mark.heavy
def test_two_ranks_under_torchrun_train_as_one_process(store, one_process, tmp_path):
    out = tmp_path / "run"
    result = launch([str(PYTHON), "-m", "torch.distributed.run", "--nproc_per_node", "2",
                     "--master_port", str(free_port()), "-m"], store, out)
    assert_same_training(one_process, trained(result, out))
    assert not list(out.glob("rank*")) and result.stdout.count("done: ") == 1  # rank 0 alone reports and writes


@pytest.mark.heavy
def test_two_ranks_under_the_deepspeed_launcher_train_as_one_process(store, one_process, tmp_path):
    out = tmp_path / "run"
    result = launch([str(PYTHON.parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
                     "--module"], store, out)
    assert_same_training(one_process, trained(result, out))


@pytest.mark.heavy
def test_an_error_on_rank_0_stops_every_rank(store, tmp_path):
    """Rank 0 fails before any step (a bad --where): the run exits with its message, the other rank does not
    hang waiting for it."""
    result = launch([str(PYTHON), "-m", "torch.distributed.run", "--nproc_per_node", "2",
                     "--master_port", str(free_port()), "-m"], store, tmp_path / "run", where="no_such_column = 1")
    assert result.returncode != 0
    assert "--where 'no_such_column = 1' is not a valid condition" in result.stderr, result.stderr[-3000:]
