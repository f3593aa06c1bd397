"""A one-call SQL agent function for the learning-loop check (benchmarks/learning_check.py): the first turn of
examples/openai_sql (same system prompt, the schema of the task's database, the question), its query on one line.

    --agent benchmarks/one_call_sql.py:answer

One model call per rollout, so a round's rollouts and update cost a third of the three-turn example's; the
loop check measures the trainer, not the agent. Light imports only: it runs in the agent worker process.
"""
from __future__ import annotations

import re
import sqlite3

SYSTEM = ("You write SQLite queries. Answer with one SQL query in a ```sql``` block and nothing else.\n"
          "The database has these tables:\n{schema}")
FENCED = re.compile(r"```(?:sqlite|sql)?\s*(.*?)(?:```|$)", re.DOTALL | re.IGNORECASE)


def messages(db_path, question: str) -> list[dict]:
    """The agent's one call: the system prompt with the database's schema, then the question."""
    with sqlite3.connect(f"file:{db_path}?mode=ro", uri=True) as conn:
        schema = "\n".join(sql for (sql,) in conn.execute(
            "SELECT sql FROM sqlite_master WHERE type = 'table' AND sql IS NOT NULL"))
    return [{"role": "system", "content": SYSTEM.format(schema=schema)}, {"role": "user", "content": question}]


def answer(task: dict, llm) -> str:
    reply = llm.openai().chat.completions.create(model=llm.model, max_tokens=64,
                                                 messages=messages(task["db_path"], task["question"]))
    text = reply.choices[0].message.content or ""
    fenced = FENCED.search(text)
    return " ".join((fenced.group(1) if fenced and fenced.group(1).strip() else text).split())
