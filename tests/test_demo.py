"""The README's main command, end to end in its quick mode, as a user gets it: lightning-otel built as a wheel,
installed in a fresh virtual environment, run outside the clone. `lightning-otel demo --quick` starts its own
vLLM engine on the bundled model, evaluates the plain-OpenAI example agent, trains (SFT warm start + one GRPO
round), evaluates again and prints the before/after table."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.needs_engine, pytest.mark.own_engine, pytest.mark.heavy,  # it starts its own vLLM engine
              pytest.mark.xdist_group("wheel")]  # test_packaging.py installs the same wheel (conftest.py: wheel_venv)

REPO = Path(__file__).resolve().parent.parent


def test_quick_demo_runs_from_an_installed_wheel_outside_the_clone(wheel_venv, tmp_path):
    venv = wheel_venv
    where = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import lightning_otel; print(lightning_otel.__file__)"],
                           capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    assert where.startswith(str(venv)), where  # the wheel's package, not the clone's
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "LIGHTNING_ENGINE_PYTHON": str(REPO / ".venv-engine" / "bin" / "python")}
    result = subprocess.run([str(venv / "bin" / "lightning-otel"), "demo", "--quick", "--folder", str(work)],
                            capture_output=True, text=True, timeout=1200, cwd=work, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "execution accuracy" in result.stdout and "transitions per episode" in result.stdout
    (folder,) = work.glob("run-*")
    before = json.loads((folder / "report-before" / "summary.json").read_text())
    after = json.loads((folder / "report-after" / "summary.json").read_text())
    assert before["rollouts"] == after["rollouts"] == 2
    assert before["task_pack"] == "spider" and before["accuracy"]["group_field"] == "hardness"
    assert before["policy"]["label"] == "base" and after["policy"]["adapter"]
    assert after["baseline"]["comparison"]
    paired = after["baseline"]["paired"]
    assert paired["tasks"] == 2 and paired["better"] + paired["worse"] + paired["same"] == 2
    assert "Paired on the 2 tasks both scored" in result.stdout
    run = json.loads((folder / "run" / "run.json").read_text())
    assert run["sft_done"] and run["rounds_completed"] == 1
    phases = [json.loads(line)["phase"] for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
    assert phases == ["sft", "grpo"]
    assert (folder / "report-after" / "report.md").is_file()
    timings = json.loads((folder / "timings.json").read_text())
    assert {"engine_start", "eval_before", "train", "eval_after"} <= set(timings)
