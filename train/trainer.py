"""Rounds of rollout and GRPO (DESIGN §5), and the run folder that makes them resumable.

    lightning-otel train --config train.toml            # or key=value arguments
    lightning-otel train --offline --db traces.duckdb   # from traces already stored (train/offline.py)

Each round: the engine serves the current policy through the gateway -> the runner executes the agent over
`tasks_per_round` tasks x `n` samples -> spans land in the run's store -> the compiler builds transitions
(groups of (task, policy version)) -> GRPO steps under DeepSpeed -> the adapter is saved and hot-loaded by
the engine as policy version r. An optional SFT warm start runs before round 1 (train/sft.py). With
`max_staleness` >= 1 the next rounds' rollouts run in the background while a round trains (async rounds:
train/async_rounds.py); the engine swaps policies between requests (lightning_otel/serve/gate.py).

The run folder: config.toml (resolved config), run.json (progress: rounds completed, last and best
checkpoints; written last, atomically, so a killed run resumes from its last completed round), metrics.jsonl,
steps.jsonl, prompt.json (with `prompt`: the patch file the rollouts ran under; each round's record lists
the prompt versions its gateway records carry, `prompt_versions`), the trackers' folders (tensorboard/, wandb/,
mlruns/; trackers.json), reward_curve.png,
traces.duckdb, rounds/round-NNNN/tasks.jsonl, checkpoints/<name>/{adapter|model, state}, pool.jsonl (with
pool_min_pass / pool_max_pass: every task's pass rate under the starting policy and whether the rounds use it);
while the SFT warm start runs, its progress (rounds/sft/, checkpoints/sft-partial-*; train/sft.py).
Randomness is derived from (seed, round), so a resumed round draws the same tasks and batch order.
"""
from __future__ import annotations

import json
import logging
import shutil
import time
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from lightning_otel.errors import UserError
from lightning_otel.serve.prompts import VERSION_ATTRIBUTE
from lightning_otel.rollouts.packs import pack_for_reward
from lightning_otel.rollouts.runner import RolloutConfig, Task, load_tasks, run_rollouts, write_tasks
from lightning_otel.serve.engine import PolicyEngine
from lightning_otel.serve.hub import parse_hub_id, recorded_model
from lightning_otel.train.adapter_rounds import optimize_adapters, split_by_adapter
from lightning_otel.train.async_rounds import RoundsAhead, drop_stale_groups, record_versions, staleness
from lightning_otel.train.checkpoints import merge_adapter
from lightning_otel.train.config import TrainConfig, render_toml
from lightning_otel.train.metrics import open_metrics
from lightning_otel.train.optimize import optimize
from lightning_otel.train.pool import kept_tasks, pass_rates, pool_record, round_tasks
from lightning_otel.train.run import RunFolder, RunState, check_resume, write_atomically
from lightning_otel.train.transitions.compile import CompileConfig, compile_transitions

log = logging.getLogger(__name__)



