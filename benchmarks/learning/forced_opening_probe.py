"""How the bundled model continues the gateway's forced tool-call opening, with and without its trailing space.

    .venv/bin/python -m benchmarks.learning.forced_opening_probe --db runs/apo-math/base/heldout.duckdb [--count 6]

Reads the first `count` forced calls of a store (their prompts as the engine got them, the opening
`<tool_call>\\n{"name": "<tool>", "arguments": ` at the end, from lightning.prompt.forced_prefix) and continues
each greedily with Hugging Face transformers on the bundled model, three ways: the opening as sent; the same
opening without its last space; and the opening cut before the name (the model writes the name too). Prints how
many continuations start writing an `"expression"` argument, and the first three of each.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from lightning_otel.serve.engine import default_engine_python
from lightning_otel.serve.model import bundled_model_dir
from lightning_otel.span_store import client

SQL_FORCED = """SELECT attributes::VARCHAR AS a FROM spans WHERE name = 'lightning.generate'
                AND json_extract_string(attributes, '$."lightning.prompt.forced_prefix"') IS NOT NULL
                ORDER BY start_ns LIMIT {count}"""


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--db", type=Path, required=True)
    p.add_argument("--count", type=int, default=6)
    p.add_argument("--tokens", type=int, default=30)
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = bundled_model_dir(python=default_engine_python())
    tokenizer, model = AutoTokenizer.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder)
    records = [json.loads(r["a"]) for r in client.query(SQL_FORCED.format(count=args.count), args.db).to_dicts()]
    result = {}
    for label, cut in (("as sent", lambda o: o), ("without the trailing space", str.rstrip),
                       ("name left to the model", lambda o: o[:o.index('"name": "') + len('"name": "')])):
        texts = []
        for record in records:
            opening = record["lightning.prompt.forced_prefix"]
            prompt = tokenizer.decode(record["lightning.prompt.token_ids"])
            ids = tokenizer(prompt[:-len(opening)] + cut(opening), return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=args.tokens, do_sample=False)
            texts.append(tokenizer.decode(out[0][ids.shape[1]:]))
        writes = sum('"expression"' in t[:40] for t in texts)
        result[label] = {"expression_arguments": writes, "calls": len(texts), "first": texts[:3]}
        print(f"{label}: {writes}/{len(texts)} write an expression argument; e.g. {[t[:60] for t in texts[:3]]}")
    return result


if __name__ == "__main__":
    main()
