"""Text-to-SQL agent on the plain OpenAI SDK: write a query, run it, and on an error ask for a fix.

    python agent.py --question "How many singers do we have?" --db singer.sqlite [--model gpt-4o-mini]

Talks to any OpenAI-compatible endpoint (OPENAI_BASE_URL, OPENAI_API_KEY). Streams every answer. At most
three model calls; the last line of stdout is the final SQL (empty when the model never wrote any).
`run(task, llm)` is the same loop as a function, for the runner's in-process mode
(`--agent examples/openai_sql/agent.py:run`); it takes `llm` by duck typing and does not import lightning-otel.
"""
from __future__ import annotations

import argparse
import re
import sqlite3
import time

import openai

MAX_TURNS = 3
MAX_TOKENS = 96
SYSTEM = ("You write SQLite queries. Answer with one SQL query in a ```sql``` block and nothing else.\n"
          "The database has these tables:\n{schema}")


def read_schema(db: str) -> str:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        rows = conn.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND sql IS NOT NULL").fetchall()
    return "\n".join(sql for (sql,) in rows)


def extract_sql(text: str) -> str:
    """The query in the answer, on one line: a ```sql``` block, else from the first SELECT/WITH, else all."""
    fenced = re.search(r"```(?:sqlite|sql)?\s*(.*?)(?:```|$)", text, re.DOTALL | re.IGNORECASE)
    if fenced and fenced.group(1).strip():
        text = fenced.group(1)
    else:
        start = re.search(r"\b(SELECT|WITH)\b", text, re.IGNORECASE)
        text = text[start.start():] if start else text
    return " ".join(text.split())


def run_sql(db: str, sql: str, timeout_s: float = 10.0) -> tuple[list | None, str | None]:
    """(rows, None) or (None, error message). Queries running past timeout_s are interrupted."""
    if not sql:
        return None, "the answer contains no SQL query"
    deadline = time.monotonic() + timeout_s
    conn = sqlite3.connect(db)
    conn.set_progress_handler(lambda: time.monotonic() > deadline, 10_000)
    try:
        return conn.execute(sql).fetchmany(20), None
    except (sqlite3.Error, sqlite3.Warning, ValueError) as exc:
        return None, f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()


def answer(client: openai.OpenAI, model: str, question: str, db: str, temperature: float = 0.7) -> str:
    """The agent's loop: returns the final SQL (empty when the model never wrote any), printing each outcome."""
    messages = [{"role": "system", "content": SYSTEM.format(schema=read_schema(db))},
                {"role": "user", "content": question}]
    sql = ""
    for _ in range(MAX_TURNS):
        stream = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                                temperature=temperature, stream=True,
                                                stream_options={"include_usage": True})
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        messages.append({"role": "assistant", "content": text})
        sql = extract_sql(text)
        rows, error = run_sql(db, sql)
        if error is None:
            print(f"rows: {rows}")
            break
        print(f"error: {error}")
        messages.append({"role": "user", "content": f"The query failed: {error}\nWrite a corrected query."})
    return sql


def run(task: dict, llm) -> str:
    """Entry point for `lightning-otel rollout --agent examples/openai_sql/agent.py:run` (in-process mode):
    `task` has the question and db_path; `llm` any object with base_url, api_key and model."""
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key)
    return answer(client, llm.model, task["question"], task["db_path"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--question", required=True)
    parser.add_argument("--db", required=True, help="SQLite database file")
    parser.add_argument("--model", default="gpt-4o-mini")
    parser.add_argument("--temperature", type=float, default=0.7)
    args = parser.parse_args()
    print(answer(openai.OpenAI(), args.model, args.question, args.db, args.temperature))


if __name__ == "__main__":
    main()
