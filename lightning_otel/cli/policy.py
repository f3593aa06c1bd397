"""Using a trained policy: export-policy (an adapter or a merged model folder) and serve (behind the gateway)."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from lightning_otel.cli.options import add_chat_template, add_outside_endpoint, add_prompt, add_tool_format

API_KEY_ENV = "LIGHTNING_OTEL_API_KEY"


def cmd_export_policy(args: argparse.Namespace) -> int:
    from lightning_otel.train.checkpoints import export_policy

    out = export_policy(args.model, args.out, merge=args.merge, eval_reports=args.eval_report or [])
    kind = "merged model folder" if args.merge else "policy"
    print(f"{kind} written to {out} (model card: {out / 'README.md'})")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from lightning_otel.serve.serving import serve_policy

    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None

    def ready(url: str) -> None:
        what = args.model or f"{args.base_url} (forwarded, recorded as text)"
        print(f"serving {what} at {url} (OpenAI-compatible; any model name). Ctrl-C stops.", flush=True)
        key = "<the API key>" if api_key else "any"
        print(f"  OPENAI_BASE_URL={url} OPENAI_API_KEY={key} python your_agent.py", flush=True)

    serve_policy(args.model, port=args.port, db=args.db, ready=ready, chat_template=args.chat_template,
                 host=args.host, api_key=api_key, insecure_no_auth=args.insecure_no_auth, tool_format=args.tool_format,
                 prompt=args.prompt, base_url=args.base_url, base_model=args.base_model, api_key_env=args.api_key_env)
    return 0


def register(sub) -> None:
    p = sub.add_parser("export-policy", help="write a trained policy as a LoRA adapter or a merged model folder")
    p.add_argument("model", help="a training run folder (its best checkpoint), a checkpoint or an adapter folder "
                                 "(a model folder or a hub id org/name[@revision] is copied as is)")
    p.add_argument("--out", type=Path, required=True, help="new folder to write")
    p.add_argument("--merge", action="store_true", help="merge the adapter into the base model's weights")
    p.add_argument("--eval-report", type=Path, action="append", metavar="DIR",
                   help="an eval --report folder to summarise in the model card (repeatable; reports inside the "
                        "run folder are found without it)")
    p.set_defaults(func=cmd_export_policy)

    p = sub.add_parser("serve", help="serve a trained policy behind the OpenAI-compatible gateway",
                       description="Start vLLM on the policy's base model with its adapter and the gateway in "
                                   "front; with --db every call is recorded in that trace store.")
    p.add_argument("model", nargs="?", help="base, a training run folder, a checkpoint, an adapter, a model folder "
                                            "or a Hugging Face hub id (org/name or org/name@revision); none with "
                                            "--base-url")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1); any other than "
                                                       "loopback needs --api-key, or --insecure-no-auth")
    p.add_argument("--port", type=int, default=8000, help="gateway port (default: 8000)")
    p.add_argument("--api-key", help=f"requests must send 'Authorization: Bearer KEY' (OpenAI clients: "
                                     f"OPENAI_API_KEY); default: the {API_KEY_ENV} environment variable, which keeps "
                                     f"it out of the process list")
    p.add_argument("--insecure-no-auth", action="store_true",
                   help="allow a non-loopback --host without an API key (a network you trust)")
    p.add_argument("--db", type=Path, help="record the served calls in this trace store")
    add_chat_template(p, "the gateway renders prompts with")
    add_tool_format(p)
    add_prompt(p, "the served traffic")
    add_outside_endpoint(p, "a policy")
    p.set_defaults(func=cmd_serve)
