"""The prompt optimiser: better system instructions and demonstrations for an unchanged agent, found by real
rollouts through the gateway and scored by the task pack's reward.

    lightning-otel optimize tasks=train.jsonl val_tasks=val.jsonl agent="python agent.py {question}" \\
        reward=number_match max_metric_calls=60 reflection_url=https://api.openai.com/v1 reflection_model=gpt-4.1

1. Seed: the agent runs with its own prompt on the validation split. The system messages its calls sent (of the
   agents `agents` selects) are the components (candidates.py); the seed candidate is their own texts.
2. Reflection (`proposer` reflection or both): GEPA (the `gepa` library) searches instructions. Each iteration it
   picks a candidate from the Pareto front over validation tasks, runs it on a minibatch of train tasks, asks the
   reflection model for a better text of one component from what the store recorded of those rollouts
   (adapter.py), runs the new candidate on the same minibatch and, when it does better there, on the validation
   split. `max_metric_calls` bounds the task evaluations it spends. GEPA's own state is in `gepa/`.
3. Demonstrations (`proposer` demos or both): sets of the agent's own full-reward train calls as few-shot
   demonstrations of the best instruction so far (demos.py), kept when one beats it on validation.
4. Output: `best_prompt.json`, the best candidate's patch file (use it with --prompt), unless nothing beat the
   agent's own prompt; `summary.json`: seed and best validation scores, the candidates and rollouts used.

Every evaluation is kept (evaluation.py) and its rollouts are in the run's store (`traces.duckdb`, each patched
call with `lightning.prompt.version` = the candidate's key): rerunning the same command continues a stopped run
without running any evaluation again.
"""
from __future__ import annotations

import json
import logging
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from lightning_otel.errors import UserError
from lightning_otel.rollouts.runner import Task, load_tasks
from lightning_otel.serve.engine import PolicyEngine
from lightning_otel.serve.toolcalls import tool_format
from lightning_otel.train.apo.adapter import GatewayAdapter
from lightning_otel.train.apo.candidates import BASE, Component, candidate_patch, changes, seed_candidate
from lightning_otel.train.apo.config import OptimizeConfig, check_resume
from lightning_otel.train.apo.demos import DemosProposer
from lightning_otel.train.apo.evaluation import Evaluator, RunBatch
from lightning_otel.train.settings import render_toml

log = logging.getLogger(__name__)
Progress = Callable[[str, int, int], None]


@dataclass
class OptimizeSummary:
    output_dir: str
    components: list[str]
    seed_val: float
    best_val: float
    best_key: str             # "base": nothing beat the agent's own prompt
    best_from: str            # seed | reflection | demos
    best_prompt: str | None   # the patch file, when the best is not the seed
    changes: dict[str, str]   # what the best candidate changes
    candidates: int           # candidates evaluated
    rollouts: int             # rollouts of all evaluations of the run (this process and before a resume)
    rollouts_now: int         # of which this process ran
    metric_calls: int | None  # GEPA's task evaluations
    reflections: int          # reflection model calls this process made
    resumed: bool

    def table(self) -> list[tuple[str, str]]:
        return [("validation score, seed", f"{self.seed_val:.3f}"),
                ("validation score, best", f"{self.best_val:.3f} ({self.best_from}, candidate {self.best_key})"),
                ("components", ", ".join(self.components)), ("candidates evaluated", str(self.candidates)),
                ("rollouts", f"{self.rollouts} ({self.rollouts_now} by this run)"),
                ("GEPA metric calls", "-" if self.metric_calls is None else str(self.metric_calls)),
                ("best prompt", self.best_prompt or "none: no candidate beat the agent's own prompt")]


