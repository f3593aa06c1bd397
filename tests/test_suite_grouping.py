"""The suite's own scheduling: under pytest-xdist (`make test`, two workers, --dist loadgroup) every test that uses
the shared engine runs in one worker, so the session starts one vLLM engine, not one per worker, and a test
marked runs_last (the floors run) runs in the other worker beside them; a test that starts an
engine of its own (own_engine) is in no group; and what the tests start has OpenMP threads that sleep while they
wait. The grouping
rests on conftest.py's hook and on pytest-xdist renaming node ids, which some pytest releases ignore (9.2 with
xdist 3.8): there every engine test could land in either worker and each worker started an engine of its own."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

CONFTEST = '''
import pytest
from tests.conftest import pytest_collection_modifyitems, pytest_configure  # the suite's own hooks, as they are


@pytest.fixture(scope="session")
def engine():  # a stand-in: only its name matters to the hook
    return "engine"
'''

TESTS = '''
import json, os, time
from pathlib import Path

import pytest

LOG = Path(__file__).parent / "workers.jsonl"


def record(name, seconds):
    time.sleep(seconds)
    with LOG.open("a") as f:
        f.write(json.dumps({"test": name, "worker": os.environ.get("PYTEST_XDIST_WORKER"),
                            "wait_policy": os.environ.get("OMP_WAIT_POLICY")}) + "\\n")


@pytest.mark.parametrize("i", range(6))
def test_with_engine(engine, i):
    record(f"engine-{i}", 0.5)


@pytest.mark.runs_last
def test_floors_stand_in():
    record("last", 0.05)


@pytest.mark.parametrize("i", range(6))
def test_without(i):
    record(f"plain-{i}", 0.05)


@pytest.mark.needs_engine
@pytest.mark.own_engine
def test_own_engine(request):  # starts an engine of its own: free to run in either worker
    record("own" + ("-grouped" if request.node.get_closest_marker("xdist_group") else ""), 0.05)
'''


@pytest.mark.heavy  # 7 s alone (two xdist workers start), 18 s in the suite
def test_engine_tests_share_one_xdist_worker(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    runs_last: last in the collection\n"
                                         "    needs_engine: vLLM\n    own_engine: its own vLLM\n")
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_grouped.py").write_text(TESTS)
    env = {**{k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                             "--dist", "loadgroup", str(tmp_path)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    runs = [json.loads(line) for line in (tmp_path / "workers.jsonl").read_text().splitlines()]
    assert len(runs) == 14 and "own" in [r["test"] for r in runs]  # not in the engine tests' group
    engine_workers = {r["worker"] for r in runs if r["test"].startswith("engine-")}
    assert len(engine_workers) == 1 and None not in engine_workers, (
        f"the engine tests ran in workers {sorted(engine_workers)}: pytest-xdist's loadgroup no longer groups them "
        "(is pytest newer than pyproject.toml's dev extra allows?)")
    # The runs_last test (a stand-in for the floors and sanitizer runs) ran after the other tests without the
    # engine, in their worker, beside the engine tests and not after them: those take 3 s, the rest under 1 s.
    order = [r["test"] for r in runs]
    (last,) = [r for r in runs if r["test"] == "last"]
    assert last["worker"] not in engine_workers, runs
    assert max(order.index(f"plain-{i}") for i in range(6)) < order.index("last"), order
    assert order.index("last") < max(i for i, name in enumerate(order) if name.startswith("engine-")), order
    # what the tests start beside the other worker has OpenMP threads that sleep while they wait (conftest)
    assert {r["wait_policy"] for r in runs} == {"PASSIVE"}, runs
