"""What the optimiser runs on: the run's store (a collector on `<output_dir>/traces.duckdb`), the engine that
serves the policy (none for an outside endpoint, `base_url`: the gateway forwards to it), and, for an agent
function, one worker process for every rollout. `run_batch` runs the
rollouts of one candidate through a gateway that applies the candidate's patch (lightning_otel.rollouts.runner),
and reports each task's result as soon as its `n` rollouts are scored.
"""
from __future__ import annotations

import logging
import threading
from contextlib import ExitStack
from pathlib import Path
from typing import Callable

from lightning_otel.rollouts.packs import pack_for_reward
from lightning_otel.rollouts.runner import RolloutConfig, RolloutResult, Task, run_rollouts, write_tasks
from lightning_otel.serve.engine import PolicyEngine
from lightning_otel.train.apo.config import OptimizeConfig
from lightning_otel.train.apo.evaluation import TaskResult, score_of

log = logging.getLogger(__name__)


class Session:
    """Owns the collector, the engine (unless given) and the agent worker. Use as a context manager."""

    def __init__(self, config: OptimizeConfig, folder: Path, engine: PolicyEngine | None = None):
        self.config, self.folder = config, Path(folder)
        self.db = self.folder / "traces.duckdb"
        self.pack = pack_for_reward(config.reward or None, config.task_pack or None)
        self._engine = engine
        self._stack = ExitStack()
        self._worker = None
        self._batches = 0

    def __enter__(self) -> "Session":
        from lightning_otel.span_store.collector import Collector, private_config

        self.folder.mkdir(parents=True, exist_ok=True)
        self.collector = Collector(private_config(self.db))
        self.collector.start()
        self._stack.callback(self.collector.close)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    @property
    def engine(self) -> PolicyEngine:
        if self._engine is None:
            from lightning_otel.serve.engine import EngineConfig, default_engine_python, start_or_attach
            from lightning_otel.serve.model import resolve_model

            c = self.config
            python = c.engine_python or default_engine_python()
            self._engine = start_or_attach(EngineConfig(model_dir=resolve_model(c.model, python), python=python,
                                                        log_path=self.folder / "engine.log"), c.engine_url, self._stack)
        return self._engine

    def _agent_worker(self):
        from lightning_otel.capture.agent_fn import load_agent_function, parse_agent_function
        from lightning_otel.rollouts.runner import start_agent_worker

        if self._worker is None and (agent := parse_agent_function(self.config.agent)) is not None:
            load_agent_function(agent)
            info = self.collector.info
            self._worker = start_agent_worker(agent, info.url, info.ingest_token)
            self._stack.callback(self._worker.close)
        return self._worker

    def rollout_config(self, tasks_file: Path, patch: Path | None) -> RolloutConfig:
        c = self.config
        return RolloutConfig(tasks=tasks_file, agent=c.agent, n=c.n, concurrency=c.concurrency, db=self.db,
                             reward=c.reward, task_pack=self.pack, data_dir=Path(c.data_dir) if c.data_dir else None,
                             rollout_timeout_s=c.rollout_timeout_s, max_tokens=c.max_tokens,
                             temperature=c.temperature, work_dir=self.folder / "work",
                             chat_template=Path(c.chat_template) if c.chat_template else None,
                             tool_format=c.tool_format or None, prompt=patch, base_url=c.base_url or None,
                             base_model=c.base_model or None, api_key_env=c.api_key_env or None)

    def run_batch(self, key: str, patch: Path | None, tasks: list[Task],
                  report: Callable[[TaskResult], None]) -> None:
        """The rollouts of `tasks` under `patch`, each task reported when its n rollouts are scored."""
        self._batches += 1
        tasks_file = write_tasks(tasks, self.folder / "batches" / f"{self._batches:04d}-{key}.jsonl")
        pending: dict[str, list[RolloutResult]] = {t.task_id: [] for t in tasks}
        lock = threading.Lock()

        def progress(result: RolloutResult, done: int, total: int) -> None:
            with lock:
                got = pending[result.task_id]
                got.append(result)
                if len(got) < self.config.n:
                    return
                got.sort(key=lambda r: r.attempt)
            rewards = [r.reward for r in got]
            report(TaskResult(task_id=result.task_id, score=score_of(rewards), rewards=rewards,
                              rollout_ids=[r.rollout_id for r in got], outputs=[r.final_output for r in got],
                              statuses=[r.status for r in got],
                              errors=[r.stderr_tail[-300:] for r in got if r.status != "ok" and r.stderr_tail]))

        run_rollouts(self.rollout_config(tasks_file, patch), progress,
                     engine=None if self.config.base_url else self.engine, worker=self._agent_worker())

    def reflection_url(self) -> tuple[str, str, str]:
        """The default reflection model: the model the agent runs on (the served policy's own endpoint, or the
        outside one), its model name, and the environment variable with its key."""
        c = self.config
        if c.base_url:
            return c.base_url, c.base_model, c.api_key_env or c.reflection_api_key_env
        engine = self.engine
        return f"{engine.url}/v1", engine.model_name, c.reflection_api_key_env  # type: ignore[attr-defined]


__all__ = ["Session"]
