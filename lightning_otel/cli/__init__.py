"""The `lightning-otel` command: parses arguments, calls the library, renders the result.

Heavy modules are imported inside each command, so `lightning-otel --help` stays fast.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

from lightning_otel import __version__
from lightning_otel.errors import UserError

DEFAULT_DB = "traces.duckdb"
FORMATS = ("table", "csv", "json", "parquet")


def _add_db(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", type=Path, default=Path(DEFAULT_DB),
                        help=f"DuckDB trace store file (default: {DEFAULT_DB})")


def _add_task_pack(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument("--reward", required=required,
                        help="reward function: a name a task pack registers (spider_exec, spider_shaped, "
                             "number_match), module:function or path/to/file.py:function")
    parser.add_argument("--task-pack", metavar="NAME",
                        help="task pack (spider, math, an installed one, or module:ATTRIBUTE; default: the pack "
                             "that registers --reward): per-rollout setup such as {db_path}, outcome classes")
    parser.add_argument("--data-dir", type=Path, help="the task pack's data folder, e.g. Spider's layout for "
                                                      "{db_path} (default: the pack's own bundled data)")


def cmd_collect(args: argparse.Namespace) -> int:
    from lightning_otel.span_store.collector import CollectorConfig, run_collector

    config = CollectorConfig(db=args.db, host=args.host, port=args.port, token=args.token,
                             ingest_token=args.ingest_token, query_token=args.query_token, admin_token=args.admin_token,
                             max_body_bytes=args.max_body_bytes, max_pending_rows=args.max_pending_rows,
                             memory_limit=args.memory_limit,
                             **({} if args.decode_workers is None else {"decode_workers": args.decode_workers}))
    run_collector(config)
    return 0


def cmd_sql(args: argparse.Namespace) -> int:
    from lightning_otel.span_store import client

    table = client.query_arrow(args.query, args.db)
    write_table(table, args.format, args.output)
    return 0


def write_table(table, fmt: str, output: Path | None) -> None:
    """Render an Arrow table: a readable table for people, csv/json/parquet for scripts."""
    import polars as pl

    frame = pl.from_arrow(table)
    if fmt == "parquet":
        if output is None and sys.stdout.isatty():
            raise UserError("parquet is binary: give --output FILE, or redirect stdout to a file")
        frame.write_parquet(output or sys.stdout.buffer)
        return
    if fmt == "csv":
        nested = [name for name, dtype in frame.schema.items() if dtype.is_nested()]
        if nested:
            raise UserError(f"CSV cannot hold the nested column(s) {', '.join(nested)}: use --format json, "
                            f"or select scalar columns")
        text = frame.write_csv()
    elif fmt == "json":
        text = frame.write_json() + "\n"
    else:
        with pl.Config(tbl_rows=-1, tbl_cols=-1, fmt_str_lengths=120, tbl_width_chars=200,
                       tbl_hide_dataframe_shape=True, tbl_hide_column_data_types=True):
            text = f"{frame}\n"
    if output:
        output.write_text(text)
    else:
        sys.stdout.write(text)


def cmd_ingest(args: argparse.Namespace) -> int:
    from lightning_otel.span_store import client

    report = client.ingest_files(args.files, args.db)
    print(f"stored {report.spans} spans and {report.logs} log records from {report.requests} requests"
          + (f"; {report.rejected} rejected" if report.rejected else "")
          + (f"; {report.skipped_metrics} metrics requests skipped (metrics are not stored)"
             if report.skipped_metrics else ""))
    for error in report.errors:
        print(f"error: {error}", file=sys.stderr)
    if report.errors:
        print(f"{len(report.errors)} part(s) above could not be loaded; everything else was stored", file=sys.stderr)
        return 1
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from lightning_otel.span_store.export import export_parquet

    written = export_parquet(args.db, args.parquet, overwrite=args.overwrite)
    for table, rows in written.items():
        print(f"{table}: {rows} rows")
    print(f"wrote {args.parquet}")
    return 0


def parse_date(text: str) -> int:
    """A date or ISO timestamp (UTC unless it says otherwise) as ns since the epoch."""
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise UserError(f"--before {text!r} is not a date; use YYYY-MM-DD or an ISO timestamp") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return int(moment.timestamp()) * 1_000_000_000 + moment.microsecond * 1000


def cmd_prune(args: argparse.Namespace) -> int:
    from lightning_otel.span_store import client

    counts = client.prune(args.db, parse_date(args.before))
    print(f"deleted {counts['spans']} spans and {counts['logs']} log records older than {args.before}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from lightning_otel.cli.demo import DemoConfig, comparison_table, run_demo

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
    print(f"traces: lightning-otel sql \"SELECT * FROM rollouts\" --db {folder / 'run' / 'traces.duckdb'}")
    print(f"serve it: lightning-otel serve {folder / 'run'}")
    return 0


def cmd_tour(args: argparse.Namespace) -> int:
    from lightning_otel.span_store import client, tour
    from lightning_otel.span_store.export import export_parquet

    print("A tour of the trace store over traces recorded from LangGraph, CrewAI, AutoGen and the OpenAI SDK.")
    collector = tour.load_samples(args.folder)
    db = collector.db
    try:
        print(f"\ncollector on {collector.url} wrote {db}\n")
        for title, sql in tour.QUERIES:
            print(f"-- {title}\n{sql}")
            write_table(client.query_arrow(sql, db), "table", None)
            print()
        written = export_parquet(db, args.folder / "parquet", overwrite=True)
    finally:
        collector.close()
    print(f"Parquet export: {args.folder / 'parquet'} ({written['spans']} spans, partitioned by day)")
    print(f"Explore: lightning-otel sql \"SELECT * FROM llm_calls\" --db {db}")
    return 0


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


def cmd_rollout(args: argparse.Namespace) -> int:
    from lightning_otel.rollouts.runner import RolloutConfig, run_rollouts

    config = RolloutConfig(tasks=args.tasks, agent=args.agent, n=args.n, concurrency=args.concurrency, db=args.db,
                           base_url=args.base_url, api_key=args.api_key, model=args.model,
                           model_name=args.model_name, reward=args.reward, task_pack=args.task_pack,
                           data_dir=args.data_dir, timeout_s=args.timeout)
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


class Progress:
    """A one-line progress bar on stderr (plain lines when stderr is not a terminal)."""

    def __init__(self, label: str):
        self.label = label
        self.counts: dict[str, int] = {}

    def update(self, result, done: int, total: int) -> None:
        self.counts[result.status] = self.counts.get(result.status, 0) + 1
        width = 30
        bar = "#" * (width * done // total) + "." * (width - width * done // total)
        detail = " ".join(f"{k}={v}" for k, v in sorted(self.counts.items()))
        end = "\n" if done == total or not sys.stderr.isatty() else ""
        sys.stderr.write(f"\r{self.label} [{bar}] {done}/{total} {detail}{end}")
        sys.stderr.flush()


def cmd_compile(args: argparse.Namespace) -> int:
    from lightning_otel.train.compile import CompileConfig, compile_transitions

    model = None if args.model.lower() == "none" else args.model
    frame, account = compile_transitions(CompileConfig(db=args.db, reward=args.reward, gamma=args.gamma,
                                                       advantage=args.advantage, agents=args.agents,
                                                       intermediate=args.intermediate or [],
                                                       turn_weight=args.turn_weight, merge_turns=args.merge_turns,
                                                       model=model, max_length=args.max_length, drift=args.drift))
    frame.write_parquet(args.out)
    print(f"{account.transitions} transitions from {account.compiled_rollouts} of {account.rollouts} rollouts "
          f"({account.transitions_per_episode:.2f} per episode) -> {args.out}")
    for reason, count in sorted(account.excluded.items()):
        print(f"  excluded: {count} rollout(s): {reason}")
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


class StepProgress:
    """Progress of named phases on stderr: one line per phase ("round 2/5 rollouts [####....] 6/16")."""

    def __init__(self) -> None:
        self.label: str | None = None

    def __call__(self, label: str, done: int, total: int) -> None:
        width = 30
        filled = width * done // max(total, 1)
        end = "\n" if done >= total or not sys.stderr.isatty() else ""
        sys.stderr.write(f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}{end}")
        sys.stderr.flush()


def cmd_train(args: argparse.Namespace) -> int:
    from lightning_otel.train import distributed

    if distributed.launched():  # one rank of several (torchrun, deepspeed): rank 0 runs the run, the rest follow
        distributed.init()
        if distributed.rank() > 0:
            distributed.follow()
            return 0
    code = _train(args)
    # Only after a run that ended well: after an error the other ranks may be inside a step rank 0 left, and the
    # launcher stops them when rank 0 exits with an error.
    distributed.release()
    return code


def _train(args: argparse.Namespace) -> int:
    from lightning_otel.train.config import load_config, render_toml

    config = load_config(args.config, args.overrides)
    print(f"# resolved config (saved as {config.output_dir}/config.toml)\n{render_toml(config)}", end="")
    logging.getLogger("lightning_otel.train.metrics").setLevel(logging.INFO)
    if args.offline:
        from lightning_otel.train.offline import train_offline

        if args.db is None:
            raise UserError("--offline trains from a trace store: give --db traces.duckdb")
        state = train_offline(config, args.db, args.where, args.objective, args.min_reward, StepProgress())
    else:
        from lightning_otel.train.trainer import train

        if args.db is not None or args.where is not None:
            raise UserError("--db/--where select stored traces for --offline training; online rounds write "
                            "their traces into <output_dir>/traces.duckdb")
        state = train(config, progress=StepProgress())
    print(f"done: {config.output_dir} (policy version {state['policy_version']}, last {state['last']}, "
          f"best {state['best']})")
    print(f"evaluate it: lightning-otel eval --model {config.output_dir} --tasks TASKS --agent CMD --report DIR")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from lightning_otel.eval import EvalConfig, evaluate
    from lightning_otel.eval.report import terminal_summary

    config = EvalConfig(tasks=args.tasks, agent=args.agent, report=args.report, model=args.model, n=args.n,
                        reward=args.reward, task_pack=args.task_pack,
                        baseline=args.baseline, db=args.db, data_dir=args.data_dir, max_tokens=args.max_tokens,
                        concurrency=args.concurrency, timeout_s=args.timeout, temperature=args.temperature)
    print("eval config: " + ", ".join(f"{k}={v}" for k, v in config.to_dict().items()), file=sys.stderr)
    summary = evaluate(config, progress=Progress("eval").update).summary
    print(terminal_summary(summary))
    print(f"report: {args.report / 'report.md'} (summary.json, plots; traces in {config.db})")
    return 0


def cmd_export_policy(args: argparse.Namespace) -> int:
    from lightning_otel.serve.serving import export_policy

    out = export_policy(args.model, args.out, merge=args.merge)
    kind = "merged model folder" if args.merge else "policy"
    print(f"{kind} written to {out}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from lightning_otel.serve.serving import serve_policy

    def ready(url: str) -> None:
        print(f"serving {args.model} at {url} (OpenAI-compatible; any model name). Ctrl-C stops.", flush=True)
        print(f"  OPENAI_BASE_URL={url} OPENAI_API_KEY=any python your_agent.py", flush=True)

    serve_policy(args.model, port=args.port, db=args.db, ready=ready)
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    from lightning_otel.span_store.reference import schema_markdown

    sys.stdout.write(schema_markdown())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-otel",
        description="Train existing LLM agents with RL from their OpenTelemetry traces.")
    parser.add_argument("--version", action="version", version=f"lightning-otel {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    # DeepSpeed's launcher passes --local_rank=N first; the rank is read from LOCAL_RANK/RANK instead.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("collect", help="run the OTLP/HTTP collector that writes spans into a DuckDB file",
                       description="Receive OTLP/HTTP traces and logs (protobuf or JSON, gzip) and write them "
                                   "into one DuckDB file; serve read-only SQL to other commands.")
    _add_db(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=4318, help="port (default: 4318, OTLP/HTTP's; 0 = any free)")
    p.add_argument("--token", help="require 'Authorization: Bearer TOKEN' on every request: the token of every "
                                   "role not given its own below")
    p.add_argument("--ingest-token", help="token that may send OTLP (/v1/traces, /v1/logs): the one to give agents")
    p.add_argument("--query-token", help="token that may run read queries (/v1/query)")
    p.add_argument("--admin-token", help="token that may do everything, and the only one that may write records "
                                         "(rewards, tasks, rollout runs: /v1/records) and prune (/v1/prune)")
    p.add_argument("--max-body-bytes", type=int, default=32 * 1024 * 1024,
                   help="largest request body accepted, compressed or not (default: 32 MiB)")
    p.add_argument("--max-pending-rows", type=int, default=200_000,
                   help="rows waiting for a commit before senders are told to retry (503)")
    p.add_argument("--memory-limit", default="2GB", help="DuckDB memory limit (default: 2GB)")
    p.add_argument("--decode-workers", type=int, default=None,
                   help="processes that decode OTLP bodies (default: cores - 1, 1 to 4; 0 = in the server)")
    p.set_defaults(func=cmd_collect)

    p = sub.add_parser("sql", help="run a read-only SQL query over the trace store",
                       description="Run one read statement. Goes through the running collector when one "
                                   "holds the file, else opens the file read-only.")
    p.add_argument("query", help='e.g. "SELECT name, count(*) FROM spans GROUP BY name"')
    _add_db(p)
    p.add_argument("--format", choices=FORMATS, default="table", help="output format (default: table)")
    p.add_argument("--output", type=Path, help="write to this file instead of stdout")
    p.set_defaults(func=cmd_sql)

    p = sub.add_parser("ingest", help="load what OpenTelemetry Collectors' file exporters wrote",
                       description="Load the files of the Collector's `file` exporter: format json (one OTLP/JSON "
                                   "request per line) or proto (length-prefixed messages), compression zstd or "
                                   "none, and such files gzip- or zstd-compressed afterwards; the format is read "
                                   "from each file's first bytes. Traces and logs are stored, metrics skipped. "
                                   "A damaged line, message or file is reported and everything else is stored.")
    p.add_argument("files", nargs="+", type=Path, metavar="PATH",
                   help="a file, a folder (its files, recursively: a rotated set) or a quoted glob "
                        "('exports/traces*.json')")
    _add_db(p)
    p.set_defaults(func=cmd_ingest)

    p = sub.add_parser("export", help="write the store as Parquet, spans and logs partitioned by day")
    _add_db(p)
    p.add_argument("--parquet", type=Path, required=True, metavar="DIR", help="output folder")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("prune", help="delete traces that ended before a date",
                       description="Delete whole traces whose last span ended before DATE, and older logs.")
    _add_db(p)
    p.add_argument("--before", required=True, metavar="DATE", help="YYYY-MM-DD or ISO timestamp (UTC)")
    p.set_defaults(func=cmd_prune)

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

    p = sub.add_parser("rollout", help="run an unchanged agent command over a task file, n samples per task",
                       description="Run the agent once per task and sample, each a subprocess under "
                                   "opentelemetry-instrument (an agent function: a call in one worker process "
                                   "under it), recording spans, outcomes and rewards in the store.")
    p.add_argument("--tasks", type=Path, required=True, help="JSONL task file (one object per line)")
    p.add_argument("--agent", required=True,
                   help='command template, e.g. "python agent.py --question {question} --db {db_path}", or an '
                        'agent function called as fn(task, llm) in one worker process: "module:function" or '
                        '"path/to/agent.py:function"')
    p.add_argument("-n", type=int, default=4, help="samples per task (default: 4)")
    p.add_argument("--concurrency", type=int, default=2, help="rollouts at a time (default: 2)")
    _add_db(p)
    p.add_argument("--model", help="policy to serve: a local Hugging Face model folder (default: the bundled "
                                   "SmolLM2-135M-Instruct), through vLLM and the token-recording gateway")
    p.add_argument("--base-url", help="instead of serving --model: an outside OpenAI-compatible endpoint the "
                                      "agents call (no token records)")
    p.add_argument("--api-key", help="OPENAI_API_KEY given to the agents")
    p.add_argument("--model-name", default="policy", help="model name for {model} and LIGHTNING_MODEL "
                                                          "(the gateway serves the policy under any name)")
    _add_task_pack(p, required=False)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per rollout (default: 300)")
    p.set_defaults(func=cmd_rollout)

    p = sub.add_parser("compile", help="turn stored rollouts into training transitions (Parquet)",
                       description="Per rollout: LLM calls in order with their token records, the episode "
                                   "reward, return and group-normalised advantage.")
    _add_db(p)
    p.add_argument("--out", type=Path, required=True, help="Parquet file to write")
    p.add_argument("--reward", help="reward name (default: the only one stored)")
    p.add_argument("--gamma", type=float, default=1.0, help="discount per later LLM call (default: 1)")
    p.add_argument("--advantage", default="per-rollout",
                   help="per-rollout: group statistics over rollouts (default); per-transition: over transitions "
                        "(Agent Lightning's legacy); batch-baseline: groups, lone rollouts against each other; "
                        "reinforce_pp: one baseline over the whole batch, no groups (REINFORCE++, its sequence "
                        "part: the trainer adds the token-level KL); none")
    p.add_argument("--agents", metavar="REGEX", help="train only LLM calls of agents whose whole name matches this pattern")
    p.add_argument("--intermediate", action="append", metavar="NAME",
                   help="a reward name whose rows on inner spans add to the returns of their scope (repeatable)")
    p.add_argument("--turn-weight", type=float, default=0.0,
                   help="lambda of the turn-level term A_t = A + lambda * z_t (default 0: off)")
    p.add_argument("--merge-turns", action="store_true",
                   help="merge consecutive turns whose tokens extend the previous turn into one sample")
    p.add_argument("--model", default="bundled",
                   help="tokenizer and chat template for calls without a token record: a local Hugging Face model "
                        "folder (default: the bundled model; 'none' excludes such rollouts instead)")
    p.add_argument("--max-length", type=int, metavar="TOKENS",
                   help="exclude rollouts with a call longer than this (prompt + completion tokens)")
    p.add_argument("--drift", action="store_true",
                   help="also re-tokenise calls that have a token record and report how often the ids differ")
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser("eval", help="evaluate a policy with an agent over a task file and write a report",
                       description="Run the agent over the tasks (-n samples each) with the policy served "
                                   "through vLLM and the gateway, score with --reward, and report accuracy (by "
                                   "the task pack's group field, e.g. Spider's hardness), transitions and tokens "
                                   "per episode, outcome classes and latency, all computed from the trace store.")
    p.add_argument("--tasks", type=Path, required=True, help="JSONL task file, one task object per line")
    p.add_argument("--agent", required=True,
                   help='command template, e.g. "python agent.py --question {question} --db {db_path}"')
    p.add_argument("--model", default="base",
                   help="base (the bundled model), a training run folder (its best checkpoint), a checkpoint, a "
                        "LoRA adapter folder or a model folder (default: base)")
    p.add_argument("-n", type=int, default=1, help="samples per task (default: 1)")
    p.add_argument("--report", type=Path, required=True, metavar="DIR",
                   help="folder for report.md, summary.json and the plots")
    p.add_argument("--baseline", type=Path, metavar="DIR", help="another eval's --report folder to compare with")
    p.add_argument("--db", type=Path, help="DuckDB trace store (default: DIR/traces.duckdb)")
    _add_task_pack(p, required=True)
    p.add_argument("--max-tokens", type=int, help="cap on the tokens of each generation (default: the agent's)")
    p.add_argument("--temperature", type=float,
                   help="sampling temperature forced on every request, 0 = greedy (default: the agent's own)")
    p.add_argument("--concurrency", type=int, default=2, help="rollouts at a time (default: 2)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per rollout (default: 300)")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("demo", help="the main job on embedded defaults: eval, SFT + GRPO training, eval again",
                       description="Train the plain-OpenAI SQL example agent on bundled Spider data with the "
                                   "bundled model: baseline eval, SFT warm start, GRPO rounds, eval, report.")
    p.add_argument("--folder", type=Path, default=Path("lightning-otel-demo"),
                   help="where the demo writes a fresh run-<time> folder (default: ./lightning-otel-demo)")
    p.add_argument("--quick", action="store_true", help="a few minutes: 2 tasks x 2 samples, short generations")
    p.add_argument("--agent", help="another agent command with {question} and {db_path} placeholders")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("tour", help="a tour of the trace store over bundled recorded traces (no model needed)")
    p.add_argument("--folder", type=Path, default=Path("lightning-otel-tour"),
                   help="where the tour writes its files (default: ./lightning-otel-tour)")
    p.set_defaults(func=cmd_tour)

    p = sub.add_parser("train", help="train the agent's policy: rounds of rollout and GRPO, or --offline",
                       description="Rounds of rollout (vLLM through the gateway) and GRPO under DeepSpeed, "
                                   "resumable: run the same command again after an interruption. Settings "
                                   "come from --config (TOML) and key=value arguments (later wins).")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="settings over the config file, e.g. rounds=3")
    p.add_argument("--config", type=Path, help="TOML file with train settings (keys: see docs or README)")
    p.add_argument("--offline", action="store_true", help="train on traces already in --db, no new rollouts")
    p.add_argument("--db", type=Path, help="with --offline: the trace store to train from")
    p.add_argument("--where", help="with --offline: SQL condition on the rollouts view, e.g. \"status = 'ok'\"")
    p.add_argument("--objective", choices=("grpo", "sft"), default="grpo",
                   help="with --offline: GRPO (batch baseline where no groups) or SFT on successful rollouts")
    p.add_argument("--min-reward", type=float, default=1.0, help="with --objective sft: the success threshold")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("export-policy", help="write a trained policy as a LoRA adapter or a merged model folder")
    p.add_argument("model", help="a training run folder (its best checkpoint), a checkpoint or an adapter folder")
    p.add_argument("--out", type=Path, required=True, help="new folder to write")
    p.add_argument("--merge", action="store_true", help="merge the adapter into the base model's weights")
    p.set_defaults(func=cmd_export_policy)

    p = sub.add_parser("serve", help="serve a trained policy behind the OpenAI-compatible gateway",
                       description="Start vLLM on the policy's base model with its adapter and the gateway in "
                                   "front; with --db every call is recorded in that trace store.")
    p.add_argument("model", help="base, a training run folder, a checkpoint, an adapter or a model folder")
    p.add_argument("--port", type=int, default=8000, help="gateway port on 127.0.0.1 (default: 8000)")
    p.add_argument("--db", type=Path, help="record the served calls in this trace store")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("schema", help="print the reference of every table, view and column (Markdown)")
    p.add_argument("--markdown", action="store_true", help="Markdown output (the only format)")
    p.set_defaults(func=cmd_schema)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0

