"""The in-process mode's worker process: calls an agent function (lightning_otel.capture.agent_fn) for many rollouts,
each in a thread of its own, in one long-lived process.

    opentelemetry-instrument python -m lightning_otel.capture.agent_worker examples/openai_sql/agent.py:run

The runner (lightning_otel.rollouts.inprocess) starts it under opentelemetry-instrument with the same environment the
subprocess mode gives agents, less the per-rollout resource attributes: here each call runs inside
`lightning_otel.rollout(task_id=, rollout_id=, attempt=)`, whose baggage the distro's span processor copies
onto every span the call starts, so the store groups them exactly as it groups a subprocess's spans.

Protocol: two pipes of their own (file descriptors in LIGHTNING_WORKER_JOBS_FD / LIGHTNING_WORKER_RESULTS_FD),
so nothing the agent prints, nor any library writing to fd 1, can corrupt it. JSON lines:
  jobs     {"id": rollout_id, "task": {...}, "llm": {LLM fields}}; end of file = stop now.
  results  first {"type": "ready", "pid": N} or {"type": "fatal", "message": "..."} (the function does not
           load), then per job {"type": "result", "id", "status": "ok"|"failed", "output", "error_class",
           "stdout", "stderr"}, written only after the tracer provider was flushed (the runner scores the
           rollout from its stored spans as soon as it reads the result).
What a call prints goes to its own buffers (a context variable, so asyncio tasks inside the call are
captured too; threads the agent starts itself print to the worker's own output).

Imported into the agent process: stays light (no duckdb, no torch).
"""
from __future__ import annotations

import contextvars
import io
import json
import logging
import os
import sys
import threading
import traceback
from typing import Any, Callable

from opentelemetry import trace

from lightning_otel.capture.agent_fn import LLM, load_agent_function, parse_agent_function
from lightning_otel.capture.context import rollout
from lightning_otel.errors import UserError

JOBS_FD_ENV = "LIGHTNING_WORKER_JOBS_FD"
RESULTS_FD_ENV = "LIGHTNING_WORKER_RESULTS_FD"
TAIL_CHARS = 4000
FLUSH_TIMEOUT_MS = 30_000

log = logging.getLogger(__name__)
_capture: contextvars.ContextVar[tuple[io.StringIO, io.StringIO] | None] = \
    contextvars.ContextVar("lightning_capture", default=None)


class _CallStream(io.TextIOBase):
    """sys.stdout / sys.stderr: to the current call's buffer inside a call, to the real stream elsewhere."""

    def __init__(self, real, index: int):
        self.real, self.index = real, index

    def write(self, text: str) -> int:
        buffers = _capture.get()
        if buffers is None:
            return self.real.write(text)
        return buffers[self.index].write(text)

    def flush(self) -> None:
        self.real.flush()

    def fileno(self) -> int:
        return self.real.fileno()

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.real, "encoding", "utf-8")


class _Results:
    """The results pipe: one whole JSON line per message, whichever thread sends it."""

    def __init__(self, fd: int):
        self.file = os.fdopen(fd, "w", encoding="utf-8")
        self.lock = threading.Lock()

    def send(self, message: dict) -> None:
        line = json.dumps(message, default=str) + "\n"
        with self.lock:
            self.file.write(line)
            self.file.flush()


def flush_spans() -> None:
    """Export every span ended so far (the SDK's flush holds the export lock, so a concurrent flush by
    another call waits for this one's spans to be sent, and the collector answers after committing)."""
    flush = getattr(trace.get_tracer_provider(), "force_flush", None)
    if flush is not None and not flush(FLUSH_TIMEOUT_MS):
        log.warning("lightning-otel worker: flushing spans timed out; the rollout's spans may be incomplete")


def run_job(fn: Callable[[dict, LLM], Any], job: dict, results: _Results) -> None:
    """One rollout: the call inside lightning_otel.rollout(), its output captured, spans flushed, result sent."""
    llm = LLM(**job["llm"])
    out, err = io.StringIO(), io.StringIO()
    _capture.set((out, err))  # this thread's own context: other calls are not affected
    status, output, error_class = "ok", None, None
    try:
        with rollout(task_id=llm.task_id, rollout_id=llm.rollout_id, attempt=llm.attempt):
            value = fn(dict(job["task"]), llm)
        output = None if value is None else str(value)
    except BaseException as exc:  # noqa: BLE001 - SystemExit from the agent is its failure too
        status, error_class = "failed", type(exc).__name__
        # From the agent's own frame on: the worker's frame above it says nothing to the user.
        err.write("".join(traceback.format_exception(type(exc), exc, exc.__traceback__.tb_next)))
    finally:
        _capture.set(None)
    flush_spans()
    results.send({"type": "result", "id": job["id"], "status": status, "output": output,
                  "error_class": error_class, "stdout": out.getvalue()[-TAIL_CHARS:],
                  "stderr": err.getvalue()[-TAIL_CHARS:]})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    results = _Results(int(os.environ[RESULTS_FD_ENV]))
    jobs = os.fdopen(int(os.environ[JOBS_FD_ENV]), "r", encoding="utf-8")
    sys.stdout, sys.stderr = _CallStream(sys.stdout, 0), _CallStream(sys.stderr, 1)
    agent = parse_agent_function(argv[0]) if argv else None
    if agent is None:
        results.send({"type": "fatal", "message": f"not an agent function spec: {argv!r}"})
        return 2
    try:
        fn = load_agent_function(agent)
    except UserError as exc:
        results.send({"type": "fatal", "message": str(exc)})
        return 2
    results.send({"type": "ready", "pid": os.getpid()})
    for line in jobs:
        job = json.loads(line)
        threading.Thread(target=run_job, args=(fn, job, results), name=f"rollout-{job['id']}", daemon=True).start()
    # End of the jobs pipe: the runner is done, or dead (even by SIGKILL: the kernel closes its end), so this
    # is also the watchdog. A parent-death signal would not do: it fires when the runner's *thread* that
    # started the worker ends, and workers are restarted from the runner's pool threads.
    flush_spans()
    os._exit(0)  # hung agent threads and non-daemon threads they started must not keep the process alive


if __name__ == "__main__":
    sys.exit(main())
