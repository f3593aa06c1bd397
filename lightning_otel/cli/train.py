"""Training commands: compile (stored rollouts to transitions) and train (rounds of rollout and GRPO, or
--offline from stored traces)."""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from lightning_otel.cli.options import DeprecatedAlias, add_chat_template, add_db, add_prompt, add_tool_format
from lightning_otel.cli.render import StepProgress
from lightning_otel.errors import UserError
from lightning_otel.train.transitions.credit import ADVANTAGE_ALIASES, ADVANTAGES


def cmd_compile(args: argparse.Namespace) -> int:
    from lightning_otel.train.transitions.compile import CompileConfig, compile_transitions

    model = None if args.tokenizer.lower() == "none" else args.tokenizer
    frame, account = compile_transitions(CompileConfig(db=args.db, reward=args.reward, gamma=args.gamma,
                                                       advantage=args.advantage, agents=args.agents,
                                                       intermediate=args.intermediate or [],
                                                       turn_weight=args.turn_weight, merge_turns=args.merge_turns,
                                                       model=model, max_length=args.max_length, drift=args.drift,
                                                       chat_template=args.chat_template,
                                                       tool_format=args.tool_format))
    frame.write_parquet(args.out)
    per_episode = f" ({account.transitions_per_episode:.2f} per episode)" if account.compiled_rollouts else ""
    print(f"{account.transitions} transitions from {account.compiled_rollouts} of {account.rollouts} rollouts"
          f"{per_episode} -> {args.out}")
    for reason, count in sorted(account.excluded.items()):
        print(f"  excluded: {count} rollout(s): {reason}")
    if why := account.why_none(args.reward):
        print(f"  no transitions: {why}")
    if account.zero_variance_groups:
        print(f"  {account.zero_variance_groups} group(s) of (task, policy version) had no reward variance")
    if account.duplicate_calls:
        print(f"  {account.duplicate_calls} duplicated LLM span(s) removed (one request recorded twice)")
    if account.retokenized_calls:
        print(f"  {account.retokenized_calls} call(s) without a token record re-tokenised from their messages "
              f"(token_source=retokenized, no sampling logprobs)")
    for reason, count in sorted(account.not_merged.items()):
        print(f"  not merged: {count} pair(s) of turns: {reason}")
    for line in account.drift.lines() if account.drift else []:
        print(line)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from lightning_otel.train import distributed

    if distributed.launched():  # one rank of several (torchrun, deepspeed): rank 0 runs the run, the rest follow
        distributed.init()
        if distributed.rank() > 0:
            distributed.follow()
            distributed.finish()
            return 0
    code = _train(args)
    # Only after a run that ended well: after an error the other ranks may be inside a step rank 0 left, and the
    # launcher stops them when rank 0 exits with an error.
    distributed.release()
    distributed.finish()
    return code


def no_step_note(state, output_dir: str) -> str | None:
    """What to tell at the end of a run some of whose rounds took no optimizer step (None when all took one)."""
    if not state.rounds_without_step:
        return None
    untrained = " (the starting policy: nothing was trained)" if state.last is None else ""
    return (f"note: {state.rounds_without_step} of {state.rounds_completed} round(s) took no optimizer step, so the "
            f"policy is version {state.policy_version}{untrained}; each round's reason is 'no_step' in "
            f"{output_dir}/metrics.jsonl. When every group got equal rewards: a shaped reward, the pool filter "
            f"(pool_min_pass / pool_max_pass) or advantage = \"reinforce-pp\" give the rounds something to learn")


def _train(args: argparse.Namespace) -> int:
    from lightning_otel.train.config import load_config, render_toml

    config = load_config(args.config, args.overrides, prompt=str(args.prompt) if args.prompt else None)
    print(f"# resolved config (saved as {config.output_dir}/config.toml)\n{render_toml(config)}", end="")
    logging.getLogger("lightning_otel.train.metrics").setLevel(logging.INFO)
    if args.offline:
        from lightning_otel.train.offline import train_offline

        if args.db is None:
            raise UserError("--offline trains from a trace store: give --db traces.duckdb")
        if config.prompt:
            raise UserError("prompt patches are applied by the gateway to new rollouts, and --offline runs none: "
                            "leave prompt out (the stored records name the patch each call ran with)")
        state = train_offline(config, args.db, args.where, args.objective, args.min_reward, StepProgress())
    else:
        from lightning_otel.train.trainer import train

        if args.db is not None or args.where is not None:
            raise UserError("--db/--where select stored traces for --offline training; online rounds write "
                            "their traces into <output_dir>/traces.duckdb")
        from lightning_otel.train.run import RunFolder

        saved = RunFolder(Path(config.output_dir)).load()
        if saved is not None and saved.last:
            print(f"resuming {config.output_dir} at round {saved.rounds_completed + 1} of {config.rounds}, from "
                  f"{saved.last} (policy version {saved.policy_version}"
                  f"{', SFT done' if saved.sft_done else ''})", flush=True)
        state = train(config, progress=StepProgress())
    print(f"done: {config.output_dir} (policy version {state.policy_version}, last {state.last}, best {state.best})")
    if note := no_step_note(state, config.output_dir):
        print(note)
    print(f"evaluate it: lightning-otel eval --model {config.output_dir} --tasks TASKS --agent CMD --report DIR")
    return 0


