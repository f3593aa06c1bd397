"""Does the learner's OpenMP wait policy matter on a machine with few cores? The same LoRA training steps on the
bundled model (forward, backward and AdamW, as the learner takes them) in a process whose OpenMP threads wait
as OpenMP does by default (OMP_WAIT_POLICY unset: they spin a while, then sleep; the peer) and in one whose
threads sleep at once (PASSIVE: what the engine gets on a machine with at most 4 cores), each timed alone
and then beside one busy process (a single-threaded Python loop, as the engine's scheduler, an agent or a test
suite's other worker would be). One process at a time, the two alternating; torch takes every core.

    .venv/bin/python -m benchmarks.learner_contention [--repeats 2] [--steps 4] [--tokens 192]

Prints, per policy and run, the seconds for the steps alone and beside the busy process, then each policy's
seconds summed over its runs and the passive process's speed against the default one's. Writes nothing.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

from benchmarks.engine_contention import alone_and_beside_busy, alternated
from lightning_otel.serve.model import bundled_model_dir

POLICIES = ("default", "PASSIVE")
# One process: the bundled model with a rank-8 LoRA adapter on every linear layer, a batch of 4 sequences,
# one warm-up step, then the timed ones; prints their seconds.
STEPS = r"""
import sys, time, torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
torch.manual_seed(0)
ids = torch.randint(0, model.config.vocab_size, (4, int(sys.argv[3])))
def step():
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
step()
began = time.perf_counter()
for _ in range(int(sys.argv[2])):
    step()
print(time.perf_counter() - began)
"""


def timed_steps(policy: str, steps: int, tokens: int) -> float:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    result = subprocess.run([sys.executable, "-c", STEPS, str(bundled_model_dir()), str(steps), str(tokens)],
                            env=env, capture_output=True, text=True, check=True, timeout=1800)
    return float(result.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=192, help="tokens in each of the batch's 4 sequences")
    args = parser.parse_args(argv)
    return alternated(POLICIES, args.repeats,
                      lambda policy, _: alone_and_beside_busy(lambda: timed_steps(policy, args.steps, args.tokens)))


if __name__ == "__main__":
    main()
