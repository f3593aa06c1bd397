"""`make test-floors` and `make test-asan` as two tests of the suite, run last (conftest.py moves `runs_last`
tests to the end of the collection). Under `make test`'s two pytest-xdist workers the floors run ends the
worker without the engine tests, the sanitizer run the engine tests' worker (it joins their group), so both run
beside other tests instead of after the suite. Each is a pytest run of its own, in its own environment: the core
at its dependency floors (.venv-floors), and the C decoder's tests on an AddressSanitizer/UBSan build of it."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.heavy, pytest.mark.runs_last]

# What a make or pytest-xdist run above this one set: the sub-make must not inherit `make test`'s command-line
# variables (PYTEST_ARGS="-k ..." would select nothing at the floors), nor its pytest this worker's identity.
INHERITED = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "PYTEST_CURRENT_TEST", "PYTEST_XDIST_WORKER",
             "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID", "PYTEST_ADDOPTS")


def make(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in INHERITED}
    return subprocess.run(["make", "--no-print-directory", "-C", str(REPO), *args], env=env, capture_output=True,
                          text=True, timeout=1800)


@pytest.mark.parametrize("target,variables", [
    pytest.param("test-floors", (), id="test-floors"),
    # In the engine tests' group, as its last test (runs_last), so that under two workers each worker ends with
    # one of the two runs: both went to the other worker, which ran them one after the other for 4.5 minutes
    # while the engine tests' worker sat done (2-core AVX2 suite, 2026-12-07). FUZZ_SCALE=1: as many examples per
    # property test as the suite's own run of them (new ones: Hypothesis draws afresh each run); `make test-asan`
    # alone draws FUZZ_SCALE=2 times as many, about 100 s more of the 2-core suite's time.
    pytest.param("test-asan", ("FUZZ_SCALE=1",), id="test-asan", marks=pytest.mark.xdist_group("engine")),
])
def test_the_floors_and_the_sanitizer_build_pass(target, variables):
    # The environments come first (`make test` builds them all before pytest starts): a sub-make that rebuilt
    # .venv here would reinstall packages under the suite that is running from it.
    built = make("-q", "floors", "setup")
    assert built.returncode == 0, ("the project's venv or .venv-floors is missing or older than pyproject.toml: "
                                   "run `make prepare` (or `make test`, which does) before this test")
    result = make(target, *variables)
    # the tail holds pytest's summary and, for test-asan, the sanitizer's report; its seed is on the first lines
    out = result.stdout + result.stderr
    assert result.returncode == 0, f"make {target} failed:\n{out[:600]}\n...\n{out[-6000:]}"
    assert " passed" in out, out[-3000:]
