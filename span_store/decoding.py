"""Decoding OTLP bodies in worker processes.

Decoding is pure Python over protobuf objects and holds the GIL; in the collector's own process it
starves the writer thread, whose DuckDB calls need the GIL between steps (measured: the writer spent
most of its time waiting for it). Worker processes decode into Arrow tables and hand them back, so the
collector process only moves bytes and writes. With `workers=0` decoding runs in the calling thread.
"""
from __future__ import annotations

import logging
import multiprocessing
import signal
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from lightning_otel.lifetime import parent_death_signal
from lightning_otel.span_store import otlp

log = logging.getLogger(__name__)
def decode(signal_name: str, encoding: str, body: bytes) -> otlp.Decoded:
    return otlp.DECODERS[(signal_name, encoding)](body)


class DecoderPool:
    def __init__(self, workers: int):
        self.workers = workers
        self._lock = threading.Lock()
        self._pool: ProcessPoolExecutor | None = None
        if workers:
            self._pool = self._new_pool()
            # Start the workers now, not on the first request.
            for future in [self._pool.submit(_warm) for _ in range(workers)]:
                future.result()

    def _new_pool(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=parent_death_signal(signal.SIGTERM, ignore_interrupt=True))

    def decode(self, signal_name: str, encoding: str, body: bytes) -> otlp.Decoded:
        """Decode; raises otlp.DecodeFailure for bad input, RuntimeError when a worker died."""
        if self._pool is None:
            return decode(signal_name, encoding, body)
        pool = self._pool
        try:
            return pool.submit(decode, signal_name, encoding, body).result()
        except BrokenProcessPool:
            with self._lock:
                if self._pool is pool:
                    log.error("a decoder process died; starting new ones")
                    self._pool = self._new_pool()
            raise RuntimeError("the decoder process died while decoding this request") from None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def _warm() -> None:
    return None
