"""`lightning-otel run`: an unchanged command under opentelemetry-instrument, its spans sent to a collector."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from lightning_otel.errors import UserError


def run_environment(args: argparse.Namespace, base: dict[str, str]) -> dict[str, str]:
    """The environment `lightning-otel run` gives the command: our distro selected explicitly."""
    from lightning_otel.rollouts.environment import capture_environment

    endpoint, token = args.endpoint, args.token
    if args.db is not None:
        from lightning_otel.span_store.discovery import find_collector
        info = find_collector(args.db)
        if info is None:
            raise UserError(f"no collector holds {args.db}: start `lightning-otel collect --db {args.db}` first, "
                            f"or give --endpoint")
        endpoint, token = endpoint or info.url, token or info.ingest_token
    return capture_environment(base, endpoint, token, redact=args.redact, service_name=args.service_name,
                               rollout_id=args.rollout_id, task_id=args.task_id, attempt=args.attempt)


def cmd_run(args: argparse.Namespace) -> int:
    import shutil

    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not command:
        raise UserError("give the command to run after --, e.g. lightning-otel run -- python agent.py")
    instrument = shutil.which("opentelemetry-instrument", path=f"{Path(sys.executable).parent}{os.pathsep}"
                              f"{os.environ.get('PATH', '')}")
    if instrument is None:
        raise UserError("opentelemetry-instrument is not installed in this environment "
                        "(pip install opentelemetry-instrumentation)")
    env = run_environment(args, dict(os.environ))
    if shutil.which(command[0], path=env.get("PATH")) is None and not Path(command[0]).exists():
        raise UserError(f"command not found: {command[0]}")
    os.execve(instrument, [instrument, *command], env)
    return 0  # not reached


def register(sub) -> None:
    p = sub.add_parser("run", help="run a command under opentelemetry-instrument with our distro",
                       description="Run CMD so that its spans (LLM calls, tools, agents) go to a collector, "
                                   "with this project's distro selected explicitly.",
                       usage="lightning-otel run [options] -- CMD [ARGS...]")
    p.add_argument("--endpoint", help="collector base URL (default: $LIGHTNING_OTEL_ENDPOINT or "
                                      "http://127.0.0.1:4318)")
    p.add_argument("--db", type=Path, help="send to the collector that holds this store file")
    p.add_argument("--token", help="bearer token of the collector (default with --db: its ingest token)")
    p.add_argument("--rollout-id", help="resource attribute lightning.rollout.id for every span")
    p.add_argument("--task-id", help="resource attribute lightning.task.id")
    p.add_argument("--attempt", type=int, help="resource attribute lightning.attempt (sample index)")
    p.add_argument("--service-name", help="OTEL_SERVICE_NAME")
    p.add_argument("--redact", action="append", metavar="REGEX",
                   help="replace matches in every string attribute before export (repeatable)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command")
    p.set_defaults(func=cmd_run)
