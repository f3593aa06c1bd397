"""How much does the engine gain from calls that arrive together? The same requests sent at several
concurrency levels, side by side on one vLLM engine: what `--concurrency` (rollouts, eval) and the trainer's
`concurrency` buy when the agent is a function (its rollouts are threads of one worker, so only the engine's
batching limits them).

    .venv/bin/python benchmarks/engine_batching.py [--levels 4 16] [--repeats 2] [--model bundled]

The requests: the one-call SQL agent's chat (lightning_otel.tasks.spider.loop_check.messages: schema + question)
for the learning-loop check's pool of 4 bundled dev questions x 4 samples, max_tokens 32, temperature 0.7, as
that check's rounds send them.
Each level runs `--repeats` times, the levels alternating, so a slow stretch of a shared machine hits every level.
Prints seconds, generated tokens and tokens per second per run, and each level's tokens per second against the
first level's (summed over its runs). Writes nothing.
"""
from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lightning_otel.serve.engine import EngineConfig, VLLMEngine, default_engine_python
from lightning_otel.serve.model import resolve_model
from lightning_otel.tasks.spider.loop_check import DATABASES, messages, pick
from lightning_otel.tasks.spider.rewards import bundled_data_dir, database_path


def requests(questions: int, samples: int, max_tokens: int) -> list[dict]:
    """learning_check's pool questions, each as the one-call agent asks it, `samples` times."""
    return [{"messages": messages(database_path(bundled_data_dir(), row["db_id"]), row["question"]),
             "max_tokens": max_tokens, "temperature": 0.7}
            for row in pick(DATABASES, questions) for _ in range(samples)]


def timed(engine, bodies: list[dict], concurrency: int) -> tuple[float, int]:
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(lambda body: engine.generate("/v1/chat/completions", body), bodies))
    return time.perf_counter() - started, sum(len(a["choices"][0]["token_ids"]) for a in answers)


def comparison_parser(doc: str) -> argparse.ArgumentParser:
    """The options of a benchmark that compares engines started two ways on these requests: runs, concurrency,
    the requests and the model (engine_cores.py, engine_contention.py)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--model", default="bundled")
    return p


def model_and_requests(args: argparse.Namespace) -> tuple[str, Path, list[dict]]:
    """(the engine's Python, the model folder, the request bodies) that comparison_parser's options name."""
    python = default_engine_python()
    return python, resolve_model(args.model, python), requests(args.questions, args.samples, args.max_tokens)


def engine_started_with(model_dir: Path, python: str, log_path: Path, **environ: str) -> VLLMEngine:
    """A started engine whose process saw these environment variables (EngineConfig.env)."""
    engine = VLLMEngine(EngineConfig(model_dir=model_dir, python=python, log_path=log_path, env=environ))
    engine.start()
    return engine


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--levels", type=int, nargs="+", default=[4, 16])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--model", default="bundled")
    args = p.parse_args(argv)
    python = default_engine_python()
    engine = VLLMEngine(EngineConfig(model_dir=resolve_model(args.model, python), python=python, max_lora_rank=16))
    engine.start()
    totals = {level: [0.0, 0] for level in args.levels}
    try:
        bodies = requests(args.questions, args.samples, args.max_tokens)
        timed(engine, bodies[:2], 2)  # warm-up, not counted
        for repeat in range(args.repeats):
            for level in args.levels:
                seconds, tokens = timed(engine, bodies, level)
                totals[level][0] += seconds
                totals[level][1] += tokens
                print(f"run {repeat + 1} concurrency {level}: {len(bodies)} requests in {seconds:.1f} s, "
                      f"{tokens} tokens, {tokens / seconds:.1f} tokens/s", flush=True)
    finally:
        engine.stop()
    first = totals[args.levels[0]][1] / totals[args.levels[0]][0]
    summary = {level: {"tokens_per_s": tokens / seconds, "against_first": tokens / seconds / first}
               for level, (seconds, tokens) in totals.items()}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
