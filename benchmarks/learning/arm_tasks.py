"""The two tasks apo_vs_grpo compares prompt optimisation and GRPO on: where their tasks come from, the agent,
the reward each learner is given and the one held-out accuracy is scored with.

    math    the OpenAI Agents SDK calculator agent (examples/openai_agents_math, on the SDK's Chat Completions
            provider as in its recorded GRPO run: math_chat_agent.py), the train and test splits of
            problems.py (disjoint templates and numbers), trained on reward.py:shaped, scored by number_match;
            the same settings as benchmarks.learning.math_agent (whose recorded GRPO run is the reference).
    spider  the plain-OpenAI SQL agent (examples/openai_sql), GRPO questions of the training dev databases and
            held-out questions of lightning_otel.tasks.spider.splits.HELD_OUT, trained and scored by spider_exec.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.helpers.examples import example_module
from benchmarks.learning.math_agent import write
from lightning_otel.tasks.spider.splits import read_rows, split, write_rows

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class BenchTask:
    name: str
    agent: str            # the agent function, unchanged
    train_reward: str     # what GRPO and the prompt search are rewarded by
    eval_reward: str      # held-out accuracy: an episode reward of 1 is right
    max_tokens: int       # per call, every arm and every evaluation
    tool_syntax: str      # the syntax demonstrations of tool calls are written in ("" none: text answers only)
    group: str = ""       # the field whose values send different system texts (Spider: the database)

    def write_tasks(self, out: Path, pool: int, test: int, seed: int) -> tuple[Path, Path]:
        """(train pool, held-out) task files in `out`, `train.jsonl` and `test.jsonl` for every task (the report
        reads the second), the same for the same arguments."""
        out.mkdir(parents=True, exist_ok=True)
        if self.name == "math":
            problems = example_module("openai_agents_math", "problems")
            return (write(problems.make("train", pool, seed), out / "train.jsonl"),
                    write(problems.make("test", test, seed), out / "test.jsonl"))
        files = split(out / "split", eval_count=test, grpo_count=pool, sft_count=0)
        return (write_rows(read_rows(files["grpo"]), out / "train.jsonl"),
                write_rows(read_rows(files["eval"]), out / "test.jsonl"))


MATH_EXAMPLE = REPO / "examples" / "openai_agents_math"
TASKS = {
    # the example's agent on the Chat Completions provider, as in the recorded GRPO run (math_chat_agent.py)
    "math": BenchTask("math", f"{Path(__file__).parent / 'math_chat_agent.py'}:run",
                      f"{MATH_EXAMPLE / 'reward.py'}:shaped",
                      "number_match", 48, "hermes"),
    "spider": BenchTask("spider", f"{REPO / 'examples' / 'openai_sql' / 'agent.py'}:run", "spider_exec",
                        "spider_exec", 128, "hermes", group="db_id"),
}


def interleave(rows: list[dict], field: str) -> list[dict]:
    """The rows taken one per value of `field` in turn (values in order of first appearance, rows in their order
    within each), so any leading slice spans the values; unchanged when `field` is empty."""
    if not field:
        return list(rows)
    groups: dict[object, list[dict]] = {}
    for row in rows:
        groups.setdefault(row.get(field), []).append(row)
    queues = list(groups.values())
    return [queue[i] for i in range(max(map(len, queues), default=0)) for queue in queues if i < len(queue)]


def task_ids(path: Path) -> list[str]:
    return [str(row["id"]) for row in read_rows(path)]


__all__ = ["BenchTask", "TASKS", "interleave", "task_ids"]
