"""The README's main command, end to end in its quick mode, as a user gets it: lightning-otel built as a wheel,
installed in a fresh virtual environment, run outside the clone. `lightning-otel demo --quick` starts its own
vLLM engine on the bundled model, evaluates the plain-OpenAI example agent, trains (SFT warm start + one GRPO
round), evaluates again and prints the before/after table."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = [pytest.mark.needs_engine, pytest.mark.heavy]  # it starts its own vLLM engine

REPO = Path(__file__).resolve().parent.parent


def source_copy(folder: Path) -> Path:
    """The files git tracks or would track (committed or not), copied: a wheel built in the clone itself would
    also pack what an earlier build left in its build/ folder (modules since moved or deleted)."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.split("\0")
    for name in filter(None, names):
        source, target = REPO / name, folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        elif source.is_file():
            shutil.copy2(source, target)
    return folder


def installed_from_wheel(folder: Path) -> Path:
    """A fresh venv holding lightning-otel as a built wheel (not the clone). Its dependencies are this
    environment's (a path entry, so nothing is downloaded); its console scripts are its own."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "-w", str(folder / "dist"), str(source_copy(folder / "src"))],
                   check=True, capture_output=True, timeout=600)
    (wheel,) = (folder / "dist").glob("lightning_otel-*.whl")
    venv = folder / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (Path(site) / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    import opentelemetry.instrumentation.version as instrumentation
    # --ignore-installed: the dependencies' copy is visible through the path entry, but its console script
    # (opentelemetry-instrument, which starts every agent) must be this venv's own.
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed",
                    "--disable-pip-version-check", str(wheel),
                    f"opentelemetry-instrumentation=={instrumentation.__version__}"],
                   check=True, capture_output=True, timeout=600)
    return venv


def test_quick_demo_runs_from_an_installed_wheel_outside_the_clone(tmp_path):
    venv = installed_from_wheel(tmp_path)
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import lightning_otel; print(lightning_otel.__file__)"],
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
