"""Tool-use learning benchmark: GRPO on an OpenAI Agents SDK calculator agent, scored on held-out problems.

    .venv/bin/python benchmarks/math_agent.py --out /tmp/math [--rounds 16] [--autocast]

The agent is examples/openai_agents_math/agent.py, unchanged: an `openai-agents` Agent with one
`calculate(expression)` tool, traced by the SDK's own OpenTelemetry instrumentation and run as an agent
function in one worker process. The data is examples/openai_agents_math/problems.py: two-step arithmetic
word problems, train and test from disjoint templates and number ranges (train 2-40, test 41-99).

1. The held-out test set is scored greedily on the base model (number_match: the last number of the reply
   is the answer).
2. GRPO from the base model: every round samples --tasks-per-round problems of the train pool, -n each,
   rewarded by examples/openai_agents_math/reward.py:shaped (1 right; 0.6 right tool result unsaid; a
   wrong expression the tool could evaluate 0.1 + 0.3 x the share of the question's numbers it used; 0 no
   usable call); validation on the test set every --val-every
   rounds (greedy) draws the curve.
3. The test set is scored greedily again on the last checkpoint. The gain is paired (the same problems before
   and after): the two-sided exact McNemar test on the problems that changed.

Written to <out>: math_agent.json (accuracies, per-problem outcomes, p, seconds, per-round curve),
math_agent.png. Exit status 0 when the gain is at least --min-gain points with p < --alpha.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from lightning_otel.engine import EngineConfig, VLLMEngine, default_engine_python
from lightning_otel.model import resolve_model
from lightning_otel.runner import RolloutConfig, run_rollouts
from lightning_otel.train.config import TrainConfig
from lightning_otel.train.trainer import train

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "openai_agents_math"
sys.path.insert(0, str(EXAMPLE))
import problems  # noqa: E402  (the example's generator, not a package)

AGENT = f"{EXAMPLE / 'agent.py'}:run"
REWARD = f"{EXAMPLE / 'reward.py'}:shaped"


def mcnemar_p(gained: int, lost: int) -> float:
    """Two-sided exact McNemar p: of the problems whose outcome changed, `gained` went right and `lost` wrong."""
    changed = gained + lost
    if changed == 0:
        return 1.0
    tail = sum(math.comb(changed, k) for k in range(min(gained, lost) + 1)) / 2 ** changed
    return min(1.0, 2 * tail)


def write(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def score(engine, tasks: Path, db: Path, concurrency: int, max_tokens: int) -> dict[str, float]:
    """One greedy rollout per task on what `engine` serves now: task id -> 1.0 right / 0.0 wrong."""
    summary = run_rollouts(RolloutConfig(tasks=tasks, agent=AGENT, n=1, concurrency=concurrency, db=db,
                                         reward="number_match", temperature=0.0, max_tokens=max_tokens,
                                         timeout_s=300), engine=engine)
    return {r.task_id: float(r.reward or 0.0) for r in summary.results}


def curve(run: Path) -> list[dict]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    keep = ("reward_mean", "zero_variance_groups", "transitions_per_episode", "first_ratio_mean",
            "served_policy_versions", "rollout_seconds", "train_seconds", "val_accuracy", "val_reward_mean")
    rounds: dict[int, dict] = {}
    for r in records:
        rounds.setdefault(r["round"], {}).update({k: r[k] for k in keep if r.get(k) is not None})
    return [{"round": k, **v} for k, v in sorted(rounds.items())]


def plot(result: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = result["curve"]
    figure, axis = plt.subplots(figsize=(7, 4))
    trained = [p for p in points if p.get("reward_mean") is not None]
    axis.plot([p["round"] for p in trained], [p["reward_mean"] for p in trained], marker="o",
              label="rollout reward (train pool, shaped)")
    validated = [p for p in points if p.get("val_accuracy") is not None]
    axis.plot([p["round"] for p in validated], [p["val_accuracy"] for p in validated], marker="s",
              label="held-out accuracy (test templates, greedy)")
    axis.set(xlabel="round", ylabel="reward / accuracy", ylim=(0, 1),
             title=f"calculator agent: held-out {result['base_accuracy']:.1%} -> {result['final_accuracy']:.1%} "
                   f"(p={result['p']:.2g})")
    axis.grid(alpha=0.3)
    axis.legend(loc="best")
    figure.tight_layout()
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--pool", type=int, default=64, help="train problems (rounds cycle through them)")
    p.add_argument("--test", type=int, default=96, help="held-out problems")
    p.add_argument("--tasks-per-round", type=int, default=16)
    p.add_argument("-n", type=int, default=4, help="samples per problem (the GRPO group)")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--val-every", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--autocast", action="store_true", help="bf16 forward passes (CPUs with bf16 instructions)")
    p.add_argument("--min-gain", type=float, default=0.15)
    p.add_argument("--alpha", type=float, default=0.01)
    return p.parse_args(argv)


def run(args, engine=None) -> dict:
    args.out.mkdir(parents=True, exist_ok=True)
    pool = write(problems.make("train", args.pool, args.seed), args.out / "train.jsonl")
    test = write(problems.make("test", args.test, args.seed), args.out / "test.jsonl")
    owned = engine is None
    if owned:
        python = default_engine_python()
        engine = VLLMEngine(EngineConfig(model_dir=resolve_model("bundled", python), python=python,
                                         max_lora_rank=max(16, args.lora_rank), log_path=args.out / "engine.log"))
        engine.start()
    began = time.perf_counter()
    try:
        engine.use_base()
        base = score(engine, test, args.out / "eval.duckdb", args.concurrency, args.max_tokens)
        trained_at = time.perf_counter()
        train(TrainConfig(tasks=str(pool), val_tasks=str(test), val_every=args.val_every, agent=AGENT,
                          reward=REWARD, output_dir=str(args.out / "run"), n=args.n,
                          tasks_per_round=args.tasks_per_round, rounds=args.rounds, lr=args.lr,
                          lora_rank=args.lora_rank, max_tokens=args.max_tokens, temperature=args.temperature,
                          batch_size=args.batch_size, micro_batch=args.micro_batch, concurrency=args.concurrency,
                          epochs=args.epochs, seed=args.seed, autocast=args.autocast),
              engine=engine, progress=lambda label, done, total: print(f"\r{label}: {done}/{total}  ", end="",
                                                                       flush=True))
        train_seconds = time.perf_counter() - trained_at
        final = score(engine, test, args.out / "eval.duckdb", args.concurrency, args.max_tokens)
    finally:
        if owned:
            engine.stop()
        else:
            engine.use_base()
    ids = sorted(base)
    gained = sum(1 for i in ids if final.get(i, 0.0) > base[i])
    lost = sum(1 for i in ids if final.get(i, 0.0) < base[i])
    result = {"args": {k: str(v) for k, v in vars(args).items()},
              "base_accuracy": sum(base.values()) / len(ids), "final_accuracy": sum(final.get(i, 0.0) for i in ids) / len(ids),
              "gained": gained, "lost": lost, "p": mcnemar_p(gained, lost),
              "train_seconds": train_seconds, "total_seconds": time.perf_counter() - began,
              "base": base, "final": final, "curve": curve(args.out / "run")}
    result["gain"] = result["final_accuracy"] - result["base_accuracy"]
    result["passed"] = result["gain"] >= args.min_gain and result["p"] < args.alpha
    (args.out / "math_agent.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "math_agent.png")
    return result


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    result = run(args)
    print()
    for p in result["curve"]:
        print("  ", p["round"], *(f"{k}={p[k]:.3f}" if isinstance(p.get(k), float) else f"{k}={p.get(k)}"
                                  for k in ("reward_mean", "val_accuracy", "zero_variance_groups",
                                            "transitions_per_episode", "rollout_seconds", "train_seconds")))
    print(json.dumps({k: result[k] for k in ("base_accuracy", "final_accuracy", "gain", "gained", "lost", "p",
                                             "train_seconds", "passed")}))
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
