"""The README's main command, end to end in its quick mode: `lightning-otel demo --quick` starts its own
vLLM engine on the bundled model, evaluates the plain-OpenAI example agent, trains (SFT warm start + one
GRPO round), evaluates again and prints the before/after table."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.needs_engine, pytest.mark.heavy]  # it starts its own vLLM engine


def test_quick_demo_runs_end_to_end(tmp_path):
    cli = Path(sys.executable).parent / "lightning-otel"
    result = subprocess.run([str(cli), "demo", "--quick", "--folder", str(tmp_path)], capture_output=True,
                            text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "execution accuracy" in result.stdout and "transitions per episode" in result.stdout
    (folder,) = tmp_path.glob("run-*")
    before = json.loads((folder / "report-before" / "summary.json").read_text())
    after = json.loads((folder / "report-after" / "summary.json").read_text())
    assert before["rollouts"] == after["rollouts"] == 2
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
