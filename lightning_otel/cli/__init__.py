"""The `lightning-otel` command: parses arguments, calls the library, renders the result.

One module per command group, each registering its subcommands beside their handlers, in the pipeline's order:
store (collect, sql, ingest, export, feedback, prune, schema, tour), capture (run), rollouts (rollout), train
(compile, train), evaluate (eval), view (the web viewer), policy (export-policy, serve), prompts (export-prompt),
optimize, and the demo.
Heavy modules are imported inside each command, so `lightning-otel --help` stays fast.
"""
from __future__ import annotations

import argparse
import logging
import sys

from lightning_otel import __version__
from lightning_otel.cli import capture, demo, evaluate, optimize, policy, prompts, rollouts, store, train, view
from lightning_otel.cli.quiet import quiet_third_parties
from lightning_otel.errors import UserError

GROUPS = (store, capture, rollouts, train, evaluate, view, policy, prompts, optimize, demo)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-otel",
        description="Train existing LLM agents with RL from their OpenTelemetry traces.")
    parser.add_argument("--version", action="version", version=f"lightning-otel {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log more, and show other libraries' warnings and progress bars (hidden by default)")
    # DeepSpeed's launcher passes --local_rank=N first; the rank is read from LOCAL_RANK/RANK instead.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for group in GROUPS:
        group.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        quiet_third_parties()
    try:
        return args.func(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
