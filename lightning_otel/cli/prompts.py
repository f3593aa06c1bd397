"""`lightning-otel export-prompt`: the agents' prompts from stored traces, or the prompts a patch file makes."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lightning_otel.errors import UserError


def cmd_export_prompt(args: argparse.Namespace) -> int:
    from lightning_otel.serve import prompt_export
    from lightning_otel.serve.prompts import load_patches

    if args.patches is None:
        if args.db is None:
            raise UserError("give a patch file (its patched prompts), or --db (each agent's prompt as stored)")
        if args.id is not None:
            raise UserError("--id picks a patch of the patch file: give the file")
        rows = prompt_export.agent_prompts(args.db)
        if not rows:
            raise UserError(f"{args.db}: no stored LLM call has both an agent (an agent, task or graph node span "
                            f"above it) and a system message, so there is no agent prompt to export")
        for fp, agents in prompt_export.shared_fingerprints(rows).items():
            print(f"note: agents {', '.join(agents)} send the same system message ({fp}): the gateway cannot patch "
                  f"one of them alone", file=sys.stderr)
        text = (json.dumps({"agents": prompt_export.agents_map(rows), "patches": []}, indent=2) + "\n"
                if args.format == "json" else prompt_export.render_agents_text(rows))
    else:
        prompts = prompt_export.patched_prompts(load_patches(args.patches), args.id, args.db)
        text = (json.dumps(prompts if args.id is None else prompts[0], indent=2) + "\n" if args.format == "json"
                else prompt_export.render_text(prompts))
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.write_text(text, encoding="utf-8")
        print(f"written to {args.out}", file=sys.stderr)
    return 0


def register(sub) -> None:
    p = sub.add_parser("export-prompt", help="write the prompts a patch file makes, or each agent's from traces",
                       description="With a patch file: the system text and demonstrations each patch (or the one "
                                   "with --id) gives its agent, to put in your own code. With --db alone: each "
                                   "agent's system message(s) as its stored calls sent them, with fingerprints; "
                                   "--format json writes them as the \"agents\" map of a new patch file.")
    p.add_argument("patches", nargs="?", type=Path, metavar="PATCHES", help="a prompt patch file (docs/prompts.md)")
    p.add_argument("--id", help="only the patch with this id")
    p.add_argument("--db", type=Path, help="a trace store: the agents' prompts as stored (and, with a patch file, "
                                           "the base text a patch extends when the file does not give it)")
    p.add_argument("--format", choices=("text", "json"), default="text", help="plain text (default) or JSON")
    p.add_argument("--out", type=Path, metavar="FILE", help="write here instead of to stdout")
    p.set_defaults(func=cmd_export_prompt)