class GepaLog:
    """gepa's LoggerProtocol: its lines into <run>/gepa/log.txt and the debug log."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path

    def log(self, message: str) -> None:
        log.debug("gepa: %s", message)
        with self.path.open("a") as f:
            f.write(message + "\n")


def split_tasks(config: OptimizeConfig) -> tuple[list[Task], list[Task]]:
    """(train, validation): the two task files, or `val_fraction` of `tasks` held out, drawn with `seed`."""
    tasks = load_tasks(Path(config.tasks).expanduser())
    if config.val_tasks:
        val = load_tasks(Path(config.val_tasks).expanduser())
        overlap = sorted({t.task_id for t in tasks} & {t.task_id for t in val})
        if overlap:
            raise UserError(f"optimize config: tasks and val_tasks share task id(s) {overlap[:5]}: a task scored for "
                            f"validation must not be one the reflection and the demonstrations learn from")
        return tasks, val
    if len(tasks) < 2:
        raise UserError(f"optimize config: {config.tasks} has {len(tasks)} task: give at least 2 (a train and a "
                        f"validation split), or give val_tasks")
    order = list(range(len(tasks)))
    random.Random(config.seed).shuffle(order)
    held = min(len(tasks) - 1, max(1, round(len(tasks) * config.val_fraction)))
    val_index = set(order[:held])
    return ([t for i, t in enumerate(tasks) if i not in val_index], [t for i, t in enumerate(tasks) if i in val_index])


class Optimizer:
    """The search over one run folder, given how rollouts run (`run_batch`), how their stored calls are read back
    (`calls_of`) and the reflection model; `optimize()` gives it the real ones."""

    def __init__(self, config: OptimizeConfig, run_batch: RunBatch, calls_of: Callable[[list[str]], list[dict]],
                 components_of: Callable[[list[str]], list[Component]], reflection_lm=None,
                 progress: Progress | None = None):
        self.config, self.folder = config, Path(config.output_dir)
        self.resumed = check_resume(config, self.folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        config.save(self.folder / "config.toml")
        self.calls_of, self.components_of, self.reflection_lm = calls_of, components_of, reflection_lm
        self.progress = progress or (lambda label, done, total: None)
        self.evaluator = Evaluator(self.folder, [], run_batch, self.progress)
        self.train, self.val = split_tasks(config)

    def discover(self) -> list[Component]:
        """The components, from the seed's validation rollouts (kept in components.json for a rerun)."""
        saved = self.folder / "components.json"
        if saved.is_file():
            return [Component(**{**c, "agents": tuple(c["agents"])}) for c in json.loads(saved.read_text())]
        results = self.evaluator.evaluate({}, self.val, "seed: validation")
        components = self.components_of([i for r in results for i in r.rollout_ids])
        if not components:
            which = f" of agents matching {self.config.agents!r}" if self.config.agents else ""
            raise UserError(f"the seed rollouts made no LLM call{which} with a system message, so there is no "
                            f"instruction to optimise (a patch targets calls by their system message); check the "
                            f"rollouts in {self.folder / 'traces.duckdb'} (lightning-otel sql --db ... \"SELECT "
                            f"agent, count(*) FROM llm_calls GROUP BY 1\")")
        saved.write_text(json.dumps([asdict(c) for c in components], indent=2, ensure_ascii=False) + "\n")
        return components

    def reflect(self, seed: dict[str, str]) -> tuple[dict[str, str], int | None]:
        import gepa

        adapter = GatewayAdapter(self.evaluator, self.calls_of, {t.task_id for t in self.val})
        result = gepa.optimize(seed_candidate=seed, trainset=self.train, valset=self.val, adapter=adapter,
                               reflection_lm=self.reflection_lm, max_metric_calls=self.config.max_metric_calls,
                               reflection_minibatch_size=min(self.config.minibatch, len(self.train)),
                               run_dir=str(self.folder / "gepa"), seed=self.config.seed,
                               logger=GepaLog(self.folder / "gepa" / "log.txt"), track_best_outputs=False,
                               raise_on_exception=True, display_progress_bar=False)
        return dict(result.candidates[result.best_idx]), result.total_metric_calls

    def run(self) -> OptimizeSummary:
        c = self.config
        log.info("optimize config:\n%s", render_toml(c))
        components = self.discover()
        self.evaluator.components = components
        seed = seed_candidate(components)
        val_ids = [t.task_id for t in self.val]
        best, best_from, metric_calls = seed, "seed", None
        if c.uses_reflection:
            found, metric_calls = self.reflect(seed)
            if self.evaluator.key(found) != BASE:
                best, best_from = found, "reflection"
        if c.uses_demos:
            syntax = tool_format(c.demos_tool_calls) if c.demos_tool_calls else None
            outcome = DemosProposer(self.evaluator, self.calls_of, self.folder / "demos.json", c.demos_k,
                                    c.demos_sets, c.demos_min_reward, c.seed, syntax).run(best, self.train, self.val)
            if self.evaluator.key(outcome.candidate) != self.evaluator.key(best):
                best, best_from = outcome.candidate, "demos"
        return self.finish(components, best, best_from, metric_calls, val_ids)

    def finish(self, components: list[Component], best: dict[str, str], best_from: str, metric_calls: int | None,
               val_ids: list[str]) -> OptimizeSummary:
        key = self.evaluator.key(best)
        seed_val = self.evaluator.log.mean(BASE, val_ids)
        best_val = self.evaluator.log.mean(key, val_ids)
        if best_val is None:  # GEPA keeps only candidates it scored on the whole validation split
            best_val = sum(r.score for r in self.evaluator.evaluate(best, self.val, "best: validation")) / len(val_ids)
        if best_val <= seed_val:
            key, best, best_from, best_val = BASE, seed_candidate(components), "seed", seed_val
        best_file = self.folder / "best_prompt.json"
        patch = candidate_patch(best, components)
        if patch is not None:
            best_file.write_text(json.dumps(patch, indent=2, ensure_ascii=False) + "\n")
        elif best_file.exists():
            best_file.unlink()
        summary = OptimizeSummary(
            output_dir=str(self.folder), components=[c.name for c in components], seed_val=seed_val,
            best_val=best_val, best_key=key, best_from=best_from,
            best_prompt=str(best_file) if patch is not None else None, changes=changes(best, components),
            candidates=len(self.evaluator.log.candidates), rollouts=self.evaluator.log.rollouts,
            rollouts_now=self.evaluator.rollouts_ran, metric_calls=metric_calls,
            reflections=getattr(self.reflection_lm, "calls", 0), resumed=self.resumed)
        (self.folder / "summary.json").write_text(json.dumps(asdict(summary), indent=2, ensure_ascii=False) + "\n")
        return summary


