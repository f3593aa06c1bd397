"""Does the serving engine see and answer the same prompt as training? The sql_agent's first call on held-out
Spider questions, sent through the vLLM engine's chat endpoint and built the way training builds it.

    .venv/bin/python -m benchmarks.engine_parity [--model FOLDER] [--questions 8] [--max-tokens 48]

For each question: are the engine's recorded prompt token ids the ids that SFT trains on (the tokenizer's chat
template as text, encoded without extra special tokens: benchmarks/peers/plain_sft.py `Prompts.ids`)? And does
the engine's greedy answer equal transformers' greedy answer (float32) token for token, or where do they part?
A doubled BOS, a template the engine renders otherwise, or a precision gap would show here; a policy that scores
lower through the agent than in plain_sft.py's own greedy decoding is checked here first. Writes nothing.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.peers.plain_sft import Prompts
from lightning_otel.serve.engine import EngineConfig, VLLMEngine, default_engine_python
from lightning_otel.serve.model import resolve_model
from lightning_otel.tasks.spider.rewards import bundled_data_dir
from lightning_otel.tasks.spider.splits import HELD_OUT


def held_out_rows(data: Path, count: int) -> list[dict]:
    """The first `count` dev questions of the held-out databases, taken in turn from each."""
    by_db: dict[str, list[dict]] = {db: [] for db in HELD_OUT}
    for line in (data / "dev.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["db_id"] in by_db:
            by_db[row["db_id"]].append(row)
    rows = [row for group in zip(*by_db.values()) for row in group]
    return rows[:count]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where the two id lists differ (the shorter one's length if one extends the other)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local Hugging Face model folder (default: the bundled model)")
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    python = default_engine_python()
    model_dir = resolve_model(args.model, python)
    data = bundled_data_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = Prompts(tokenizer, data)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = VLLMEngine(EngineConfig(model_dir=model_dir, python=python))
    engine.start()
    same_prompt = same_answer = 0
    rows = held_out_rows(data, args.questions)
    try:
        for row in rows:
            trained = prompts.ids(row)
            reply = engine.generate("/v1/chat/completions", {"messages": prompts.messages(row),
                                                             "max_tokens": args.max_tokens, "temperature": 0})
            choice = reply["choices"][0]
            served = reply.get("prompt_token_ids") or choice.get("prompt_token_ids") or []
            with torch.no_grad():
                local = model.generate(torch.tensor([trained]), max_new_tokens=args.max_tokens, do_sample=False,
                                       pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
            local_ids = local[0, len(trained):].tolist()
            engine_ids = choice.get("token_ids") or []
            prompt_at, answer_at = first_difference(trained, served), first_difference(local_ids, engine_ids)
            same_prompt += prompt_at is None
            same_answer += answer_at is None
            print(f"{row['db_id']}: {row['question'][:60]!r}: prompt "
                  f"{'same' if prompt_at is None else f'differs at token {prompt_at} of {len(trained)}'}, "
                  f"greedy answer {'same' if answer_at is None else f'parts at token {answer_at}'} "
                  f"({len(engine_ids)} tokens)", flush=True)
            if prompt_at is not None:
                print("   trained:", repr(tokenizer.decode(trained[max(0, prompt_at - 4):prompt_at + 4])))
                print("   served: ", repr(tokenizer.decode(served[max(0, prompt_at - 4):prompt_at + 4])))
    finally:
        engine.stop()
    print(f"{model_dir}: prompt ids equal on {same_prompt}/{len(rows)} questions, greedy answers equal on "
          f"{same_answer}/{len(rows)}")


if __name__ == "__main__":
    main()
