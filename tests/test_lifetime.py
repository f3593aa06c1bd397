"""Children started with the parent-death signal end when their owner is SIGKILLed."""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from lightning_otel.lifetime import free_port, parent_death_signal

OWNER = textwrap.dedent("""
    import subprocess, sys, time
    from lightning_otel.lifetime import parent_death_signal
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                             preexec_fn=parent_death_signal())
    print(child.pid, flush=True)
    time.sleep(120)
""")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie waiting for init to reap it has ended
        return stat.read().split(") ")[1][0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_child_ends_when_its_owner_is_killed():
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    child = int(owner.stdout.readline())
    assert alive(child)
    owner.send_signal(signal.SIGKILL)
    owner.wait(10)
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)


def test_the_pool_initializer_pickles():
    # Process pools started by spawn or forkserver pickle their initializer.
    arm = pickle.loads(pickle.dumps(parent_death_signal(signal.SIGTERM, ignore_interrupt=True)))
    assert arm.args == (signal.SIGTERM, True)


def test_free_port_is_bindable():
    import socket
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
