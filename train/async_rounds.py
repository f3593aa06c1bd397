"""Async rounds (`max_staleness = k >= 1`): the rollouts of the next k rounds run in the background while
this round trains, on the same engine, through the same gateway path as synchronous rounds.

    ahead = RoundsAhead(run_round)      # run_round(r, stop) -> the round's RolloutSummary
    ahead.schedule([r + 1])             # round r's rollouts are done: start round r+1's, then train round r
    got = ahead.take(r + 1)             # round r+1: its rollouts (waits for them), or None if never scheduled
    ahead.close()                       # rollouts not begun are skipped, those running finish

Round r+1 draws the same tasks, in the same order, as a synchronous run (train/pool.round_tasks depends only
on seed and round). Its rollouts begin under the policy round r trains from and, once round r's checkpoint
is served (the engine's pause/drain/swap: lightning_otel/serve/gate.py), continue under the next: every
gateway record keeps the exact version that generated it. When round r+1 trains, the learner is at most k
versions ahead of any of its records; a group (task, policy version) with a record further behind is dropped
(drop_stale_groups) and counted. The loss corrects for the older sampler with truncated importance sampling
against the recorded logprobs (`tis_cap`, required with k >= 1).

The background rounds run one after the other in one thread. An exception there is raised again, with the
round it happened in, by the take() or wait_idle() that waits for that round.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import polars as pl

from lightning_otel.errors import UserError

log = logging.getLogger(__name__)
# How long close() waits for the rollouts already running to finish.
CLOSE_TIMEOUT_S = 600.0

# Every gateway record of some rollouts ($listed: SQL literals): its policy version and completion tokens.
SQL_RECORD_VERSIONS = """
SELECT rollout_id, policy_version, len(completion_ids) AS tokens
FROM trajectory_calls WHERE rollout_id IN ($listed) AND policy_version IS NOT NULL
"""


@dataclass
class Ahead:
    """A round's rollouts run in the background: their summary, and how long they took."""
    summary: Any  # lightning_otel.rollouts.runner.RolloutSummary
    seconds: float


class RoundsAhead:
    """Rounds whose rollouts run ahead, one after the other, in one background thread."""

    def __init__(self, run_round: Callable[[int, threading.Event], Any]):
        self._run_round = run_round
        self._cond = threading.Condition()
        self._queue: list[int] = []
        self._scheduled: set[int] = set()
        self._done: dict[int, Ahead | BaseException] = {}
        self._running: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def busy(self) -> bool:
        """Whether rollouts are running or waiting to run in the background."""
        with self._cond:
            return self._running is not None or bool(self._queue)

    def schedule(self, rounds) -> None:
        """Run these rounds' rollouts in the background, in order, after those already scheduled."""
        with self._cond:
            for r in rounds:
                if r not in self._scheduled:
                    self._scheduled.add(r)
                    self._queue.append(r)
            self._cond.notify_all()
            if self._thread is None and self._queue:
                self._thread = threading.Thread(target=self._work, name="rounds-ahead", daemon=True)
                self._thread.start()

    def take(self, r: int) -> Ahead | None:
        """Round r's rollouts once they are done (None: never scheduled); their error, raised here."""
        with self._cond:
            if r not in self._scheduled:
                return None
            self._cond.wait_for(lambda: r in self._done)
            self._scheduled.discard(r)
            done = self._done.pop(r)
        if isinstance(done, BaseException):
            raise_from_background(r, done)
        return done

    def wait_idle(self) -> None:
        """Wait until nothing runs in the background (before a phase that must run alone, validation); an error
        of a round run ahead is raised here."""
        with self._cond:
            self._cond.wait_for(lambda: self._running is None and not self._queue)
            failed = next(((r, x) for r, x in sorted(self._done.items()) if isinstance(x, BaseException)), None)
        if failed is not None:
            raise_from_background(*failed)

    def close(self) -> None:
        """Skip what has not begun, let the running rollouts finish, and end the thread."""
        self._stop.set()
        with self._cond:
            self._queue.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(CLOSE_TIMEOUT_S)
            if self._thread.is_alive():
                log.warning("the rollouts run ahead did not finish within %.0f s of the run's end", CLOSE_TIMEOUT_S)

    def _work(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stop.is_set())
                if self._stop.is_set():
                    return
                r = self._running = self._queue.pop(0)
            started = time.perf_counter()
            try:
                summary = self._run_round(r, self._stop)
                outcome: Ahead | BaseException = Ahead(summary, time.perf_counter() - started)
            except BaseException as exc:  # noqa: BLE001 - raised again in the main thread by take()
                log.error("the rollouts of round %d, run ahead, failed: %s", r + 1, exc)
                outcome = exc
            with self._cond:
                self._done[r] = outcome
                self._running = None
                if isinstance(outcome, BaseException):
                    self._queue.clear()  # later rounds would only fail the same way
                self._cond.notify_all()


def raise_from_background(r: int, exc: BaseException) -> None:
    """Raise the error of round r's background rollouts in the caller's thread, saying where it came from."""
    where = f"the rollouts of round {r + 1}, run in the background (max_staleness)"
    if isinstance(exc, UserError):
        raise UserError(f"{where}: {exc}") from exc
    raise RuntimeError(f"{where} failed: {type(exc).__name__}: {exc}") from exc


# ---- staleness ------------------------------------------------------------------------------------------


def record_versions(db: Path, rollout_ids) -> pl.DataFrame:
    """(rollout_id, policy_version, tokens) of every gateway record of these rollouts."""
    from lightning_otel.span_store import client

    ids = sorted(rollout_ids)
    if not ids:
        return pl.DataFrame(schema={"rollout_id": pl.String, "policy_version": pl.Int64, "tokens": pl.Int64})
    listed = ", ".join(client.sql_literal(i) for i in ids)
    return client.query(SQL_RECORD_VERSIONS.replace("$listed", listed), db)


def staleness(versions: pl.DataFrame, current: int) -> dict:
    """How far behind the policy being trained (`current`) the records are: {versions behind: LLM calls} and
    {versions behind: completion tokens}, keys as strings (JSON)."""
    calls: Counter = Counter()
    tokens: Counter = Counter()
    for version, count in zip(versions["policy_version"], versions["tokens"]):
        calls[str(current - int(version))] += 1
        tokens[str(current - int(version))] += int(count or 0)
    return {"staleness": dict(sorted(calls.items(), key=lambda kv: int(kv[0]))),
            "staleness_tokens": dict(sorted(tokens.items(), key=lambda kv: int(kv[0])))}


def drop_stale_groups(frame: pl.DataFrame, versions: pl.DataFrame, current: int,
                      max_staleness: int) -> tuple[pl.DataFrame, int]:
    """The transitions without the groups (task_id, policy_version) that hold a rollout with a record more than
    `max_staleness` versions behind `current`, and how many groups were dropped."""
    stale = versions.filter(pl.lit(current) - pl.col("policy_version") > max_staleness).select("rollout_id").unique()
    groups = frame.join(stale, on="rollout_id", how="semi").select("task_id", "policy_version").unique()
    kept = frame.join(groups, on=["task_id", "policy_version"], how="anti")
    if groups.height:
        log.warning("dropped %d group(s), %d transition(s): a record is more than %d policy version(s) behind "
                    "version %d", groups.height, frame.height - kept.height, max_staleness, current)
    return kept, groups.height
