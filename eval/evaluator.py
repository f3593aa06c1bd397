"""Evaluate a policy with an unchanged agent over a task file, and write a report.

    lightning-otel eval --tasks dev.jsonl --agent "python examples/openai_sql/agent.py --question {question} \\
        --db {db_path}" --reward spider_exec --model runs/sql-grpo --report reports/grpo --baseline reports/base

    from lightning_otel.eval import EvalConfig, evaluate
    result = evaluate(EvalConfig(tasks=..., agent=..., reward="number_match", report=Path("reports/base")))

The policy (lightning_otel.serve.policy: the bundled model, a run's best checkpoint, a LoRA adapter or a model
folder) is served by vLLM behind the token-recording gateway, a LoRA adapter hot-loaded with
engine.update_weights. The rollout runner executes the agent n times per task, scored by the reward given
(any task pack's, or module:function; lightning_otel.rollouts.packs) and classified by the task pack's
outcome classes; the
traces go to a DuckDB store (default <report>/traces.duckdb) and every number of the report is a query
over it (lightning_otel.eval.metrics). An engine already running can be passed in (tests share one).
"""
from __future__ import annotations

import logging
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from lightning_otel.errors import UserError
from lightning_otel.eval.metrics import compute_metrics
from lightning_otel.eval.plots import write_plots
from lightning_otel.eval.report import comparison_rows, paired_comparison, read_rounds, read_summary, write_report
from lightning_otel.rollouts.runner import RolloutConfig, RolloutResult, check_inputs, load_tasks, run_rollouts
from lightning_otel.serve.engine import PolicyEngine
from lightning_otel.serve.policy import resolve_policy
from lightning_otel.serve.serving import engine_for_policy
from lightning_otel.serve.prompts import load_patches
from lightning_otel.serve.toolcalls import tool_format

log = logging.getLogger(__name__)


@dataclass
class EvalConfig:
    tasks: Path
    agent: str
    report: Path
    reward: str = ""                     # a reward a task pack registers (spider_exec, number_match) or module:function
    task_pack: str | None = None         # default: the pack that registers `reward`
    model: str = "base"
    n: int = 4                           # samples per task (one default for every command)
    baseline: Path | None = None
    db: Path | None = None               # default: <report>/traces.duckdb
    data_dir: Path | None = None         # the task pack's data folder; default: the pack's own
    max_tokens: int | None = None        # cap on each generation, whatever the agent asks
    temperature: float | None = None     # forced on every request (0 = greedy); None: the agent's own
    concurrency: int = 2
    rollout_timeout_s: float = 300.0     # seconds one rollout may run before it is killed
    engine_python: str | None = None     # Python that runs vLLM; default: the project's engine venv
    chat_template: Path | None = None    # a Jinja chat template file the gateway renders with (the model's own: None)
    tool_format: str | None = None       # the call syntax (serve.toolcalls.FORMATS); None: detected from the template
    prompt: Path | None = None           # a prompt patch file the gateway applies (docs/prompts.md)
    # A closed model instead of `model`: the gateway forwards every call to this OpenAI-compatible endpoint
    # (with the patch applied) and records it as text (docs/prompts.md, "Closed models").
    base_url: str | None = None
    base_model: str | None = None        # the model name the endpoint gets
    api_key_env: str | None = None       # the environment variable holding its key (default: the agent's own)

    def __post_init__(self) -> None:
        self.tasks, self.report = Path(self.tasks), Path(self.report)
        self.db = Path(self.db) if self.db else self.report / "traces.duckdb"
        self.data_dir = Path(self.data_dir) if self.data_dir else None
        self.baseline = Path(self.baseline) if self.baseline else None
        if not self.tasks.is_file():
            raise UserError(f"tasks = {self.tasks}: no such file; give a JSONL task file (one object per line)")
        if not str(self.reward).strip():
            raise UserError("reward is not set: an evaluation scores each rollout with a reward function; set "
                            "reward to a name a task pack registers (spider_exec, number_match) or to "
                            "module:function")
        if not str(self.model).strip():
            raise UserError("model is empty: give 'base', a run folder, a checkpoint, an adapter or a model folder")
        if self.n < 1:
            raise UserError(f"n = {self.n}: the number of samples per task must be at least 1")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise UserError(f"max_tokens = {self.max_tokens}: must be at least 1")
        if self.temperature is not None and not 0 <= self.temperature <= 2:
            raise UserError(f"temperature = {self.temperature}: must be in [0, 2]")
        if self.report.exists() and not self.report.is_dir():
            raise UserError(f"report = {self.report} is a file; give a folder for the report")
        if self.baseline is not None and not (self.baseline / "summary.json").is_file():
            raise UserError(f"baseline = {self.baseline}: no summary.json there; give the report folder of an "
                            f"earlier evaluation")
        if self.data_dir is not None and not self.data_dir.is_dir():
            raise UserError(f"data_dir {self.data_dir} is not a folder")
        if self.tool_format is not None:
            tool_format(self.tool_format)  # an unknown name is refused before anything starts
        if self.prompt is not None:
            self.prompt = Path(self.prompt)
            load_patches(self.prompt)  # a bad file is refused before anything starts
        if self.base_url and self.model != "base":
            raise UserError(f"model = {self.model} and base_url = {self.base_url}: an evaluation runs on one of "
                            f"them; give the policy served here, or the outside endpoint")
        if not self.base_url and (self.base_model or self.api_key_env):
            raise UserError("base_model and api_key_env are for an outside endpoint: give base_url with them")

    def to_dict(self) -> dict:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()}