def register(sub) -> None:
    p = sub.add_parser("compile", help="turn stored rollouts into training transitions (Parquet)",
                       description="Per rollout: LLM calls in order with their token records, the episode "
                                   "reward, return and group-normalised advantage.")
    add_db(p)
    p.add_argument("--out", type=Path, required=True, help="Parquet file to write")
    p.add_argument("--reward", help="reward name (default: the only one stored)")
    p.add_argument("--gamma", type=float, default=1.0, help="discount per later LLM call (default: 1)")
    p.add_argument("--advantage", default="per-rollout", choices=[*ADVANTAGES, *ADVANTAGE_ALIASES],
                   metavar="{" + ",".join(ADVANTAGES) + "}",
                   help="per-rollout: group statistics over rollouts (default); per-transition: over transitions "
                        "(Agent Lightning's legacy); batch-baseline: groups, lone rollouts against each other; "
                        "reinforce-pp: one baseline over the whole batch, no groups (REINFORCE++, its sequence "
                        "part: the trainer adds the token-level KL); ppo: the return itself (the trainer replaces "
                        "it with GAE from its critic); none")
    p.add_argument("--agents", metavar="REGEX",
                   help="train only LLM calls of agents whose whole name matches this pattern")
    p.add_argument("--intermediate", action="append", metavar="NAME",
                   help="a reward name whose rows on inner spans add to the returns of their scope (repeatable)")
    p.add_argument("--turn-weight", type=float, default=0.0,
                   help="lambda of the turn-level term A_t = A + lambda * z_t (default 0: off)")
    p.add_argument("--merge-turns", action="store_true",
                   help="merge consecutive turns whose tokens extend the previous turn into one sample")
    p.add_argument("--tokenizer", default="bundled", metavar="MODEL",
                   help="tokenizer and chat template for calls without a token record: a local Hugging Face model "
                        "folder or a hub id org/name[@revision] (default: the bundled model; 'none' excludes such "
                        "rollouts instead)")
    p.add_argument("--model", dest="tokenizer", action=DeprecatedAlias, new="--tokenizer", help=argparse.SUPPRESS)
    p.add_argument("--max-length", type=int, metavar="TOKENS",
                   help="exclude rollouts with a call longer than this (prompt + completion tokens)")
    p.add_argument("--drift", action="store_true",
                   help="also re-tokenise calls that have a token record and report how often the ids differ")
    add_chat_template(p, "the gateway rendered prompts with (re-tokenising renders with it too)")
    add_tool_format(p)
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser("train", help="train the agent's policy: rounds of rollout and GRPO, or --offline",
                       description="Rounds of rollout (vLLM through the gateway) and GRPO under DeepSpeed, "
                                   "resumable: run the same command again after an interruption. Settings "
                                   "come from --config (TOML) and key=value arguments (later wins).")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="settings over the config file, e.g. rounds=3")
    p.add_argument("--config", type=Path, help="TOML file with train settings (keys: see docs or README)")
    p.add_argument("--offline", action="store_true", help="train on traces already in --db, no new rollouts")
    add_prompt(p, "the rounds' rollouts (config key `prompt`)")
    p.add_argument("--db", type=Path, help="with --offline: the trace store to train from")
    p.add_argument("--where", help="with --offline: SQL condition on the rollouts view, e.g. \"status = 'ok'\"")
    p.add_argument("--objective", choices=("grpo", "sft"), default="grpo",
                   help="with --offline: GRPO (batch baseline where no groups) or SFT on successful rollouts")
    p.add_argument("--min-reward", type=float, default=1.0, help="with --objective sft: the success threshold")
    p.set_defaults(func=cmd_train)
