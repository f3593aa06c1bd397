"""The command line is quiet by default: other libraries' warnings, notices and weight-loading bars show only
with --verbose."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

LOAD = """
import sys, warnings
from lightning_otel.cli.quiet import quiet_third_parties
if sys.argv[1] == "quiet":
    quiet_third_parties()
from lightning_otel.serve.model import bundled_model_dir
import deepspeed
from transformers import AutoModelForCausalLM
warnings.warn("an old keyword", FutureWarning)
AutoModelForCausalLM.from_pretrained(bundled_model_dir())
import logging
logging.getLogger("DeepSpeed").error("a real error")
print("loaded")
"""
NOISE = ("Setting accelerator to CPU", "Loading weights", "an old keyword")


def run(mode: str) -> subprocess.CompletedProcess:
    from lightning_otel.cli.quiet import QUIET_ENV

    env = {k: v for k, v in os.environ.items() if k not in QUIET_ENV}
    return subprocess.run([sys.executable, "-c", LOAD, mode], capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.heavy
def test_third_party_noise_shows_only_when_asked():
    loud, quiet = run("loud"), run("quiet")
    assert loud.returncode == quiet.returncode == 0, loud.stderr + quiet.stderr
    for needle in NOISE:  # DeepSpeed logs to stdout, the others to stderr
        assert needle in loud.stdout + loud.stderr, needle  # else the test would pass with silent libraries
        assert needle not in quiet.stdout + quiet.stderr, (needle, quiet.stdout, quiet.stderr)
    assert "a real error" in quiet.stdout + quiet.stderr and quiet.stdout.strip().endswith("loaded")


def test_the_user_environment_wins():
    from lightning_otel.cli.quiet import quiet_third_parties

    env = {"TRANSFORMERS_VERBOSITY": "info"}
    quiet_third_parties(env)
    assert env["TRANSFORMERS_VERBOSITY"] == "info" and env["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
