"""`lightning-otel rollout`: an unchanged agent over a task file, n samples per task, into the store."""
from __future__ import annotations

import argparse
from pathlib import Path

from lightning_otel.cli.options import (add_chat_template, add_db, add_outside_endpoint, add_prompt,
                                        add_rollout_timeout, add_samples, add_task_pack, add_tool_format)
from lightning_otel.cli.render import Progress


def cmd_rollout(args: argparse.Namespace) -> int:
    from lightning_otel.rollouts.runner import RolloutConfig, run_rollouts

    config = RolloutConfig(tasks=args.tasks, agent=args.agent, n=args.n, concurrency=args.concurrency, db=args.db,
                           base_url=args.base_url, api_key=args.api_key, model=args.model,
                           api_key_env=args.api_key_env, base_model=args.base_model,
                           model_name=args.model_name, reward=args.reward, task_pack=args.task_pack,
                           data_dir=args.data_dir, rollout_timeout_s=args.rollout_timeout,
                           max_tokens=args.max_tokens, temperature=args.temperature,
                           chat_template=args.chat_template, tool_format=args.tool_format, prompt=args.prompt)
    summary = run_rollouts(config, progress=Progress("rollouts").update)
    print(f"{len(summary.results)} rollouts: {summary.count('ok')} ok, {summary.count('failed')} failed, "
          f"{summary.count('timeout')} timed out, {summary.count('error')} could not start")
    rewarded = summary.rewarded
    if config.reward:
        mean = sum(rewarded) / len(rewarded) if rewarded else float("nan")
        print(f"reward {config.reward}: mean {mean:.3f} over {len(rewarded)} scored rollouts"
              f" ({len(summary.results) - len(rewarded)} without a reward)")
    print(f"stored in {args.db}: lightning-otel sql \"SELECT * FROM rollouts\" --db {args.db}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("rollout", help="run an unchanged agent command over a task file, n samples per task",
                       description="Run the agent once per task and sample, each a subprocess under "
                                   "opentelemetry-instrument (an agent function: a call in one worker process "
                                   "under it), recording spans, outcomes and rewards in the store.")
    p.add_argument("--tasks", type=Path, required=True, help="JSONL task file (one object per line)")
    p.add_argument("--agent", required=True,
                   help='command template, e.g. "python agent.py --question {question} --db {db_path}", or an '
                        'agent function called as fn(task, llm) in one worker process: "module:function" or '
                        '"path/to/agent.py:function"')
    add_samples(p)
    p.add_argument("--concurrency", type=int, default=2, help="rollouts at a time (default: 2)")
    add_db(p)
    p.add_argument("--model", help="policy to serve through vLLM and the token-recording gateway, as eval takes it: "
                                   "base (the bundled SmolLM2-135M-Instruct, the default), a training run folder "
                                   "(its best checkpoint), a checkpoint, a LoRA adapter, a model folder or a "
                                   "Hugging Face hub id (org/name or org/name@revision)")
    add_outside_endpoint(p, "serving --model")
    p.add_argument("--api-key", help="OPENAI_API_KEY given to the agents")
    p.add_argument("--model-name", default="policy", help="model name for {model} and LIGHTNING_MODEL "
                                                          "(the gateway serves the policy under any name)")
    p.add_argument("--max-tokens", type=int, help="cap every generation at this many tokens (default: what each "
                                                  "request asks, and 512 for a request that names no max_tokens)")
    p.add_argument("--temperature", type=float, help="sample every request at this temperature, whatever the agent "
                                                     "asks (default: each request's own)")
    add_chat_template(p, "the gateway renders --model's prompts with")
    add_tool_format(p)
    add_prompt(p, "the gateway")
    add_task_pack(p, required=False)
    add_rollout_timeout(p)
    p.set_defaults(func=cmd_rollout)
