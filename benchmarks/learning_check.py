"""Learning-loop check: does GRPO move the reward it is given, on a fixed pool of tasks, and only that way?

    .venv/bin/python benchmarks/learning_check.py --out /tmp/loop [--rounds 10] [--pool 4] [-n 4] [--autocast]
        [--advantage reinforce-pp --kl 0.05]   # REINFORCE++ instead of GRPO's per-rollout advantage

Two runs from the same base model, side by side on one engine, with a one-call SQL agent (one_call_sql.py: the
first turn of the plain-OpenAI example; `--agent openai_sql` runs the three-turn example itself), an agent
function run in one worker process:
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
model. It checks the loop, not the task: a held-out gain is the learning benchmarks' job.

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

from grpo_knobs import add_knobs, knob_settings
from lightning_otel.serve.engine import EngineConfig, VLLMEngine, default_engine_python
from lightning_otel.serve.model import resolve_model
from lightning_otel.tasks.spider.rewards import bundled_data_dir, database_path, extract_sql, sql_outcome
from lightning_otel.train.config import TrainConfig
from lightning_otel.train.trainer import train

REPO = Path(__file__).resolve().parent.parent
# Bundled dev databases with short schemas (the prompt carries the schema; the update step's cost grows with it).
# The pool and the validation questions are both drawn from them, round-robin: validation takes the next ones.
DATABASES = ("singer", "poker_player", "network_1")


def reward(task: dict, rollout: dict) -> float | None:
    """0.5 when the final output executes as SQL on the task's database, + 0.5 / (1 + words / 10)."""
    output = rollout.get("final_output") or ""
    db = database_path(rollout.get("data_dir") or bundled_data_dir(), task["db_id"])
    outcome, _ = sql_outcome(db, extract_sql(output))
    return 0.5 * (outcome == "executes") + 0.5 / (1.0 + len(output.split()) / 10.0)


def inverted(task: dict, rollout: dict) -> float | None:
    value = reward(task, rollout)
    return None if value is None else 1.0 - value


def pick(dbs: tuple[str, ...], count: int) -> list[dict]:
    """`count` bundled dev questions, round-robin over `dbs`, in file order."""
    rows = [json.loads(line) for line in (bundled_data_dir() / "dev.jsonl").read_text().splitlines()]
    by_db = {db: [r for r in rows if r["db_id"] == db] for db in dbs}
    chosen = [by_db[db][i] for i in range(count) for db in dbs if i < len(by_db[db])]
    return chosen[:count]


def write(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


AGENTS = {  # --agent names: agent functions, run in one worker process (or give any command or module:function)
    "one-call": f"{Path(__file__).parent / 'one_call_sql.py'}:answer",
    "openai_sql": f"{REPO / 'examples' / 'openai_sql' / 'agent.py'}:run",  # three calls when its SQL fails
}


def settings(args, out: Path) -> dict:
    chosen = pick(DATABASES, args.pool + args.val)
    return dict(tasks=str(write(chosen[:args.pool], out / "pool.jsonl")),
                val_tasks=str(write(chosen[args.pool:], out / "val.jsonl")) if args.val else "",
                agent=AGENTS.get(args.agent, args.agent), task_pack="spider", n=args.n, tasks_per_round=args.pool,
                rounds=args.rounds, **knob_settings(args))


def curve(run: Path) -> list[dict]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    keys = ("reward_mean", "reward_std", "zero_variance_groups", "first_ratio_mean", "first_clip_fraction",
            "first_logprob_gap", "clip_fraction", "served_policy_versions", "policy_version", "steps",
            "rollout_seconds", "train_seconds", "reward_kl")
    rounds = {r["round"]: {k: r.get(k) for k in keys} for r in records if r.get("phase") == "grpo"}
    for r in records:
        if r.get("val_reward_mean") is not None:
            rounds.setdefault(r["round"], {}).update(val_reward_mean=r["val_reward_mean"],
                                                     val_accuracy=r.get("val_accuracy"))
    return [{"round": k, **v} for k, v in sorted(rounds.items())]


def rise(points: list[dict], key: str = "reward_mean", start: float | None = None) -> float | None:
    """The last two rounds' mean minus the start (default: the first round's): two rounds, since one round's
    mean is noisy."""
    values = [p[key] for p in points if p.get(key) is not None]
    if len(values) < 3:
        return None
    return sum(values[-2:]) / 2 - (values[0] if start is None else start)


def start_level(curves: dict[str, list[dict]]) -> float | None:
    """The starting policy's reward on the pool: the mean of every arm's first round. Each arm's round 1 samples
    the same base policy on the same tasks, scored on REWARD, so together they measure it on twice the samples
    (one round of 16 rewards moved by 0.05-0.1 by chance between runs here, RESULTS.md)."""
    firsts = [points[0]["reward_mean"] for points in curves.values()
              if points and points[0]["round"] == 1 and points[0].get("reward_mean") is not None]
    return sum(firsts) / len(firsts) if firsts else None


def served_each_round(points: list[dict], start_version: int = 0) -> bool:
    """Round r's rollouts were all generated by the checkpoint of round r - 1 (version start + r - 1)."""
    rounds = [p for p in points if p.get("served_policy_versions") is not None]
    return bool(rounds) and all(p["served_policy_versions"] == [start_version + p["round"] - 1] for p in rounds)


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
    add_knobs(p, lr=1e-3, epochs=2, batch_size=4, max_tokens=32, temperature=0.7, concurrency=16)
    p.add_argument("--agent", default="one-call", help=f"{' or '.join(AGENTS)}, or an agent command or module:function")
    p.add_argument("--arms", default="reward,inverted", help="which runs, comma-separated")
    p.add_argument("--min-rise", type=float, default=0.15)
    return p.parse_args(argv)


def run_arms(args, engine) -> tuple[dict[str, list[dict]], dict[str, float]]:
    """Train each arm from the base model on `engine`; its curve, scored on REWARD."""
    curves, seconds = {}, {}
    for arm in args.arms.split(","):
        began = time.perf_counter()
        train(TrainConfig(reward=f"learning_check:{arm}", output_dir=str(args.out / arm), **settings(args, args.out)),
              engine=engine, progress=lambda label, done, total: print(f"\r{arm} {label}: {done}/{total}  ", end="",
                                                                       flush=True))
        seconds[arm] = time.perf_counter() - began
        points = curve(args.out / arm)
        if arm == "inverted":  # scored on REWARD like the other run: 1 - what it was trained on
            for p in points:
                p.update({k: 1.0 - p[k] for k in ("reward_mean", "val_reward_mean") if p.get(k) is not None})
        curves[arm] = points
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
    start = start_level(curves)
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "seconds": seconds, "curves": curves,
              "start": start, "rise": {arm: rise(points, start=start) for arm, points in curves.items()},
              "served_each_round": {arm: served_each_round(points) for arm, points in curves.items()}}
    up, down = result["rise"].get("reward"), result["rise"].get("inverted")
    checks = {"reward run rises": up is not None and up > 0 and up >= args.min_rise,
              "control falls": down is not None and down < 0,
              "new policy served every round": all(result["served_each_round"].values())}
    arm_of = {"reward run rises": "reward", "control falls": "inverted"}
    result["checks"] = {name: ok for name, ok in checks.items() if arm_of.get(name, next(iter(curves))) in curves}
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
