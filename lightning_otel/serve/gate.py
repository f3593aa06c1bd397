"""Pause, drain, swap, resume: how an engine changes policy while rollouts are running (async rounds).

Every model request the gateway answers holds the gate for its whole life (a stream until it is closed and
recorded). A swap (`engine.update_weights`, `update_adapters`, `load_model`, `use_base`) first closes the gate
to new requests, which wait (they are queued, never refused), then waits for the requests in flight to finish,
changes the weights and the policy version, and opens the gate again. So every request runs, and is recorded,
under exactly one policy version: the one its record names.

    gate = SwapGate()
    with gate.request():          # the gateway, around one model request
        ...
    with gate.swap():             # the engine, around a change of weights
        ...

A request never swaps, and a swap never nests in a request of the same thread (that would wait for itself).
"""
from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from typing import Iterator

log = logging.getLogger(__name__)
# How often a swap that waits for requests in flight says so.
DRAIN_REPORT_S = 30.0


class SwapGate:
    """A readers-writer gate that prefers the writer: requests are the readers, a swap the writer."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0  # requests in flight
        self._swapping = False
        self.swaps = 0  # swaps done
        self.drained = 0  # requests a swap waited for (in flight when it began), over all swaps
        self.held = 0  # requests that waited for a swap to end, over all swaps
        self.swap_seconds = 0.0  # time spent in swaps, draining included, over all swaps

    @property
    def in_flight(self) -> int:
        with self._cond:
            return self._active

    @contextmanager
    def request(self) -> Iterator[None]:
        """Hold the gate for one request: wait while a swap is pending or running, then run."""
        with self._cond:
            if self._swapping:
                self.held += 1
                self._cond.wait_for(lambda: not self._swapping)
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                if not self._active:
                    self._cond.notify_all()

    @contextmanager
    def swap(self) -> Iterator[None]:
        """Close the gate to new requests, wait for those in flight, run the swap, open the gate again."""
        started = time.perf_counter()
        with self._cond:
            self._cond.wait_for(lambda: not self._swapping)  # one swap at a time
            self._swapping = True
            self.drained += self._active
            while self._active:
                if not self._cond.wait(DRAIN_REPORT_S) and self._active:
                    log.info("the policy swap waits for %d request(s) in flight to finish", self._active)
        try:
            yield
        finally:
            with self._cond:
                self._swapping = False
                self.swaps += 1
                self.swap_seconds += time.perf_counter() - started
                self._cond.notify_all()
