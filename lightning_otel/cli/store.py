"""Commands over the trace store: collect, sql, ingest, export (Parquet, or a replay over OTLP), feedback, prune,
schema and the tour."""
from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone
from pathlib import Path

from lightning_otel.cli.options import FORMATS, add_db
from lightning_otel.cli.render import write_table
from lightning_otel.errors import UserError


def cmd_collect(args: argparse.Namespace) -> int:
    from lightning_otel.span_store.collector import CollectorConfig, run_collector
    from lightning_otel.span_store.forwarding import ForwardConfig, parse_headers

    forward = None
    if args.forward:
        forward = ForwardConfig(args.forward, parse_headers(args.forward_header),
                                max_queue_bytes=args.forward_queue_bytes, max_retry_s=args.forward_retry_s)
    elif args.forward_header:
        raise UserError("--forward-header is for --forward: give the endpoint to forward to as well")
    config = CollectorConfig(db=args.db, host=args.host, port=args.port, token=args.token,
                             ingest_token=args.ingest_token, query_token=args.query_token, admin_token=args.admin_token,
                             max_body_bytes=args.max_body_bytes, max_pending_rows=args.max_pending_rows,
                             memory_limit=args.memory_limit, max_result_rows=args.max_result_rows,
                             max_result_bytes=args.max_result_bytes, max_query_memory=args.max_query_memory,
                             max_temp_size=args.max_temp_size,
                             max_inflight_requests=args.max_inflight_requests,
                             max_concurrent_queries=args.max_concurrent_queries,
                             max_queries_per_token=args.max_queries_per_token, query_timeout_s=args.query_timeout_s,
                             query_send_timeout_s=args.query_send_timeout_s, insecure_no_auth=args.insecure_no_auth,
                             forward=forward,
                             **({} if args.decode_workers is None else {"decode_workers": args.decode_workers}),
                             **({} if args.threads is None else {"threads": args.threads}))
    run_collector(config)
    return 0


def cmd_sql(args: argparse.Namespace) -> int:
    from lightning_otel.span_store import client

    table = client.query_arrow(args.query, args.db)
    write_table(table, args.format, args.output)
    return 0


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

    if (args.parquet is None) == (args.otlp is None):
        raise UserError("export needs one of --parquet DIR (files) or --otlp URL (a trace UI's OTLP/HTTP endpoint)")
    if args.otlp is not None:
        return _export_otlp(args)
    if args.where is not None or args.header or args.reward is not None:
        raise UserError("--where, --header and --reward are for --otlp; --parquet writes the whole store")
    written = export_parquet(args.db, args.parquet, overwrite=args.overwrite)
    for table, rows in written.items():
        print(f"{table}: {rows} rows")
    print(f"wrote {args.parquet}")
    return 0


def _export_otlp(args: argparse.Namespace) -> int:
    from lightning_otel.span_store.forwarding import parse_headers
    from lightning_otel.span_store.replay import ReplayConfig, replay

    config = ReplayConfig(db=args.db, url=args.otlp, where=args.where, headers=parse_headers(args.header, "--header"),
                          reward=args.reward, batch_spans=args.batch_spans, max_retry_s=args.retry_s)

    def progress(report, total: int) -> None:
        if sys.stderr.isatty():
            print(f"\r{report.spans} of {total} spans sent", end="", file=sys.stderr, flush=True)

    report = replay(config, progress)
    if sys.stderr.isatty():
        print(file=sys.stderr)
    print(f"sent {report.spans} spans of {report.rollouts} rollouts to {config.endpoint} in {report.requests} "
          f"requests" + (f"; the endpoint rejected {report.rejected_spans} spans" if report.rejected_spans else ""))
    return 1 if report.rejected_spans else 0


def cmd_feedback(args: argparse.Namespace) -> int:
    import getpass

    from lightning_otel.span_store import client
    from lightning_otel.span_store.feedback import Feedback

    author = args.author
    if author is None:
        try:
            author = getpass.getuser()
        except (KeyError, OSError):
            author = None
    row = client.write_feedback(args.db, Feedback(rollout_id=args.rollout, span_id=args.span, name=args.name,
                                                  value=args.value, comment=args.comment, author=author))
    target = (f"span {row['span_id']} of rollout {row['rollout_id']}" if row["span_id"]
              else f"rollout {row['rollout_id']}")
    print(f"stored {row['name']} = {row['value']:g} for {target}" + (f" by {row['author']}" if row["author"] else ""))
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