def optimize(config: OptimizeConfig, engine: PolicyEngine | None = None, progress: Progress | None = None,
             reflection_lm=None) -> OptimizeSummary:
    """Run (or continue) the optimisation in config.output_dir on real rollouts: the run's own store, the given
    engine or one started here, and the reflection model of the config (or `reflection_lm`, a callable
    prompt -> text)."""
    from lightning_otel.train.apo.adapter import read_calls
    from lightning_otel.train.apo.candidates import discover_components
    from lightning_otel.train.apo.reflection import reflection_model
    from lightning_otel.train.apo.session import Session

    folder = Path(config.output_dir)
    check_resume(config, folder)  # before anything starts
    split_tasks(config)
    with Session(config, folder, engine) as session:
        if reflection_lm is None and config.uses_reflection:
            url, model, key_env = (config.reflection_url, config.reflection_model, config.reflection_api_key_env) \
                if config.reflection_url else session.reflection_url()
            reflection_lm = reflection_model(url, model, key_env, config.reflection_max_tokens,
                                             config.reflection_temperature, folder / "reflections.jsonl")
        optimizer = Optimizer(config, session.run_batch, lambda ids: read_calls(session.db, ids),
                              lambda ids: discover_components(session.db, ids, config.agents), reflection_lm,
                              progress)
        return optimizer.run()


__all__ = ["Optimizer", "OptimizeSummary", "optimize", "split_tasks"]
