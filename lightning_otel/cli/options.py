"""Options that mean the same in every command that takes them."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_DB = "traces.duckdb"
FORMATS = ("table", "csv", "json", "parquet")


def add_db(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", type=Path, default=Path(DEFAULT_DB),
                        help=f"DuckDB trace store file (default: {DEFAULT_DB})")


def add_chat_template(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--chat-template", type=Path, metavar="FILE",
                        help=f"a Jinja chat template that {what} instead of the model's own (one that renders "
                             "`tools`, like Qwen's, shows the model its tools natively; docs/rollouts.md)")


def add_prompt(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--prompt", type=Path, metavar="FILE",
                        help=f"a prompt patch file (JSON; docs/prompts.md) for {what}: the calls of the agents its "
                             "patches target get their system message changed or demonstrations added, and their "
                             "token records the patch's version and id")


def add_tool_format(parser: argparse.ArgumentParser) -> None:
    from lightning_otel.serve.toolcalls import FORMATS

    parser.add_argument("--tool-format", choices=list(FORMATS), metavar="NAME",
                        help=f"the syntax the model writes tool calls in: {', '.join(FORMATS)} (default: detected "
                             "from the chat template, else hermes; docs/rollouts.md)")


def add_task_pack(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument("--reward", required=required,
                        help="reward function: a name a task pack registers (spider_exec, spider_shaped, "
                             "number_match), module:function or path/to/file.py:function")
    parser.add_argument("--task-pack", metavar="NAME",
                        help="task pack (spider, math, an installed one, or module:ATTRIBUTE; default: the pack "
                             "that registers --reward): per-rollout setup such as {db_path}, outcome classes")
    parser.add_argument("--data-dir", type=Path, help="the task pack's data folder, e.g. Spider's layout for "
                                                      "{db_path} (default: the pack's own bundled data)")

SAMPLES = 4  # -n: samples per task, the same default in every command


class DeprecatedAlias(argparse.Action):
    """An option's spelling of the previous release: it still works for this one, with a note on stderr."""

    def __init__(self, option_strings, dest, new: str, **kwargs):
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"note: {option_string} is now {self.new}; the old spelling goes in the next release", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_samples(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", type=int, default=SAMPLES, help=f"samples per task (default: {SAMPLES})")


def add_rollout_timeout(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rollout-timeout", type=float, default=300.0, dest="rollout_timeout", metavar="SECONDS",
                        help="seconds one rollout may run before it is killed (default: 300)")
    parser.add_argument("--timeout", type=float, dest="rollout_timeout", action=DeprecatedAlias,
                        new="--rollout-timeout", help=argparse.SUPPRESS)


def add_outside_endpoint(p: argparse.ArgumentParser, instead_of: str) -> None:
    """--base-url, --base-model, --api-key-env: a closed model behind an OpenAI-compatible endpoint, which the
    gateway forwards to with the prompt patch applied and records as text."""
    p.add_argument("--base-url", help=f"instead of {instead_of}: an outside OpenAI-compatible endpoint (a closed "
                                      f"model) the gateway forwards the agents' calls to, with --prompt applied, "
                                      f"recorded as text (no token ids)")
    p.add_argument("--base-model", help="with --base-url: the model name every call is sent with (and {model})")
    p.add_argument("--api-key-env", help="with --base-url: the environment variable holding its key (default: the "
                                         "agents' own key goes through)")
