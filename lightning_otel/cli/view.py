"""`lightning-otel view`: the local, read-only web viewer of a trace store or a run folder (docs/viewer.md)."""
from __future__ import annotations

import argparse
import threading
import webbrowser
from pathlib import Path


def cmd_view(args: argparse.Namespace) -> int:
    from lightning_otel.view.server import ViewConfig, Viewer, link_to

    config = ViewConfig(db=args.db, run=args.run, transitions=args.transitions, model=args.model, reward=args.reward,
                        host=args.host, port=args.port, insecure_no_auth=args.insecure_no_auth)
    viewer = Viewer(config)
    address = link_to(viewer)
    live = viewer.source.collector()
    how = f"through the collector at {live.url}" if live else "read-only from the file"
    print(f"viewing {config.db} ({how}) at {address}\nstop with Ctrl-C", flush=True)
    if args.open:
        webbrowser.open(address)
    viewer.start()
    try:
        threading.Event().wait()
    finally:
        viewer.close()
    return 0


def register(sub) -> None:
    p = sub.add_parser("view", help="browse rollouts, span trees, rewards and token credit in a local web page",
                       description="Serve a local, read-only web page over a trace store (--db) or a training run "
                                   "folder (--run): rollouts with filters, one rollout's span tree and messages, its "
                                   "transitions' tokens coloured by advantage, a task's group, the run's rounds, and "
                                   "two policy versions compared. When a collector holds the store the page reads "
                                   "through it and needs its query token (the printed address carries it).")
    p.add_argument("--db", type=Path, help="DuckDB trace store (default with --run: RUN/traces.duckdb)")
    p.add_argument("--run", type=Path, metavar="RUN_FOLDER",
                   help="a `lightning-otel train` output_dir: its store, metrics.jsonl and transitions.parquet")
    p.add_argument("--transitions", type=Path, metavar="PARQUET",
                   help="transitions from `lightning-otel compile --out` (default: RUN/transitions.parquet, else the "
                        "store's transitions view)")
    p.add_argument("--model", default="bundled",
                   help="whose tokenizer shows token ids as text: bundled, or a model folder (default: bundled)")
    p.add_argument("--reward", help="the reward name shown first (default: the most stored episode reward)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8765, help="port (default: 8765; 0 picks a free one)")
    p.add_argument("--open", action="store_true", help="open the page in the default browser")
    p.add_argument("--insecure-no-auth", action="store_true",
                   help="allow a non-loopback --host although the page would answer without a token")
    p.set_defaults(func=cmd_view)
