"""The Spider side of the learning-loop check (lightning_otel.eval.loop_check): its questions, its reward and
that reward's mirror, the training settings that move it, and a one-call agent function.

The check trains GRPO from the base model on a fixed pool of questions, once on REWARD and once, as the
control, on 1 - REWARD; the curve trained on REWARD must rise and the control's fall. REWARD (`reward` below)
is 0.5 for a final answer that executes as SQL on the task's database, plus 0.5 / (1 + words / 10) for brevity:
continuous (almost every GRPO group has reward variance) and reachable by the bundled 135M model. It checks the
loop, not the task: a held-out gain is the learning benchmarks' job.

The agent, `answer`, is the first turn of the plain-OpenAI example (examples/openai_sql: same system prompt, the
schema of the task's database, the question) with its query on one line: one model call per rollout, so a
round costs a third of the three-turn example's. It runs in the agent worker process (light imports only):
give it as AGENT.
"""
from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path

from lightning_otel.tasks.spider.rewards import bundled_data_dir, database_path, extract_sql, sql_outcome

# Bundled dev databases with short schemas (the prompt carries the schema; the update step's cost grows with it).
# The pool and the validation questions are both drawn from them, round-robin: validation takes the next ones.
DATABASES = ("singer", "poker_player", "network_1")
AGENT = "lightning_otel.tasks.spider.loop_check:answer"
# Each arm's reward by the arm's name in lightning_otel.eval.loop_check (trained on REWARD, the control on 1 - it).
REWARDS = {"reward": "lightning_otel.tasks.spider.loop_check:reward",
           "inverted": "lightning_otel.tasks.spider.loop_check:inverted"}
# TrainConfig fields that moved REWARD within a few rounds of the bundled model on 2 CPU cores (a LoRA adapter,
# 2 passes over each round's transitions, sampling at temperature 0.7; at temperature 1 with lr 2e-4 and one
# pass, three rounds did not: benchmarks/RESULTS.md). concurrency 16: a round's 16 rollouts at once.
SETTINGS = {"lr": 1e-3, "epochs": 2, "batch_size": 4, "max_tokens": 32, "temperature": 0.7, "concurrency": 16}

SYSTEM = ("You write SQLite queries. Answer with one SQL query in a ```sql``` block and nothing else.\n"
          "The database has these tables:\n{schema}")
FENCED = re.compile(r"```(?:sqlite|sql)?\s*(.*?)(?:```|$)", re.DOTALL | re.IGNORECASE)


def reward(task: dict, rollout: dict) -> float | None:
    """0.5 when the final output executes as SQL on the task's database, + 0.5 / (1 + words / 10)."""
    output = rollout.get("final_output") or ""
    db = database_path(rollout.get("data_dir") or bundled_data_dir(), task["db_id"])
    outcome, _ = sql_outcome(db, extract_sql(output))
    return 0.5 * (outcome == "executes") + 0.5 / (1.0 + len(output.split()) / 10.0)


def inverted(task: dict, rollout: dict) -> float | None:
    """The control's reward: 1 - `reward`."""
    value = reward(task, rollout)
    return None if value is None else 1.0 - value


def pick(dbs: tuple[str, ...], count: int) -> list[dict]:
    """`count` bundled dev questions, round-robin over `dbs`, in file order."""
    rows = [json.loads(line) for line in (bundled_data_dir() / "dev.jsonl").read_text().splitlines()]
    by_db = {db: [r for r in rows if r["db_id"] == db] for db in dbs}
    chosen = [by_db[db][i] for i in range(count) for db in dbs if i < len(by_db[db])]
    return chosen[:count]


def messages(db_path: str | Path, question: str) -> list[dict]:
    """The agent's one call: the system prompt with the database's schema, then the question."""
    with sqlite3.connect(f"file:{db_path}?mode=ro", uri=True) as conn:
        schema = "\n".join(sql for (sql,) in conn.execute(
            "SELECT sql FROM sqlite_master WHERE type = 'table' AND sql IS NOT NULL"))
    return [{"role": "system", "content": SYSTEM.format(schema=schema)}, {"role": "user", "content": question}]


def answer(task: dict, llm) -> str:
    """Agent function: one call, the query of its first ```sql``` block (else its text) on one line."""
    reply = llm.openai().chat.completions.create(model=llm.model, max_tokens=64,
                                                 messages=messages(task["db_path"], task["question"]))
    text = reply.choices[0].message.content or ""
    fenced = FENCED.search(text)
    return " ".join((fenced.group(1) if fenced and fenced.group(1).strip() else text).split())
