"""`lightning-otel optimize`: better instructions and demonstrations for an unchanged agent, by real rollouts
through the gateway under prompt patches (lightning_otel.train.apo)."""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from lightning_otel.cli.render import StepProgress
from lightning_otel.errors import UserError


def cmd_optimize(args: argparse.Namespace) -> int:
    try:
        import gepa  # noqa: F401 - only to say plainly what is missing
    except ImportError:
        raise UserError("the prompt optimiser needs the gepa package: pip install 'lightning-otel[apo]'") from None
    from lightning_otel.train.apo.config import load_optimize_config
    from lightning_otel.train.apo.optimizer import optimize
    from lightning_otel.train.settings import render_toml

    config = load_optimize_config(args.config, args.overrides)
    print(f"# resolved config (saved as {config.output_dir}/config.toml)\n{render_toml(config)}", end="", flush=True)
    if (Path(config.output_dir) / "config.toml").is_file():
        print(f"continuing the run in {config.output_dir}: finished evaluations are read back, not run again",
              flush=True)
    logging.getLogger("lightning_otel.train.apo").setLevel(logging.INFO)
    summary = optimize(config, progress=StepProgress())
    width = max(len(name) for name, _ in summary.table())
    for name, value in summary.table():
        print(f"{name:<{width}}  {value}")
    if summary.best_prompt:
        print(f"use it: lightning-otel eval --prompt {summary.best_prompt} ... (or rollout / serve / train with "
              f"--prompt)")
    return 0


def register(sub) -> None:
    p = sub.add_parser("optimize", help="optimise an agent's prompts (instructions, demonstrations) by rollouts",
                       description="Search better system instructions (GEPA with a reflection model) and few-shot "
                                   "demonstrations (from the agent's own full-reward calls) for an unchanged agent: "
                                   "every candidate runs as a prompt patch at the gateway on real rollouts, scored "
                                   "by the task pack's reward on a train and a validation split. Resumable: run the "
                                   "same command again after a stop. Settings come from --config (TOML) and "
                                   "key=value arguments (later wins); docs/prompts.md lists them. Writes "
                                   "<output_dir>/best_prompt.json (use it with --prompt) and summary.json.")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="settings over the config file, e.g. tasks=train.jsonl max_metric_calls=60 proposer=demos")
    p.add_argument("--config", type=Path, help="TOML file with optimize settings")
    p.set_defaults(func=cmd_optimize)
