"""The runner's side of the in-process mode: one long-lived worker process (lightning_otel.capture.agent_worker) that
calls the agent function for many rollouts at once, instead of one `opentelemetry-instrument` process per
rollout (about 1.5 s of process start each).

`AgentWorker.call(job, timeout_s)` sends one rollout and blocks until its result: the runner's pool threads
each call it, so the runner's --concurrency is the number of calls in flight. What can go wrong, and what
the result then says (the runner turns it into the rollout's `rollout_runs` row):
  - the function raised: status failed, from the worker (exception class, traceback);
  - no result within the timeout: status timeout. A thread cannot be killed, so the worker is retired: it
    gets no new jobs, finishes the calls it has, then is killed; the next call starts a fresh worker;
  - the worker died (os._exit, a segfault, out of memory): status error for the calls it had, with its
    exit status and last output; the next call starts a fresh worker, so the other rollouts still run.
The worker ends with the runner, even on SIGKILL: it stops when its jobs pipe closes (agent_worker.main).
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import threading
from dataclasses import dataclass, field

from lightning_otel.capture.agent_fn import AgentFunction
from lightning_otel.capture.agent_worker import JOBS_FD_ENV, RESULTS_FD_ENV
from lightning_otel.errors import UserError

log = logging.getLogger(__name__)
OUTPUT_TAIL = 4000
START_TIMEOUT_S = 180.0  # loading every instrumentation takes seconds on a busy 2-core machine


@dataclass
class _Slot:
    event: threading.Event = field(default_factory=threading.Event)
    result: dict | None = None


class _Process:
    """One worker process: its two pipes, a reader thread delivering results, the tail of its output."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        jobs_r, jobs_w = os.pipe()
        results_r, results_w = os.pipe()
        try:
            self.proc = subprocess.Popen(argv, env={**env, JOBS_FD_ENV: str(jobs_r), RESULTS_FD_ENV: str(results_w)},
                                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         pass_fds=(jobs_r, results_w), start_new_session=True)
        except OSError:
            for fd in (jobs_r, jobs_w, results_r, results_w):
                os.close(fd)
            raise
        os.close(jobs_r)
        os.close(results_w)  # ours closed, so the reader sees end of file when the worker's end closes
        self.jobs = os.fdopen(jobs_w, "w", encoding="utf-8")
        self.results = os.fdopen(results_r, "r", encoding="utf-8")
        self.lock = threading.Lock()
        self.pending: dict[str, _Slot] = {}
        self.ready = threading.Event()
        self.fatal: str | None = None
        self.dead = self.retiring = False
        self.output = ""
        threading.Thread(target=self._drain_output, name=f"agent-worker-{self.pid}-output", daemon=True).start()
        threading.Thread(target=self._read_results, name=f"agent-worker-{self.pid}-results", daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _drain_output(self) -> None:
        for chunk in iter(lambda: self.proc.stdout.read1(65536), b""):  # type: ignore[union-attr]
            text = chunk.decode("utf-8", "replace")
            log.debug("agent worker %d: %s", self.pid, text.rstrip())
            self.output = (self.output + text)[-OUTPUT_TAIL:]

    def _read_results(self) -> None:
        for line in self.results:
            try:
                message = json.loads(line)
            except json.JSONDecodeError:
                log.warning("agent worker %d sent a line that is not JSON: %.200s", self.pid, line)
                continue
            if message.get("type") == "result":
                self._deliver(message["id"], message)
            else:
                self.fatal = message.get("message") if message.get("type") == "fatal" else None
                self.ready.set()
        self._died()

    def _deliver(self, job_id: str, result: dict) -> None:
        with self.lock:
            slot = self.pending.pop(job_id, None)  # None: the call timed out and nobody waits any more
            done = self.retiring and not self.pending
        if slot is not None:
            slot.result = result
            slot.event.set()
        if done:
            self.kill()

    def _died(self) -> None:
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # it closed its results pipe but lives on: end it
            self.kill()
            code = self.proc.wait()
        with self.lock:
            self.dead = True
            orphans, self.pending = self.pending, {}
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        for slot in orphans.values():
            slot.result = {"status": "error", "error_class": "WorkerDied",
                           "stderr": f"the agent worker (pid {self.pid}) {how} while this rollout ran; "
                                     f"its last output:\n{self.output}"}
            slot.event.set()
        self.ready.set()

    def submit(self, job: dict) -> _Slot | None:
        """Send the job; None when this worker takes no more jobs (retiring or dead): ask for a new one."""
        slot = _Slot()
        with self.lock:
            if self.dead or self.retiring:
                return None
            self.pending[job["id"]] = slot
            try:  # under the lock: one whole line per job
                self.jobs.write(json.dumps(job) + "\n")
                self.jobs.flush()
            except (OSError, ValueError):
                pass  # the worker is gone (or being killed): the reader thread reports it to this slot
        return slot

    def abandon(self, job_id: str) -> None:
        """The job timed out: forget it, take no new jobs, and end once the other calls are done."""
        with self.lock:
            self.pending.pop(job_id, None)
            self.retiring = True
            done = not self.pending
        if done:
            self.kill()

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: the agent's children go too
        except (ProcessLookupError, PermissionError):
            pass
        with self.lock:  # after the SIGKILL: a write blocked on a full pipe has failed and let go of the lock
            try:
                self.jobs.close()
            except (OSError, ValueError):
                pass


class AgentWorker:
    """The live worker process for one agent function, replaced when it dies or a call hangs in it."""

    def __init__(self, agent: AgentFunction, argv: list[str], env: dict[str, str],
                 start_timeout_s: float = START_TIMEOUT_S):
        self.agent = agent
        # the worker's command (opentelemetry-instrument python -m lightning_otel.capture.agent_worker SPEC)
        self.argv = argv
        self.env = env
        self.start_timeout_s = start_timeout_s
        self.started = 0  # worker processes started, restarts included
        self._current: _Process | None = None
        self._all: list[_Process] = []
        self._lock = threading.Lock()

    def __enter__(self) -> AgentWorker:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> AgentWorker:
        """Start the first worker now; UserError when the function does not load there."""
        with self._lock:
            self._live()
        return self

    @property
    def pid(self) -> int | None:
        return self._current.pid if self._current is not None else None

    def _live(self) -> _Process:
        """The current worker, started when there is none (call with the lock held)."""
        if self._current is not None and not self._current.dead and not self._current.retiring:
            return self._current
        process = _Process(self.argv, self.env)
        self._all.append(process)
        self.started += 1
        if not process.ready.wait(self.start_timeout_s) or process.dead or process.fatal:
            process.kill()
            if process.fatal:
                raise UserError(process.fatal)
            raise UserError(f"the agent worker for {self.agent.spec!r} did not start within "
                            f"{self.start_timeout_s:g} s; its output:\n{process.output}")
        log.info("agent worker %d serves %s", process.pid, self.agent.spec)
        self._current = process
        return process

    def call(self, job: dict, timeout_s: float) -> dict:
        """Run one job ({"id", "task", "llm"}) and return its result (status ok|failed|timeout|error)."""
        slot = None
        while slot is None:  # a worker retired between _live() and submit() takes no job: use the next one
            try:
                with self._lock:
                    process = self._live()
            except UserError as exc:  # a restart that failed: this rollout is an error, the next call retries
                return {"status": "error", "error_class": "WorkerStartFailed", "stderr": str(exc)}
            slot = process.submit(job)
        if slot.event.wait(timeout_s):
            return slot.result  # type: ignore[return-value]
        process.abandon(job["id"])
        log.warning("rollout %s ran past %g s: agent worker %d is replaced", job["id"], timeout_s, process.pid)
        return {"status": "timeout", "error_class": "Timeout",
                "stderr": f"the agent function ran past {timeout_s:g} s; its thread cannot be stopped, so the "
                          f"worker (pid {process.pid}) was retired"}

    def close(self) -> None:
        with self._lock:
            processes, self._all, self._current = self._all, [], None
        for process in processes:
            process.kill()
            try:
                process.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.warning("agent worker %d did not end after SIGKILL", process.pid)
