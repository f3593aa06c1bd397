"""Learning-loop check: does GRPO move the reward it is given, on a fixed pool of tasks, and only that way?

    .venv/bin/python -m benchmarks.learning.learning_check --out /tmp/loop [--rounds 10] [--pool 4] [-n 4] [--autocast]
        [--advantage reinforce-pp --kl 0.05]   # REINFORCE++ instead of GRPO's per-rollout advantage
        [--advantage ppo]                       # PPO: a learned critic (a value head on the policy), GAE over turns

Two runs from the same base model, side by side on one engine, with a one-call SQL agent (the first turn of the
plain-OpenAI example, lightning_otel.tasks.spider.loop_check.answer; `--agent openai_sql` runs the three-turn
example itself), an agent function run in one worker process:
  reward    trained on REWARD (below), a continuous score of the agent's final output;
  inverted  the control: trained on 1 - REWARD.
Every round of both runs uses the same pool of Spider questions (tasks_per_round = pool size), so the
rollout reward of round r is the policy of round r - 1 scored on the same tasks: a curve that rises means the
updates moved the policy towards the reward, and the control, scored on REWARD too, must fall. Both validate
every round on a fixed set of other questions (val_tasks, greedy), before the first round as well.

Printed and saved (<out>/learning_check.json, <out>/learning_check.png): per round the reward mean of both
runs, the validation reward and accuracy, the first micro-batch's ratio mean, clip fraction and learner-engine
logprob gap (before any update the learner is the policy that sampled: ratio ~1, gap ~0), and the policy
versions the gateway recorded (each round must be served the checkpoint of the round before). Passes when the
reward run rises by at least --min-rise and the control falls, each from the start to the mean of its last two
rounds; the start is the base policy's reward on the pool, the mean of both runs' first rounds (the same policy
on the same tasks: twice the samples of one run's).

REWARD is 0.5 for a final answer that executes as SQL on the task's database, plus 0.5 / (1 + words / 10)
for brevity: continuous (almost every GRPO group has reward variance) and reachable by the bundled 135M
model. It checks the loop, not the task: a held-out gain is the learning benchmarks' job. The reward, the
questions and the agent are lightning_otel.tasks.spider.loop_check's; the curves are read and judged by
lightning_otel.eval.loop_check.

Defaults (lr 1e-3 on a LoRA adapter, 2 passes over each round's transitions, sampling at temperature 0.7)
are what moved the reward within a few rounds here; at temperature 1 with lr 2e-4 and one pass, three rounds
did not (benchmarks/RESULTS.md). Exit status 0 when every check passes.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.learning.grpo_knobs import add_knobs, knob_settings
from lightning_otel.eval.loop_check import mirrored, round_curve, verdict
from lightning_otel.serve.engine import EngineConfig, VLLMEngine, default_engine_python
from lightning_otel.serve.model import resolve_model
from lightning_otel.tasks.spider import loop_check
from lightning_otel.tasks.spider.loop_check import DATABASES, pick
from lightning_otel.tasks.spider.splits import write_rows as write
from lightning_otel.train.config import TrainConfig
from lightning_otel.train.trainer import train

REPO = Path(__file__).resolve().parents[2]
AGENTS = {  # --agent names: agent functions, run in one worker process (or give any command or module:function)
    "one-call": loop_check.AGENT,
    "openai_sql": f"{REPO / 'examples' / 'openai_sql' / 'agent.py'}:run",  # three calls when its SQL fails
}


def settings(args, out: Path) -> dict:
    chosen = pick(DATABASES, args.pool + args.val)
    return dict(tasks=str(write(chosen[:args.pool], out / "pool.jsonl")),
                val_tasks=str(write(chosen[args.pool:], out / "val.jsonl")) if args.val else "",
                agent=AGENTS.get(args.agent, args.agent), task_pack="spider", n=args.n, tasks_per_round=args.pool,
                rounds=args.rounds, **knob_settings(args))


def plot(curves: dict[str, list[dict]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    for name, points in curves.items():
        trained = [p for p in points if p.get("reward_mean") is not None]
        left.plot([p["round"] for p in trained], [p["reward_mean"] for p in trained], marker="o",
                  label=f"trained on {name}")
        validated = [p for p in points if p.get("val_reward_mean") is not None]
        right.plot([p["round"] for p in validated], [p["val_reward_mean"] for p in validated], marker="s",
                   label=f"{name}: validation reward")
    left.set(title="rollout reward on the fixed pool (REWARD)", xlabel="round", ylabel="mean reward")
    right.set(title="validation (other questions, greedy; REWARD for both)", xlabel="round after", ylabel="reward")
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend(loc="best")
    figure.tight_layout()
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--pool", type=int, default=4, help="questions in the fixed pool (every round uses all)")
    p.add_argument("--val", type=int, default=4, help="validation questions (0: none)")
    p.add_argument("-n", type=int, default=4, help="samples per question")
    # concurrency 16: a round's 16 rollouts at once (on 2 cores 1.27x faster rollouts than 4 at a time, RESULTS.md)
    add_knobs(p, **loop_check.SETTINGS)
    p.add_argument("--agent", default="one-call", help=f"{' or '.join(AGENTS)}, or an agent command or module:function")
    p.add_argument("--arms", default="reward,inverted", help="which runs, comma-separated")
    p.add_argument("--min-rise", type=float, default=0.15)
    return p.parse_args(argv)


def run_arms(args, engine) -> tuple[dict[str, list[dict]], dict[str, float]]:
    """Train each arm from the base model on `engine`; its curve, scored on REWARD."""
    curves, seconds = {}, {}
    for arm in args.arms.split(","):
        began = time.perf_counter()
        train(TrainConfig(reward=loop_check.REWARDS[arm], output_dir=str(args.out / arm), **settings(args, args.out)),
              engine=engine, progress=lambda label, done, total: print(f"\r{arm} {label}: {done}/{total}  ", end="",
                                                                       flush=True))
        seconds[arm] = time.perf_counter() - began
        points = round_curve(args.out / arm)
        curves[arm] = mirrored(points) if arm == "inverted" else points  # scored on REWARD like the other run
        print(f"\n{arm}: {len(points)} rounds in {seconds[arm]:.0f} s", flush=True)
    return curves, seconds


def check(args, engine=None) -> dict:
    """Both arms (on `engine`, else one started here), their curves and the checks; written to args.out."""
    args.out.mkdir(parents=True, exist_ok=True)
    owned = engine is None
    if owned:
        python = default_engine_python()
        engine = VLLMEngine(EngineConfig(model_dir=resolve_model("bundled", python), python=python,
                                         max_lora_rank=max(16, args.lora_rank), log_path=args.out / "engine.log"))
        engine.start()
    try:
        curves, seconds = run_arms(args, engine)
    finally:
        if owned:
            engine.stop()
        else:
            engine.use_base()  # a shared engine is left serving the base model, as it was found
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "seconds": seconds, "curves": curves,
              **verdict(curves, args.min_rise)}
    (args.out / "learning_check.json").write_text(json.dumps(result, indent=2))
    plot(curves, args.out / "learning_check.png")
    return result


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    result = check(args)
    for arm, points in result["curves"].items():
        print(f"{arm}: round reward_mean val_reward first_ratio first_clip first_gap served")
        for p in points:
            print("  ", p["round"], *(f"{p[k]:.3f}" if isinstance(p.get(k), float) else p.get(k) for k in (
                "reward_mean", "val_reward_mean", "first_ratio_mean", "first_clip_fraction", "first_logprob_gap",
                "served_policy_versions")))
    print(json.dumps({"rise": result["rise"], "checks": result["checks"]}))
    return result


if __name__ == "__main__":
    sys.exit(0 if all(main()["checks"].values()) else 1)