class Trainer:
    """Owns the run: its store (collector), the engine, the learner. Use as a context manager."""

    def __init__(self, config: TrainConfig, engine: PolicyEngine | None = None,
                 progress: Callable[[str, int, int], None] | None = None):
        self.config, self.progress = config, progress or (lambda label, done, total: None)
        self.folder = RunFolder(Path(config.output_dir))
        self.state = check_resume(config, self.folder)
        self.tasks = load_tasks(Path(config.tasks)) if config.tasks else []
        if not self.tasks and config.rounds:
            raise UserError("train config: `tasks` is empty: give a JSONL task file (one task per line)")
        if config.rounds and not config.agent.strip():
            raise UserError("train config: `agent` is empty: give the command that runs your agent")
        if config.rounds and not config.reward.strip():
            raise UserError("train config: `reward` is not set: rounds score each rollout with a reward function; "
                            "set reward to a name a task pack registers (spider_exec, number_match), to "
                            "module:function or to path/to/file.py:function")
        self.pack = pack_for_reward(config.reward or None, config.task_pack or None)
        if config.sft_tasks:
            from lightning_otel.train.sft import check_labels

            check_labels(config)
        self._stack = ExitStack()
        self._engine = engine
        self._worker = None  # the agent function's worker process, when the agent is one
        self._ahead: RoundsAhead | None = None  # the rounds whose rollouts run in the background (max_staleness)
        self.db = self.folder.path / "traces.duckdb"

    def __enter__(self) -> "Trainer":
        try:
            return self._open()
        except BaseException as exc:  # what was started so far (the collector, the tracker runs) stops
            self._stack.__exit__(type(exc), exc, exc.__traceback__)
            raise

    def _open(self) -> "Trainer":
        from lightning_otel.serve.engine import default_engine_python
        from lightning_otel.serve.model import resolve_model
        from lightning_otel.span_store.collector import Collector, private_config
        from lightning_otel.train.learner import Learner

        c = self.config
        self.folder.path.mkdir(parents=True, exist_ok=True)
        python = c.engine_python or default_engine_python()
        # A resumed run keeps the hub commit it started on, even if the model's branch has moved since.
        resumed_hub = self.state is not None and parse_hub_id(self.state.model) is not None
        self.model_dir = resolve_model(self.state.model if resumed_hub else c.model, python)
        if c.prompt:
            keep_prompt(Path(c.prompt).expanduser(), self.folder.path, resumed=self.state is not None)
        c.save(self.folder.path / "config.toml")
        log.info("train config:\n%s", render_toml(c))
        self.collector = collector = Collector(private_config(self.db))  # agents get its ingest token only
        collector.start()
        self._stack.callback(collector.close)
        # Before the learner: a tracker that cannot start (no W&B login) stops the run in seconds.
        self.metrics = open_metrics(c, self.folder.path, resume=self.state is not None)
        self._stack.push(lambda kind, *_: self.metrics.close(failed=kind is not None))  # the tracker runs' status
        self.learner = Learner(self.model_dir, c)
        self._stack.callback(self.learner.close)
        if self.state is not None and self.state.last:
            # GRPO's first round after the SFT warm start starts with a fresh optimizer (see run()).
            grpo_starts = self.state.sft_done and self.state.rounds_completed == 0
            self.learner.load_state(self.folder.path / self.state.last / "state", optimizer=not grpo_starts)
            log.info("resuming after %s (round %d of %d)", self.state.last, self.state.rounds_completed,
                     c.rounds)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.__exit__(*exc)  # with the exception, if any: the tracker runs end as failed

    # ---- the engine ------------------------------------------------------------------------------------

    @property
    def engine(self):
        if self._engine is not None and Path(self._engine.base_dir).resolve() != Path(self.model_dir).resolve():
            raise UserError(f"the given engine serves {self._engine.config.model_dir}, but this run trains "
                            f"{self.model_dir}; give an engine on the same base model")
        if self._engine is None:
            from lightning_otel.serve.engine import start_or_attach

            self._engine = start_or_attach(engine_config(self.config, self.model_dir, self.folder.path / "engine.log"),
                                           self.config.engine_url, self._stack)
        return self._engine

    def _serve(self, checkpoint: Path, version: int) -> None:
        if self.config.full_finetune:
            self.engine.load_model(checkpoint / "model", version)
        elif self.config.serve_merged:
            merged = checkpoint / "merged"
            if not (merged / "config.json").is_file():
                merge_adapter(self.model_dir, checkpoint / "adapter", merged)
            self.engine.load_model(merged, version)
        elif self.config.adapters:  # one adapter per agent: all of them, each under its name
            self.engine.update_adapters({name: checkpoint / "adapters" / name for name in self.config.adapters},
                                        version)
        else:
            self.engine.update_weights(checkpoint / "adapter", version)

    # ---- rollouts ----------------------------------------------------------------------------------------

    def rollouts(self, tasks_file: Path, n: int, label: str, temperature: float | None, max_tokens: int,
                 max_calls: int | None = None, reward: bool = True, answers: list[str] | None = None,
                 progress: Callable[[int, int], None] | None = None, stop=None):
        """Run `n` rollouts of every task in `tasks_file`; `progress(done, total)` replaces the default report
        (this call's rollouts under `label`) when a phase spans several calls; once `stop` (a threading.Event)
        is set, the rollouts not yet begun are skipped."""
        c = self.config
        progress = progress or (lambda done, total: self.progress(label, done, total))
        config = RolloutConfig(tasks=tasks_file, agent=c.agent, n=n, concurrency=c.concurrency, db=self.db,
                               reward=c.reward if reward else None, task_pack=self.pack,
                               data_dir=Path(c.data_dir) if c.data_dir else None,
                               rollout_timeout_s=c.rollout_timeout_s, max_tokens=max_tokens,
                               temperature=temperature, work_dir=self.folder.path / "work", max_calls=max_calls,
                               answers=answers, chat_template=Path(c.chat_template) if c.chat_template else None,
                               tool_format=c.tool_format or None, prompt=Path(c.prompt) if c.prompt else None,
                               adapters=c.adapters)
        return run_rollouts(config, lambda result, done, total: progress(done, total), engine=self.engine,
                            worker=self._agent_worker(), stop=stop)

    def _round_tasks(self, r: int) -> Path:
        c = self.config
        return write_tasks(round_tasks(self.tasks, r, c.tasks_per_round, c.seed),
                           self.folder.path / "rounds" / f"round-{r + 1:04d}" / "tasks.jsonl")

    def _run_ahead(self, r: int) -> None:
        """Async rounds: start the rollouts of the rounds after r, up to max_staleness of them, in the background
        (train/async_rounds.py), on the engine that keeps serving while round r trains."""
        c = self.config
        if self._ahead is None:
            self._agent_worker()  # started here, not in the background thread
            self._ahead = RoundsAhead(self._rollouts_ahead)
            self._stack.callback(self._ahead.close)  # before the engine and the collector stop
        self._ahead.schedule(range(r + 1, min(r + 1 + c.max_staleness, c.rounds)))

    def _rollouts_ahead(self, r: int, stop):
        c = self.config
        label = f"round {r + 1}/{c.rounds} rollouts (in the background)"
        return self.rollouts(self._round_tasks(r), c.n, label, c.temperature, c.max_tokens, stop=stop,
                             progress=lambda done, total: done >= total and self.progress(label, done, total))

    def _agent_worker(self):
        """For an agent function: one worker process for every rollout of the run (None for a command)."""
        from lightning_otel.capture.agent_fn import load_agent_function, parse_agent_function
        from lightning_otel.rollouts.runner import start_agent_worker

        if self._worker is None and (agent := parse_agent_function(self.config.agent)) is not None:
            load_agent_function(agent)  # a clear error here, before the worker tries
            info = self.collector.info
            self._worker = start_agent_worker(agent, info.url, info.ingest_token)
            self._stack.callback(self._worker.close)
        return self._worker

    # ---- the run -----------------------------------------------------------------------------------------

    def run(self) -> RunState:
        c = self.config
        state = self.state or RunState(model=recorded_model(self.model_dir))
        state.config = asdict(c)
        if state.last and c.rounds > state.rounds_completed:
            self._serve(self.folder.path / state.last, state.policy_version)
        elif not state.last and (c.rounds or c.sft_tasks) and self.engine.policy_version != 0:
            self.engine.use_base()  # a fresh run starts from the base model, whatever a shared engine served
        if c.sft_tasks and not state.sft_done:
            from lightning_otel.train.sft import drop_partial, warm_start

            record = warm_start(self)
            self._checkpoint(state, "sft")
            state.sft_done = True
            self._commit(state, {"round": 0, "phase": "sft", **record})
            drop_partial(self.folder.path)
            self.learner.fresh_optimizer()  # GRPO does not inherit SFT's moments (nor does a resumed run)
        if c.filters_pool and c.rounds > state.rounds_completed:
            self.tasks = self.filter_pool(state)
        if c.val_tasks and c.rounds > state.rounds_completed and not state.validated_start:
            # The curve's first point: the policy GRPO starts from (the base model, or the SFT warm start).
            record = {"round": state.rounds_completed, "phase": "validation",
                      "policy_version": state.policy_version, **self.validate(state)}
            state.validated_start = True
            self._commit(state, record)
        for r in range(state.rounds_completed, c.rounds):
            record = self.train_round(r, state)
            gate = self.engine.gate
            swaps, drained, held, seconds = gate.swaps, gate.drained, gate.held, gate.swap_seconds
            if record["steps"]:
                self._checkpoint(state, f"round-{r + 1:04d}")
            else:
                # Untouched weights are not a new policy: no checkpoint, the engine keeps serving the same version.
                state.rounds_without_step += 1
                log.warning("round %d/%d took no optimizer step, the policy stays version %d: %s", r + 1, c.rounds,
                            state.policy_version, record["no_step"])
            # the change of policy: the requests in flight it waited for, and those it held (async rounds)
            record.update(swap_seconds=gate.swap_seconds - seconds if gate.swaps > swaps else None,
                          swap_drained_requests=gate.drained - drained, swap_held_requests=gate.held - held)
            state.rounds_completed = r + 1
            if c.val_tasks and (r + 1) % c.val_every == 0:
                if self._ahead is not None:
                    self._ahead.wait_idle()  # validation runs alone, on the policy just served
                record.update(self.validate(state))
            self._commit(state, record)
        return state

    def filter_pool(self, state: RunState) -> list[Task]:
        """The tasks the rounds draw from (train/pool.py): measured once, before round 1 (n samples of every
        task at the rollout temperature), and kept in pool.jsonl, which a resumed run reads back."""
        c = self.config
        pool_file = self.folder.path / "pool.jsonl"
        if not state.pool_done:
            started = time.perf_counter()
            summary = self.rollouts(write_tasks(self.tasks, self.folder.path / "rounds" / "pool" / "tasks.jsonl"),
                                    c.n, "pool pass rates", c.temperature, c.max_tokens)
            rows = pass_rates(self.tasks, summary.results, c.pool_pass_reward, c.pool_min_pass, c.pool_max_pass)
            write_atomically(pool_file, "".join(json.dumps(row) + "\n" for row in rows))
            state.pool_done = True
            self._commit(state, {"round": state.rounds_completed, "phase": "pool", **pool_record(rows),
                                 "rollout_seconds": time.perf_counter() - started})
        tasks = kept_tasks(self.tasks, pool_file, c.pool_pass_reward, c.pool_min_pass, c.pool_max_pass)
        log.info("pool filter: %d of %d tasks kept (pass rate in [%s, %s])", len(tasks), len(self.tasks),
                 c.pool_min_pass, c.pool_max_pass)
        return tasks

    def _checkpoint(self, state: RunState, name: str) -> None:
        """Save the policy and the optimizer state as checkpoint `name`, and serve it as the next version."""
        folder = self.folder.checkpoint(name)
        self.learner.save_policy(folder)
        self.learner.save_state(folder / "state")
        version = state.policy_version + 1
        (folder / "policy.json").write_text(json.dumps({"policy_version": version}))
        if self.config.rounds > state.rounds_completed:
            self._serve(folder, version)
        state.previous, state.last = state.last, str(folder.relative_to(self.folder.path))
        state.policy_version = version
        if not self.config.val_tasks:
            state.best = state.last

    def _commit(self, state: RunState, record: dict) -> None:
        """Record the finished step: run.json first (the resume point), then the metrics; only then drop the
        previous checkpoint's optimizer state (its policy stays, for evaluation)."""
        previous, state.previous = state.previous, None
        self.folder.save(state)
        self.metrics.write(record)
        if previous and previous != state.last:
            shutil.rmtree(self.folder.path / previous / "state", ignore_errors=True)
            shutil.rmtree(self.folder.path / previous / "merged", ignore_errors=True)  # a serving copy only

    def train_round(self, r: int, state: RunState) -> dict:
        c = self.config
        torch.manual_seed(c.seed * 100_003 + r)
        tasks_file = self._round_tasks(r)
        started = time.perf_counter()
        ahead = self._ahead.take(r) if self._ahead is not None else None  # run in the background (max_staleness)
        if ahead is None:
            summary = self.rollouts(tasks_file, c.n, f"round {r + 1}/{c.rounds} rollouts", c.temperature,
                                    c.max_tokens)
            rollout_seconds = time.perf_counter() - started
        else:
            summary, rollout_seconds = ahead.summary, ahead.seconds
        waited = time.perf_counter() - started  # what the round waited for its rollouts
        if c.max_staleness:
            self._run_ahead(r)
        asleep = self._ahead is None or not self._ahead.busy  # never while rollouts run in the background
        if asleep:
            self.engine.sleep()
        ids = frozenset(result.rollout_id for result in summary.results)
        frame, account = compile_transitions(CompileConfig(
            db=self.db, reward=c.reward, emitted_rewards=False, gamma=c.gamma, advantage=c.advantage,
            agents=c.agents or None, merge_turns=c.merge_turns, rollout_ids=ids))
        figures: dict = {"rollout_wait_seconds": waited, "rollouts_in_background": ahead is not None}
        if c.max_staleness:  # how old the records are, and the groups too old to train on
            versions = record_versions(self.db, ids)
            frame, figures["stale_dropped_groups"] = drop_stale_groups(frame, versions, state.policy_version,
                                                                       c.max_staleness)
            figures.update(staleness(versions, state.policy_version))
        # what this round trains on, as `compile` writes it (the viewer colours tokens by these advantages)
        frame.write_parquet(tasks_file.parent / "transitions.parquet")
        rows = frame.to_dicts()
        by_adapter: dict = {}
        if c.adapters:  # each adapter's own pass over the calls it served (train/adapter_rounds.py)
            groups, untrained = split_by_adapter(self.db, rows, c.adapters)
            stats, per = optimize_adapters(
                self.learner, groups, c, c.seed * 100_003 + r, on_step=self.metrics.write_step,
                progress=lambda name, done, total: self.progress(f"round {r + 1}/{c.rounds} train {name}", done,
                                                                 total))
            by_adapter = {"adapters": per, "untrained_transitions": untrained}
        else:
            stats = optimize(self.learner, rows, c, "grpo", seed=c.seed * 100_003 + r, epochs=c.epochs,
                             progress=lambda done, total: self.progress(f"round {r + 1}/{c.rounds} train", done,
                                                                        total),
                             on_step=self.metrics.write_step)
        if asleep:
            self.engine.wake()
        no_step = None if stats.steps else (
            account.why_none(c.reward) if not rows
            else f"all {len(rows)} transitions are longer than max_length ({c.max_length}): raise max_length or "
                 f"lower max_tokens" if stats.skipped_too_long >= len(rows)
            else "the optimizer took no step on this round's transitions")
        rewards = summary.rewarded
        mean = sum(rewards) / len(rewards) if rewards else None
        std = (sum((x - mean) ** 2 for x in rewards) / (len(rewards) - 1)) ** 0.5 if len(rewards) > 1 else None
        return {
            "round": r + 1, "phase": "grpo", "policy_version": state.policy_version,
            "rollouts": len(summary.results), "rewarded": len(rewards), "reward_mean": mean, "reward_std": std,
            "success_rate": sum(1 for x in rewards if x >= 1.0) / len(rewards) if rewards else None,
            "excluded": dict(account.excluded), "transitions": len(rows),
            **self._episode_figures(ids),
            "prompt_tokens": sum(len(x["prompt_ids"]) for x in rows),
            "completion_tokens": sum(len(x["completion_ids"]) for x in rows),
            "zero_variance_groups": zero_variance_groups(summary.results),
            "rollout_seconds": rollout_seconds, **figures,
            "optimizer_steps_total": self.learner.engine.global_steps,
            **stats.summary(), **by_adapter, **({"no_step": no_step} if no_step else {}),
        }

    def _episode_figures(self, ids: set[str]) -> dict:
        """From the store, over this round's rollouts: LLM calls per rollout, each request once (a call that two
        instrumentations both recorded, such as the Agents SDK's span around the OpenAI SDK's, counts once), and
        the policy versions the gateway recorded on them: one, the newest, when the engine serves each checkpoint
        as it should."""
        from lightning_otel.span_store import client

        if not ids:
            return {"transitions_per_episode": None, "served_policy_versions": []}
        listed = ", ".join(client.sql_literal(i) for i in sorted(ids))
        row = client.query(f"SELECT count(*) AS calls, count(DISTINCT rollout_id) AS episodes, "
                           f"list(DISTINCT policy_version ORDER BY policy_version) "
                           f"FILTER (WHERE policy_version IS NOT NULL) AS versions "
                           f"FROM trajectory_calls WHERE rollout_id IN ({listed})", self.db).to_dicts()[0]
        return {"transitions_per_episode": row["calls"] / row["episodes"] if row["episodes"] else None,
                "served_policy_versions": [int(v) for v in row["versions"] or []],
                "prompt_versions": prompt_versions(self.db, listed)}

    def validate(self, state: RunState) -> dict:
        """One rollout of every validation task at `val_temperature` (greedy by default: a policy that did not
        change scores the same, so a move in the curve is the policy's). Accuracy is the share of rollouts whose
        reward reached 1 (a correct answer, for 0/1 rewards such as spider_exec)."""
        from lightning_otel.span_store import client

        c = self.config
        tasks = load_tasks(Path(c.val_tasks))
        summary = self.rollouts(write_tasks(tasks, self.folder.path / "rounds" / "validation.jsonl"), 1,
                                "validation", c.val_temperature, c.max_tokens)
        rewards = summary.rewarded
        mean = sum(rewards) / len(rewards) if rewards else None
        if state.last and mean is not None and (state.best_metric is None or mean > state.best_metric):
            state.best, state.best_metric = state.last, mean
        listed = ", ".join(client.sql_literal(r.rollout_id) for r in summary.results)
        return {"val_reward_mean": mean, "val_accuracy": sum(x >= 1.0 for x in rewards) / len(rewards) if rewards
                else None, "val_rewarded": len(rewards), "val_rollouts": len(summary.results),
                "val_prompt_versions": prompt_versions(self.db, listed) if listed else {}}


