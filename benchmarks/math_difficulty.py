"""Where does the calculator agent start? The base policy's greedy accuracy on held-out problems, by difficulty.

    .venv/bin/python -m benchmarks.math_difficulty --out /tmp/math-difficulty [--count 48] [--model PATH]

The tool-use benchmark (benchmarks/learning/math_agent.py) asks for a difficulty at which the starting policy
solves 10-40% of the problems. This measures the base policy (the bundled SmolLM2-135M by default) on the test
split at two difficulties, one-operation and two-operation problems (examples/openai_agents_math/problems.py),
each with the agent as it is (one worked example in its instructions) and with three worked examples (one per
kind of operation mix). Everything else is the benchmark's: the agent function in one worker, greedy, 48 tokens
a call, scored by `number_match`. One engine serves every cell.

Written to <out>: math_difficulty.json (accuracy per cell, and per cell the first answers: the tool calls'
arguments and the reply, read from the tool spans).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from tests.helpers.examples import example_module  # one loader of example modules by path, for tests and benchmarks
from benchmarks.learning.math_agent import write
from lightning_otel.rollouts.runner import RolloutConfig, run_rollouts
from lightning_otel.span_store import client

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "openai_agents_math"
problems = example_module("openai_agents_math", "problems")  # the example's generator
reward = example_module("openai_agents_math", "reward")

CALL = '<tool_call>\n{{"name": "calculate", "arguments": {{"expression": "{0}"}}}}\n</tool_call>'
EXAMPLES = [("Sam has 12 bags of 4 apples and 7 more apples. How many apples does Sam have?", "12 * 4 + 7", 55),
            ("A jar has 30 sweets. Tom eats 8 and then adds 5. How many sweets are in the jar?", "30 - 8 + 5", 27),
            ("Mia walks 3 km, then 9 km, then 6 km. How far does she walk?", "3 + 9 + 6", 18)]
# The agent with other instructions: a module the worker imports, which loads the example's agent.py as a module
# of its own (`agent` here, as an import would: registered before it runs) and changes nothing in it but
# INSTRUCTIONS.
WRAPPER = """import importlib.util
import sys
spec = importlib.util.spec_from_file_location("agent_with_other_instructions", {agent!r})
agent = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(agent)
agent.INSTRUCTIONS = {instructions!r}
run = agent.run
"""


def three_examples() -> str:
    shown = "".join(f'Example: for "{q}" you call\n{CALL.format(e)}\nand when the tool answers {a}, you reply: {a}\n'
                    for q, e, a in EXAMPLES)
    return "You solve math word problems with the calculate tool. " + shown


def agent_spec(out: Path, instructions: str | None) -> str:
    if instructions is None:
        return f"{EXAMPLE / 'agent.py'}:run"
    wrapper = out / "agent_three_examples.py"
    wrapper.write_text(WRAPPER.format(agent=str(EXAMPLE / "agent.py"), instructions=instructions))
    return f"{wrapper}:run"


def measure(out: Path, steps: int, instructions: str | None, count: int, seed: int, engine) -> dict:
    name = f"{steps}-step-{'three' if instructions else 'one'}-example"
    cell = out / name
    cell.mkdir(parents=True, exist_ok=True)
    rows = problems.make("test", count, seed, steps=steps)
    tasks = write(rows, cell / "tasks.jsonl")
    db = cell / "traces.duckdb"
    db.unlink(missing_ok=True)
    run_rollouts(RolloutConfig(tasks=tasks, agent=agent_spec(out, instructions), n=1, concurrency=16, db=db,
                               reward="number_match", temperature=0.0, max_tokens=48), engine=engine)
    scored = client.query("""SELECT r.rollout_id, r.task_id, r.final_output, w.value FROM rollouts r
                             JOIN rewards w ON w.rollout_id = r.rollout_id AND w.span_id IS NULL
                             ORDER BY r.task_id""", db).to_dicts()
    spans = client.query("SELECT * FROM spans ORDER BY start_ns", db).to_dicts()
    by_rollout: dict[str, list[dict]] = {}
    for span in spans:
        by_rollout.setdefault(span["rollout_id"], []).append(span)
    expressions = {r["id"]: r["expression"] for r in rows}
    answers = [{"task_id": s["task_id"], "expression": expressions[s["task_id"]],
                "tool_calls": [a for a, _ in reward.tool_calls({"spans": by_rollout.get(s["rollout_id"], [])})],
                "reply": (s["final_output"] or "")[:120], "right": s["value"] >= 1.0} for s in scored]
    right = sum(a["right"] for a in answers)
    return {"cell": name, "steps": steps, "examples": 3 if instructions else 1, "problems": len(answers),
            "right": right, "accuracy": right / len(answers) if answers else None,
            "with_a_tool_call": sum(bool(a["tool_calls"]) for a in answers), "answers": answers}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--count", type=int, default=48, help="test problems per cell")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="a local Hugging Face model folder (default: the bundled one)")
    args = p.parse_args(argv)
    from lightning_otel.serve.engine import EngineConfig, VLLMEngine, default_engine_python
    from lightning_otel.serve.model import resolve_model

    args.out.mkdir(parents=True, exist_ok=True)
    python = default_engine_python()
    engine = VLLMEngine(EngineConfig(model_dir=resolve_model(args.model, python), python=python))
    engine.start()
    try:
        cells = [measure(args.out, steps, instructions, args.count, args.seed, engine)
                 for steps in (1, 2) for instructions in (None, three_examples())]
    finally:
        engine.stop()
    (args.out / "math_difficulty.json").write_text(json.dumps(cells, indent=1))
    for c in cells:
        print(f"{c['cell']}: {c['right']}/{c['problems']} right, {c['with_a_tool_call']} with a tool call")
    return cells


if __name__ == "__main__":
    main()
