"""`lightning-otel eval`: a policy with an unchanged agent over a task file, and a report."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lightning_otel.cli.options import (add_chat_template, add_outside_endpoint, add_prompt,
                                        add_rollout_timeout, add_samples, add_task_pack, add_tool_format)
from lightning_otel.cli.render import Progress


def cmd_eval(args: argparse.Namespace) -> int:
    from lightning_otel.eval import EvalConfig, evaluate
    from lightning_otel.eval.report import terminal_summary

    config = EvalConfig(tasks=args.tasks, agent=args.agent, report=args.report, model=args.model, n=args.n,
                        reward=args.reward, task_pack=args.task_pack,
                        baseline=args.baseline, db=args.db, data_dir=args.data_dir, max_tokens=args.max_tokens,
                        concurrency=args.concurrency, rollout_timeout_s=args.rollout_timeout,
                        temperature=args.temperature, chat_template=args.chat_template, tool_format=args.tool_format,
                        prompt=args.prompt, base_url=args.base_url, base_model=args.base_model,
                        api_key_env=args.api_key_env)
    print("eval config: " + ", ".join(f"{k}={v}" for k, v in config.to_dict().items()), file=sys.stderr)
    summary = evaluate(config, progress=Progress("eval").update).summary
    print(terminal_summary(summary))
    print(f"report: {args.report / 'report.md'} (summary.json, plots; traces in {config.db})")
    return 0


def register(sub) -> None:
    p = sub.add_parser("eval", help="evaluate a policy with an agent over a task file and write a report",
                       description="Run the agent over the tasks (-n samples each) with the policy served "
                                   "through vLLM and the gateway, score with --reward, and report accuracy (by "
                                   "the task pack's group field, e.g. Spider's hardness), transitions and tokens "
                                   "per episode, outcome classes and latency, all computed from the trace store.")
    p.add_argument("--tasks", type=Path, required=True, help="JSONL task file, one task object per line")
    p.add_argument("--agent", required=True,
                   help='command template, e.g. "python agent.py --question {question} --db {db_path}", or an '
                        'agent function called as fn(task, llm): "module:function" or "path/to/agent.py:function"')
    p.add_argument("--model", default="base",
                   help="base (the bundled model), a training run folder (its best checkpoint), a checkpoint, a "
                        "LoRA adapter folder, a model folder or a Hugging Face hub id (org/name or "
                        "org/name@revision) (default: base)")
    add_samples(p)
    p.add_argument("--report", type=Path, required=True, metavar="DIR",
                   help="folder for report.md, summary.json and the plots")
    p.add_argument("--baseline", type=Path, metavar="DIR", help="another eval's --report folder to compare with")
    p.add_argument("--db", type=Path, help="DuckDB trace store (default: DIR/traces.duckdb)")
    add_task_pack(p, required=True)
    p.add_argument("--max-tokens", type=int, help="cap on the tokens of each generation (default: the agent's)")
    p.add_argument("--temperature", type=float,
                   help="sampling temperature forced on every request, 0 = greedy (default: the agent's own)")
    p.add_argument("--concurrency", type=int, default=2, help="rollouts at a time (default: 2)")
    add_chat_template(p, "the gateway renders the policy's prompts with")
    add_tool_format(p)
    add_prompt(p, "the gateway")
    add_outside_endpoint(p, "--model")
    add_rollout_timeout(p)
    p.set_defaults(func=cmd_eval)
