"""The vLLM engine's whole process tree (API server, engine core, workers) dies with its owner, even when
the owner is SIGKILLed or its whole process group is signalled: the parent-death signal alone reaches only the
API server."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

OWNER = textwrap.dedent("""
    import time
    from lightning_otel.engine import EngineConfig, VLLMEngine, default_engine_python
    from lightning_otel.model import bundled_model_dir
    python = default_engine_python()
    engine = VLLMEngine(EngineConfig(model_dir=bundled_model_dir(python), python=python, kv_cache_gib=1))
    engine.start()
    print(engine.process.pid, flush=True)
    time.sleep(600)
""")


def group_members(group: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "-g", str(group)], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split()]


@pytest.mark.heavy
@pytest.mark.parametrize("how", ["SIGKILL to the owner", "SIGTERM to the owner's process group"])
def test_a_killed_owner_takes_the_engine_core_and_workers_with_it(how):
    # The owner leads a process group of its own, as a job a shell or job runner starts; a group signal (Ctrl-C,
    # `kill -- -PGID`) reaches every process in it, and used to take the watchdog down with the owner.
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        group = int(owner.stdout.readline())
        members = group_members(group)
        assert len(members) >= 2, f"expected the API server and its engine core in group {group}: {members}"
    finally:
        if how.startswith("SIGKILL"):
            os.kill(owner.pid, signal.SIGKILL)
        else:
            os.killpg(owner.pid, signal.SIGTERM)
        owner.wait(30)
    deadline = time.monotonic() + 30
    while group_members(group) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not group_members(group), f"left behind after the owner was killed: {group_members(group)}"