# The prompt version of every gateway record of some rollouts ("base": no patch applied), with its calls.
SQL_PROMPT_VERSIONS = f"""
SELECT coalesce(json_extract_string(attributes, '$."{VERSION_ATTRIBUTE}"'), 'base') AS version, count(*) AS calls
FROM spans WHERE name = 'lightning.generate' AND rollout_id IN ($listed) GROUP BY 1 ORDER BY 1
"""


def prompt_versions(db: Path, listed: str) -> dict[str, int]:
    """{prompt version: calls} over the rollouts `listed` (SQL literals), from the gateway's records: which
    prompt the policy was served under (`prompt`, docs/prompts.md); {"base": calls} when no patch applied."""
    from lightning_otel.span_store import client

    rows = client.query(SQL_PROMPT_VERSIONS.replace("$listed", listed), db).to_dicts()
    return {row["version"]: int(row["calls"]) for row in rows}


def keep_prompt(prompt: Path, folder: Path, resumed: bool) -> None:
    """Keep the run's patch file as <run>/prompt<suffix>, so the run says which prompt it trained under; a resumed
    run must find the file as it was (its earlier rounds ran under it)."""
    kept = folder / f"prompt{prompt.suffix or '.json'}"
    text = prompt.read_text(encoding="utf-8")
    if resumed and kept.is_file() and kept.read_text(encoding="utf-8") != text:
        raise UserError(f"the prompt patch file {prompt} changed since this run started in {folder}: its rounds so far "
                        f"ran under the copy {kept}; restore the file (cp {kept} {prompt}) or give a new output_dir")
    kept.write_text(text, encoding="utf-8")


def engine_config(config: TrainConfig, model_dir: Path, log_path: Path | None = None):
    """The engine a run starts for itself: its model, adapter rank and context length, and the GPU knobs."""
    from lightning_otel.serve.engine import EngineConfig, default_engine_python

    return EngineConfig(model_dir=model_dir, python=config.engine_python or default_engine_python(),
                        max_lora_rank=max(16, config.lora_rank), max_model_len=config.max_length, log_path=log_path,
                        max_loras=max(1, len(config.adapters)),
                        gpu_memory_utilization=config.gpu_memory_utilization, sleep_mode=config.sleep_mode,
                        extra_args=list(config.engine_args))


def zero_variance_groups(results) -> int:
    """Tasks of a round whose rewarded rollouts all got the same reward: they give GRPO no gradient."""
    by_task: dict[str, set[float]] = {}
    for result in results:
        if result.reward is not None:
            by_task.setdefault(result.task_id, set()).add(result.reward)
    return sum(1 for values in by_task.values() if len(values) == 1)


def train(config: TrainConfig, engine: PolicyEngine | None = None, progress=None) -> RunState:
    with Trainer(config, engine=engine, progress=progress) as trainer:
        return trainer.run()