@dataclass
class EvalResult:
    summary: dict
    report_path: Path
    rollout_ids: list[str] = field(default_factory=list)


def outside_policy(base_url: str, base_model: str | None) -> dict:
    """The report's policy entry for a closed model behind an outside endpoint (its URL without credentials)."""
    from lightning_otel.serve.forward import public_url

    url = public_url(base_url)
    return {"base_model": base_model or url, "adapter": None, "label": base_model or url, "version": None,
            "run_dir": None, "outside_url": url}


def evaluate(config: EvalConfig, engine: PolicyEngine | None = None,
             progress: Callable[[RolloutResult, int, int], None] | None = None) -> EvalResult:
    """Run the evaluation and write the report; returns the summary (also in <report>/summary.json)."""
    log.info("eval config: %s", config.to_dict())
    rollout_config = RolloutConfig(tasks=config.tasks, agent=config.agent, n=config.n,
                                   concurrency=config.concurrency, db=config.db, reward=config.reward,
                                   task_pack=config.task_pack,
                                   data_dir=config.data_dir, rollout_timeout_s=config.rollout_timeout_s,
                                   max_tokens=config.max_tokens, temperature=config.temperature,
                                   chat_template=config.chat_template, tool_format=config.tool_format,
                                   prompt=config.prompt, base_url=config.base_url or None,
                                   base_model=config.base_model, api_key_env=config.api_key_env)
    tasks = load_tasks(config.tasks)
    check_inputs(rollout_config, tasks)  # bad tasks or commands fail before an engine starts
    baseline = read_summary(config.baseline) if config.baseline else None
    policy = None if config.base_url else resolve_policy(config.model, config.engine_python)
    described = policy.to_dict() if policy is not None else outside_policy(config.base_url, config.base_model)
    if policy is not None:
        rollout_config.adapters = dict(policy.routes)  # one adapter per agent: the gateway routes calls as trained
    log.info("policy: %s", described)
    config.report.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with ExitStack() as owned:
        served = None if policy is None else engine_for_policy(policy, engine, owned, config.engine_python,
                                                               config.report / "engine.log")
        results = run_rollouts(rollout_config, progress=progress, engine=served).results
    rollout_ids = [r.rollout_id for r in results]
    summary = {"config": config.to_dict(), "policy": described, "store": str(config.db),
               "tasks": len(tasks), "started": started, "wall_s": time.time() - started,
               **compute_metrics(config.db, rollout_ids, config.reward, rollout_config.pack,
                                 rollout_config.data_dir)}
    summary["rounds"] = read_rounds(policy.run_dir if policy is not None else None)
    if baseline is not None:
        summary["baseline"] = {"path": str(config.baseline), "label": baseline["policy"]["label"],
                               "comparison": comparison_rows(summary, baseline),
                               "paired": paired_comparison(summary, baseline)}
    try:
        summary["plots"] = write_plots(summary, baseline, config.report)
    except Exception as exc:  # a plot must never cost the report of a finished evaluation
        log.warning("plots not written (%s: %s); the report and summary.json still are", type(exc).__name__, exc)
        summary["plots"], summary["plots_error"] = [], f"{type(exc).__name__}: {exc}"
    path = write_report(summary, config.report)
    log.info("report written to %s", path)
    return EvalResult(summary, path, rollout_ids)
