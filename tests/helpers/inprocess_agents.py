"""Agent functions for tests/test_inprocess.py, called as fn(task, llm) in the runner's worker process.

`by_task` behaves by the task's id, so one function covers every outcome the runner must record.
"""
from __future__ import annotations

import os
import sys
import time

from opentelemetry import trace

NOT_CALLABLE = 42


def by_task(task: dict, llm) -> str | None:
    kind = task["id"].split("-")[0]
    print(f"working on {task['id']}")
    if kind == "raise":
        print("about to fail", file=sys.stderr)
        raise RuntimeError(f"boom in {task['id']}")
    if kind == "hang":
        time.sleep(600)
    if kind == "die":
        os._exit(7)
    if kind == "none":
        return None
    print(f"pid {os.getpid()}")
    return "thinking...\nSELECT count(*) FROM singer"  # the final output is the last non-empty line


def chatty(task: dict, llm) -> str:
    """Two model calls through llm.openai() around a span of its own that records what the call was given,
    with pauses so that rollouts overlap."""
    client = llm.openai()
    tracer = trace.get_tracer("inprocess-test")
    answers = []
    for turn in range(2):
        with tracer.start_as_current_span("check_turn") as span:
            span.set_attribute("test.given_rollout_id", llm.rollout_id)
            span.set_attribute("test.pid", os.getpid())
            time.sleep(0.3)
        reply = client.chat.completions.create(
            model=llm.model, max_tokens=4, temperature=1.0,
            messages=[{"role": "user", "content": f"{task['question']} (turn {turn})"}])
        answers.append(reply.choices[0].message.content or "")
    return f"{llm.rollout_id} {len(answers)}"


def sleeper(task: dict, llm) -> str:
    """Writes its worker's pid where the test says, then waits to be killed with its runner."""
    with open(task["pid_file"], "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)
    return "never"



def one_call(task: dict, llm) -> str:
    """One short model call: the cheapest rollout that still goes through the gateway and is trainable."""
    reply = llm.openai().chat.completions.create(model=llm.model, max_tokens=8, temperature=1.0,
                                                 messages=[{"role": "user", "content": task["question"]}])
    return reply.choices[0].message.content or ""
