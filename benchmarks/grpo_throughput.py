"""GRPO update throughput: trained tokens/s of one optimizer step, sampling excluded, ours vs TRL's GRPOTrainer.

    .venv/bin/python benchmarks/grpo_throughput.py --trl-python /work/venvs/trl/bin/python \
        --sides ours trl --betas 0.0 0.04 --steps 10 --work /tmp/grpo-bench

Batch: `samples / group` Spider dev tasks (distinct databases) as the SQL agent's first call sees them (its
"write a query" system prompt with the database schema, the question as the user turn, the bundled model's chat
template), prompts of --min-prompt..--max-prompt tokens; `group` completions per task sampled once here from the
bundled SmolLM2-135M (fp32, temperature 1, exactly --completion tokens each), their sampling logprobs, a fixed
random reward each. Every contender gets these identical token ids (one JSON file) and trains on them each step.

Contenders (--sides), each its own process (so its peak RSS is its own; each holds its peak, 3-5 GB, between
steps, so on a shared machine run two at a time):
  ours          optimize() (train/optimize.py) on a Learner (HF model + peft LoRA + DeepSpeed ZeRO-2, torch AdamW),
                aggregation "sequence" (= TRL's loss_type "grpo"), advantages as TRL computes them
                ((r - group mean) / (group std + 1e-4)); the step as optimize() runs it: collate, reference
                log-probs when beta > 0, forward, loss, backward, clipping, AdamW. A group's samples share their
                prompt, so each micro-batch runs it once (train/batch.py, `share_prefix`, on by default)
  ours-noshare  ours with share_prefix = 0: one padded sequence per sample, as TRL does
  ours-bf16     ours with TrainConfig(bf16=True) (bf16 weights, DeepSpeed bf16)
  trl           benchmarks/peers/trl_grpo.py in TRL's own venv: GRPOTrainer fed the same completions through its
                rollout_func; its step timed without `_generate` (see that file)
  trl-compact   trl, patched to score only completion positions in its fused LM head, as TRL does on CUDA
  trl-bf16      trl with bf16 autocast;  trl-defaults: GRPOConfig's own bf16 + activation checkpointing
Same settings everywhere else: LoRA r16 alpha 32 on all linear layers (or --full-finetune), fp32, no activation
checkpointing, micro-batches of --micro-batch, lr 1e-5 constant, AdamW (0.9, 0.999, no decay), clip 0.2, grad
norm 1.0, temperature 1, loss "grpo", beta from --betas (k3 KL to the adapters-disabled model).

Contention: the machine is shared. All contenders stay up and take turns, one optimizer step each, in an order
that reverses every round, so the steps compared are seconds apart. For every step the driver also records how
many cores other jobs used meanwhile (/proc/stat, less the contender's own CPU time): `clean` steps are those
where that stayed under --clean. Reported per side: tokens/s over all timed steps, the median of clean steps, the
best step; ratios to --baseline of each, and the median of per-round ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PEER = REPO / "benchmarks" / "peers" / "trl_grpo.py"
MARK = "@@grpo-bench "  # prefix of the protocol lines children print (libraries print to stdout too)
TASKS = REPO / "lightning_otel" / "tasks" / "spider" / "data" / "dev.jsonl"
DATABASES = REPO / "lightning_otel" / "tasks" / "spider" / "data" / "database"
# The first call of examples/sql_agent/agent.py.
WRITE = ("You write SQLite queries. Answer with one SQL query in a ```sql``` block and nothing else.\n"
         "The database has these tables:\n{schema}")


def read_schema(db_id: str) -> str:
    import sqlite3

    path = DATABASES / db_id / f"{db_id}.sqlite"
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        rows = conn.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND sql IS NOT NULL").fetchall()
    return "\n".join(sql for (sql,) in rows)


def pick_prompts(tokenizer, n: int, lo: int, hi: int) -> list[dict]:
    picked, dbs = [], set()
    for line in TASKS.read_text().splitlines():
        task = json.loads(line)
        if task["db_id"] in dbs or not (DATABASES / task["db_id"]).is_dir():
            continue
        messages = [{"role": "system", "content": WRITE.format(schema=read_schema(task["db_id"]))},
                    {"role": "user", "content": task["question"]}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if lo <= len(ids) <= hi:
            picked.append({"task": task["id"], "text": text, "prompt_ids": ids})
            dbs.add(task["db_id"])
        if len(picked) == n:
            return picked
    raise SystemExit(f"only {len(picked)} Spider dev prompts of {lo}-{hi} tokens on distinct databases")


def build_batch(model_dir: Path, tasks: int, group: int, completion: int, lo: int, hi: int, seed: int) -> dict:
    """Prompts, sampled completions with their sampling logprobs (T = 1), fixed rewards."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = pick_prompts(tokenizer, tasks, lo, hi)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    for prompt in prompts:
        ids = torch.tensor([prompt["prompt_ids"]] * group)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, min_new_tokens=completion, max_new_tokens=completion,
                                 pad_token_id=tokenizer.eos_token_id)
            logits = model(out).logits[:, ids.shape[1] - 1:-1].float()
            new = out[:, ids.shape[1]:]
            logprobs = torch.log_softmax(logits, -1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        prompt["completions"] = [{"completion_ids": new[k].tolist(), "logprobs": logprobs[k].tolist(),
                                  "reward": round(rng.random(), 4)} for k in range(group)]
    return {"model_dir": str(model_dir), "group": group, "prompts": prompts}


def advantages(prompt: dict) -> list[float]:
    """TRL's group normalisation: (r - mean) / (unbiased std + 1e-4)."""
    rewards = [c["reward"] for c in prompt["completions"]]
    mean, std = statistics.fmean(rewards), statistics.stdev(rewards)
    return [(r - mean) / (std + 1e-4) for r in rewards]


def report(message: dict) -> None:
    """One protocol line to the driver (other libraries print to stdout too)."""
    print(MARK + json.dumps(message), flush=True)


def wait_for_turn() -> None:
    if sys.stdin.readline().strip() != "step":
        raise SystemExit("driver went away")


def run_ours(args: argparse.Namespace) -> None:
    """Child: set up our Learner, report ready, then run one optimizer step each time the driver says so."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import psutil
    import torch

    from lightning_otel.train.config import TrainConfig
    from lightning_otel.train.learner import Learner
    from lightning_otel.train.optimize import optimize

    data = json.loads(Path(args.data).read_text())
    rows = []
    for i, prompt in enumerate(data["prompts"]):
        for k, (completion, adv) in enumerate(zip(prompt["completions"], advantages(prompt))):
            rows.append({"prompt_ids": prompt["prompt_ids"], "completion_ids": completion["completion_ids"],
                         "completion_logprobs": completion["logprobs"], "advantage": adv,
                         "rollout_id": f"{i}-{k}"})
    config = TrainConfig(batch_size=len(rows), micro_batch=args.micro_batch, lr=1e-5, clip=0.2, kl=args.beta,
                         aggregation="sequence", grad_clip=1.0, lora_rank=16, lora_alpha=32,
                         full_finetune=args.full_finetune, zero_stage=args.zero_stage, bf16=args.bf16, seed=args.seed,
                         share_prefix=0 if args.variant == "noshare" else TrainConfig.share_prefix)
    learner = Learner(Path(data["model_dir"]), config)
    process = psutil.Process()
    report({"ready": True, "ready_rss_mb": process.memory_info().rss / 2**20, "trainable": learner.trainable,
            "threads": torch.get_num_threads(), "share_prefix": config.share_prefix})
    for i in range(args.steps):
        wait_for_turn()
        wall, cpu = time.perf_counter(), time.process_time()
        stats = optimize(learner, rows, config, "grpo", seed=args.seed + i)
        tokens, loss = stats.trained_tokens, stats.loss[0]
        report({"seconds": time.perf_counter() - wall, "cpu_seconds": time.process_time() - cpu, "tokens": tokens,
                "loss": loss, "rss_mb": process.memory_info().rss / 2**20})
    learner.close()
    report({"done": True, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})


def cpu_busy_seconds() -> float:
    """Non-idle CPU time of the whole machine since boot (/proc/stat, all cores)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def wait_for_memory(gigabytes: float) -> None:
    """The machine is shared: a step (up to ~5 GB here) waits until that much memory is available."""
    import psutil

    while psutil.virtual_memory().available < gigabytes * 2**30:
        time.sleep(10)


class Side:
    """A contender's process, driven one optimizer step at a time over stdin/stdout."""

    def __init__(self, name: str, command: list[str], log: Path):
        self.name, self.steps = name, []
        self.log = log.open("w")
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        self.ready = self.receive()

    def receive(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        raise RuntimeError(f"{self.name} exited (code {self.proc.wait()}); see {self.log.name}")

    def step(self, min_free_gb: float) -> dict:
        wait_for_memory(min_free_gb)
        busy = cpu_busy_seconds()
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        out = self.receive()
        # CPU time the whole machine spent during the step, less the contender's own: other jobs' work.
        out["foreign_cores"] = max(0.0, cpu_busy_seconds() - busy - out["cpu_seconds"]) / out["seconds"]
        self.steps.append(out)
        return out

    def finish(self) -> dict:
        out = self.receive()
        self.proc.wait()
        self.log.close()
        return out


def side_command(side: str, args: argparse.Namespace, data: Path, beta: float) -> list[str]:
    common = ["--data", str(data), "--beta", str(beta), "--steps", str(args.warmup + args.steps),
              "--micro-batch", str(args.micro_batch), "--seed", str(args.seed)]
    if args.full_finetune:
        common.append("--full-finetune")
    name, *options = side.split("-")
    if name == "trl":
        flags = {"compact": "--compact-lm-head", "bf16": "--bf16", "defaults": "--trl-defaults"}
        return [args.trl_python, str(PEER), *[flags[o] for o in options], *common]
    if name != "ours" or not set(options) <= {"noshare", "bf16"}:
        raise SystemExit(f"unknown side {side!r}")
    variant = "noshare" if "noshare" in options else "optimize"
    return [sys.executable, __file__, "--child", "ours", "--variant", variant, "--zero-stage", str(args.zero_stage),
            *(["--bf16"] if "bf16" in options else []), *common]


def compare(sides: list[Side], warmup: int, baseline: str, clean: float) -> dict:
    """Per side, over the timed steps: tokens/s over all of them, the median of the clean ones (other jobs used
    under `clean` cores meanwhile) and the best one; ratios of each to the baseline side's same figure, and the
    median of per-turn ratios (same round, seconds apart)."""
    def rate(step: dict) -> float:
        return step["tokens"] / step["seconds"]

    def figures(side: Side) -> dict:
        timed = side.steps[warmup:]
        quiet = [rate(s) for s in timed if s["foreign_cores"] < clean]
        return {"all": sum(s["tokens"] for s in timed) / sum(s["seconds"] for s in timed),
                # per CPU second of the contender itself: the work, whatever other jobs did meanwhile
                "per_cpu_second": sum(s["tokens"] for s in timed) / sum(s["cpu_seconds"] for s in timed),
                "clean_median": statistics.median(quiet) if quiet else None, "clean_steps": len(quiet),
                "best": max(rate(s) for s in timed)}

    base = next((s for s in sides if s.name == baseline), None)
    out = {}
    for side in sides:
        mine = figures(side)
        entry = {"tokens_per_s": mine, "step_seconds": [round(s["seconds"], 2) for s in side.steps[warmup:]],
                 "foreign_cores": [round(s["foreign_cores"], 2) for s in side.steps[warmup:]],
                 "ready_rss_mb": round(side.ready["ready_rss_mb"]), "peak_rss_mb": round(side.done["peak_rss_mb"])}
        if base is not None and side is not base:
            theirs = figures(base)
            pairs = [rate(a) / rate(b) for a, b in zip(side.steps[warmup:], base.steps[warmup:])]
            entry[f"to_{baseline}"] = {
                "all": mine["all"] / theirs["all"], "best": mine["best"] / theirs["best"],
                "per_cpu_second": mine["per_cpu_second"] / theirs["per_cpu_second"],
                "clean_median": mine["clean_median"] / theirs["clean_median"]
                if mine["clean_median"] and theirs["clean_median"] else None,
                "turn_ratio_median": statistics.median(pairs), "turn_ratios": [round(x, 3) for x in pairs],
                "peak_rss": side.done["peak_rss_mb"] / base.done["peak_rss_mb"]}
        out[side.name] = entry
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trl-python", help="python of the venv with trl (for the trl* sides)")
    parser.add_argument("--sides", nargs="+", default=["ours", "trl"],
                        help="contenders: ours, ours-noshare, ours-bf16, trl, trl-compact, trl-bf16, "
                             "trl-defaults (default: ours trl)")
    parser.add_argument("--baseline", default="trl", help="the side ratios are taken against (default: trl)")
    parser.add_argument("--min-free-gb", type=float, default=6.0,
                        help="wait before a step until this much memory is available (default 6)")
    parser.add_argument("--threads", type=int, help="torch threads in every contender (default: torch's own)")
    parser.add_argument("--clean", type=float, default=0.25,
                        help="a step is clean when other jobs used fewer cores than this meanwhile (default 0.25)")
    parser.add_argument("--samples", type=int, default=8, help="completions per optimizer step (default 8)")
    parser.add_argument("--group", type=int, default=4, help="completions per prompt (GRPO group size)")
    parser.add_argument("--completion", type=int, default=64, help="tokens per completion")
    parser.add_argument("--min-prompt", type=int, default=190, help="prompt tokens, at least")
    parser.add_argument("--max-prompt", type=int, default=215, help="prompt tokens, at most")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--betas", type=float, nargs="+", default=[0.0, 0.04])
    parser.add_argument("--steps", type=int, default=6, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per side, first")
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--full-finetune", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, help="folder for the batch JSON (reused when present)")
    parser.add_argument("--child", choices=["ours"], help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=["optimize", "noshare"], default="optimize",
                        help=argparse.SUPPRESS)
    parser.add_argument("--bf16", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--beta", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_ours(args)
        return
    if args.samples % args.group or args.samples % args.micro_batch:
        raise SystemExit("--samples must be a multiple of --group and of --micro-batch")

    from lightning_otel.serve.model import bundled_model_dir

    work = args.work or Path(tempfile.mkdtemp(prefix="grpo-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    data = work / f"batch-{args.samples}x{args.group}-{args.completion}-p{args.min_prompt}-{args.max_prompt}.json"
    if not data.exists():
        started = time.perf_counter()
        batch = build_batch(bundled_model_dir(), args.samples // args.group, args.group, args.completion,
                            args.min_prompt, args.max_prompt, args.seed)
        data.write_text(json.dumps(batch))
        print(json.dumps({"built": str(data), "seconds": round(time.perf_counter() - started, 1)}), flush=True)
    batch = json.loads(data.read_text())
    print(json.dumps({"batch": {"tasks": [p["task"] for p in batch["prompts"]],
                                "prompt_tokens": [len(p["prompt_ids"]) for p in batch["prompts"]],
                                "group": batch["group"], "completion_tokens": args.completion}}), flush=True)
    if any(n.startswith("trl") for n in args.sides) and not args.trl_python:
        raise SystemExit("the trl sides need --trl-python")
    if args.threads:
        os.environ.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    names = args.sides
    results = {}
    for beta in args.betas:
        sides = []
        for name in names:  # set-ups one after the other, so that they do not slow each other down
            sides.append(Side(name, side_command(name, args, data, beta), work / f"{name}-beta{beta}.log"))
            print(json.dumps({"beta": beta, "side": name, **sides[-1].ready}), flush=True)
        for i in range(args.warmup + args.steps):
            for side in (sides if i % 2 == 0 else sides[::-1]):
                print(json.dumps({"beta": beta, "side": side.name, "step": i, **side.step(args.min_free_gb)}),
                      flush=True)
        for side in sides:
            side.done = side.finish()
        results[str(beta)] = compare(sides, args.warmup, args.baseline, args.clean)
        print(json.dumps({"beta": beta, "result": results[str(beta)]}), flush=True)
    print(json.dumps({"summary": results}, indent=1), flush=True)


if __name__ == "__main__":
    main()