def cmd_schema(args: argparse.Namespace) -> int:
    from lightning_otel.span_store.reference import schema_markdown

    sys.stdout.write(schema_markdown())
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


def register(sub) -> None:
    p = sub.add_parser("collect", help="run the OTLP/HTTP collector that writes spans into a DuckDB file",
                       description="Receive OTLP/HTTP traces and logs (protobuf or JSON, gzip) and write them "
                                   "into one DuckDB file; serve read-only SQL to other commands.")
    add_db(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1); any other than "
                                                       "loopback needs tokens for every role, or --insecure-no-auth")
    p.add_argument("--insecure-no-auth", action="store_true",
                   help="allow a non-loopback --host with roles that need no token (a network you trust)")
    p.add_argument("--port", type=int, default=4318, help="port (default: 4318, OTLP/HTTP's; 0 = any free)")
    p.add_argument("--token", help="require 'Authorization: Bearer TOKEN' on every request: the token of every "
                                   "role not given its own below")
    p.add_argument("--ingest-token", help="token that may send OTLP (/v1/traces, /v1/logs): the one to give agents")
    p.add_argument("--query-token", help="token that may run read queries (/v1/query)")
    p.add_argument("--admin-token", help="token that may do everything, and the only one that may write records "
                                         "(rewards, tasks, rollout runs: /v1/records; human scores: /v1/feedback) "
                                         "and prune (/v1/prune)")
    p.add_argument("--max-body-bytes", type=int, default=32 * 1024 * 1024,
                   help="largest request body accepted, compressed or not (default: 32 MiB)")
    p.add_argument("--max-pending-rows", type=int, default=200_000,
                   help="rows waiting for a commit before senders are told to retry (503)")
    p.add_argument("--memory-limit", default="2GB", help="DuckDB memory limit (default: 2GB)")
    p.add_argument("--max-result-rows", type=int, default=5_000_000,
                   help="most rows one query may return (default: 5,000,000); more gets 413")
    p.add_argument("--max-result-bytes", type=int, default=512 * 1024 * 1024,
                   help="most bytes (Arrow) one query may return (default: 512 MiB); more gets 413")
    p.add_argument("--max-query-memory", default="auto",
                   help="queries are stopped (413) while the collector's resident memory is over this "
                        "(default: auto, --memory-limit + 1GB)")
    p.add_argument("--max-temp-size", default="10GB",
                   help="most disk queries may spill to <db>.tmp (default: 10GB); more gets 413")
    p.add_argument("--max-inflight-requests", type=int, default=32,
                   help="OTLP requests handled at once; past it, 503 + Retry-After (default: 32)")
    p.add_argument("--max-concurrent-queries", type=int, default=4,
                   help="queries (/v1/query) run at once, apart from ingest's slots (default: 4)")
    p.add_argument("--max-queries-per-token", type=int, default=2,
                   help="queries one token runs at once; past it, 429 + Retry-After (default: 2)")
    p.add_argument("--query-timeout-s", type=float, default=120.0,
                   help="a query running longer is stopped (default: 120)")
    p.add_argument("--query-send-timeout-s", type=float, default=30.0,
                   help="a client that takes no part of its query answer for this long is cut off (default: 30)")
    p.add_argument("--threads", type=int, default=None,
                   help="DuckDB threads for inserts and queries (default: cores - 1, at least 1)")
    p.add_argument("--decode-workers", type=int, default=None,
                   help="processes that decode OTLP bodies (default: cores - 1, 1 to 4; 0 = in the server)")
    p.add_argument("--forward", metavar="URL",
                   help="also send every stored OTLP body on to this OTLP/HTTP endpoint (Phoenix: "
                        "http://127.0.0.1:6006; Langfuse: <host>/api/public/otel; Jaeger or an OTel Collector: "
                        "http://host:4318), in the background: it never delays or fails ingest")
    p.add_argument("--forward-header", action="append", default=[], metavar="K=V",
                   help="a header for --forward's requests, e.g. Authorization='Basic <key>' (repeatable)")
    p.add_argument("--forward-queue-bytes", type=int, default=64 * 1024 * 1024,
                   help="bodies waiting to be forwarded, at most (default: 64 MiB); past it they are dropped "
                        "and counted in /health")
    p.add_argument("--forward-retry-s", type=float, default=300.0,
                   help="how long one body is retried while the endpoint is down or busy (default: 300)")
    p.set_defaults(func=cmd_collect)

    p = sub.add_parser("sql", help="run a read-only SQL query over the trace store",
                       description="Run one read statement. Goes through the running collector when one "
                                   "holds the file, else opens the file read-only.")
    p.add_argument("query", help='e.g. "SELECT name, count(*) FROM spans GROUP BY name"')
    add_db(p)
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
    add_db(p)
    p.set_defaults(func=cmd_ingest)

    p = sub.add_parser("export", help="write the store as Parquet, or replay rollouts to a trace UI over OTLP",
                       description="--parquet DIR: the store as Parquet files, spans and logs partitioned by day. "
                                   "--otlp URL: send the spans of the rollouts --where chooses to an OTLP/HTTP "
                                   "endpoint (Phoenix, Langfuse, Jaeger, an OpenTelemetry Collector), each with "
                                   "lightning.reward, and LLM call spans with lightning.advantage and "
                                   "lightning.policy.version.")
    add_db(p)
    p.add_argument("--parquet", type=Path, metavar="DIR", help="output folder")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    p.add_argument("--otlp", metavar="URL", help="OTLP/HTTP endpoint to replay rollouts to (Phoenix: "
                                                 "http://127.0.0.1:6006; Langfuse: <host>/api/public/otel)")
    p.add_argument("--where", metavar="SQL", help="SQL condition over the rollouts view, e.g. \"task_id = 'x'\" or "
                                                 "\"rollout_id IN ('a', 'b')\" (default: every rollout)")
    p.add_argument("--header", action="append", default=[], metavar="K=V",
                   help="a header for --otlp's requests, e.g. Authorization='Basic <key>' (repeatable)")
    p.add_argument("--reward", metavar="NAME", help="the reward name lightning.reward and lightning.advantage carry "
                                                    "when rollouts have several "
                                                    "(each also gets lightning.reward.<name>)")
    p.add_argument("--batch-spans", type=int, default=1000, help="spans per request (default: 1000)")
    p.add_argument("--retry-s", type=float, default=60.0,
                   help="how long one request is retried while the endpoint is down or busy (default: 60)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("feedback", help="store a person's score for a rollout or one of its spans, as a reward",
                       description="Attach a score (name, value, comment, author) to a rollout, or to one span of "
                                   "it, stored as a reward with source human. Under the name of a reward function "
                                   "it outranks the computed value; under a new name, compile --reward NAME trains "
                                   "on it. Goes through the running collector (it needs the admin token, read from "
                                   "<db>.collector.json) or into the file when none holds it.")
    add_db(p)
    p.add_argument("--rollout", required=True, metavar="ID", help="rollout id (SELECT rollout_id FROM rollouts)")
    p.add_argument("--span", metavar="SPAN_ID", help="score this span of the rollout instead of the whole rollout")
    p.add_argument("--name", required=True, help="reward name the score is stored under")
    p.add_argument("--value", required=True, help="the score, a number")
    p.add_argument("--comment", help="why (stored with the score)")
    p.add_argument("--author", help="who gives the score (default: your user name)")
    p.set_defaults(func=cmd_feedback)

    p = sub.add_parser("prune", help="delete traces that ended before a date",
                       description="Delete whole traces whose last span ended before DATE, and older logs.")
    add_db(p)
    p.add_argument("--before", required=True, metavar="DATE", help="YYYY-MM-DD or ISO timestamp (UTC)")
    p.set_defaults(func=cmd_prune)

    p = sub.add_parser("schema", help="print the reference of every table, view and column (Markdown)")
    p.add_argument("--markdown", action="store_true", help="Markdown output (the only format)")
    p.set_defaults(func=cmd_schema)

    p = sub.add_parser("tour", help="a tour of the trace store over bundled recorded traces (no model needed)")
    p.add_argument("--folder", type=Path, default=Path("lightning-otel-tour"),
                   help="where the tour writes its files (default: ./lightning-otel-tour)")
    p.set_defaults(func=cmd_tour)
