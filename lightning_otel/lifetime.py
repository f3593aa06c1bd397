"""Child processes that end with the process that started them (a command owns its collector, engine,
gateway and agents: they die with it, also when it is SIGKILLed), and free ports on 127.0.0.1.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from typing import Callable

log = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1

try:
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
except (OSError, AttributeError):
    _PRCTL = None


def parent_death_signal(sig: int = signal.SIGKILL, ignore_interrupt: bool = False) -> Callable[[], None]:
    """A `preexec_fn` or process-pool initializer (picklable) for a child: it gets `sig` when its parent ends,
    even by SIGKILL (Linux's parent-death signal; elsewhere nothing). With `ignore_interrupt`, Ctrl-C reaches
    the parent only, which then shuts the child down itself."""
    return functools.partial(_arm, int(sig), ignore_interrupt)


def _arm(sig: int, ignore_interrupt: bool) -> None:
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, sig)
    else:
        log.debug("prctl(PR_SET_PDEATHSIG) unavailable")
    if ignore_interrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


# The parent-death signal reaches only the direct child; processes below it (vLLM's engine-core and workers)
# would outlive a SIGKILLed owner. The child runs in its own process group, and this watchdog (a child of the
# owner) kills the whole group as soon as the owner is gone. The watchdog is in a session of its own and
# ignores interrupts, so a signal to the owner's process group (Ctrl-C, `kill -- -PGID`, a job runner's stop)
# takes the owner down and leaves the watchdog to clean up after it.
WATCHDOG = """
import os, signal, sys, time
for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT"):
    signal.signal(getattr(signal, name), signal.SIG_IGN)
owner, group = int(sys.argv[1]), int(sys.argv[2])
while os.getppid() == owner:
    time.sleep(0.5)
try:
    os.killpg(group, signal.SIGKILL)
except ProcessLookupError:
    pass
"""


def start_group_watchdog(group: int) -> subprocess.Popen:
    """Kill process group `group` once this process is gone; stop the returned watchdog when done."""
    return subprocess.Popen([sys.executable, "-c", WATCHDOG, str(os.getpid()), str(group)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)


def lower_thread_priority(niceness: int) -> None:
    """Make the calling thread `niceness` steps nicer (Linux: a thread's nice value is its own); elsewhere a
    no-op. It cannot be undone without privileges, so call it on threads that do only the nicer work."""
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                           os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + niceness)
        except OSError as exc:
            log.debug("could not lower this thread's priority: %s", exc)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
