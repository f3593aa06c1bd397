"""Text-to-SQL agent on Microsoft Agent Framework (agent-framework-core): one Agent("sql_agent") with an
execute_sql tool.

    python agent.py --question "How many singers do we have?" --db singer.sqlite [--model gpt-4o-mini]

It knows nothing of lightning-otel: Agent Framework emits its own GenAI spans (invoke_agent, chat,
execute_tool) through the OpenTelemetry API, and the OpenAI instrumentation adds the SDK's under
`opentelemetry-instrument`. Chat completions (agent_framework.openai.OpenAIChatCompletionClient) against any
OpenAI-compatible endpoint (OPENAI_BASE_URL, OPENAI_API_KEY). The first answer must call the tool; at most
three model calls. The last line of stdout is the final SQL: the query in the final answer, else the last
one the agent ran (empty when there is none). `run(task, llm)` is the same agent as a function, for the
runner's in-process mode.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import sqlite3
import time

from agent_framework import Agent
from agent_framework.openai import OpenAIChatCompletionClient

MAX_MODEL_CALLS = 3
MAX_TOKENS = 96
INSTRUCTIONS = ("You write SQLite queries. Call execute_sql with your query to check it, fix it if it fails, "
                "and finish with the final query in a ```sql``` block.\nThe database has these tables:\n{schema}")


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


def make_tool(db: str, executed: list[str]):
    def execute_sql(query: str) -> str:
        """Run one SQLite query on the database and return the first rows, or the error."""
        executed.append(" ".join(str(query).split()))
        deadline = time.monotonic() + 10.0
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        conn.set_progress_handler(lambda: time.monotonic() > deadline, 10_000)
        try:
            return repr(conn.execute(str(query)).fetchmany(20))
        except (sqlite3.Error, sqlite3.Warning, ValueError) as exc:
            return f"Error: {type(exc).__name__}: {exc}"
        finally:
            conn.close()
    return execute_sql


async def answer(base_url: str | None, api_key: str | None, model: str, question: str, db: str,
                 temperature: float = 0.7) -> str:
    """The agent's run: returns the final SQL, printing the final answer."""
    client = OpenAIChatCompletionClient(model=model, base_url=base_url, api_key=api_key)
    client.function_invocation_configuration["max_iterations"] = MAX_MODEL_CALLS
    executed: list[str] = []
    agent = Agent(client, instructions=INSTRUCTIONS.format(schema=read_schema(db)), name="sql_agent",
                  tools=[make_tool(db, executed)],
                  # Agent Framework resets a required tool choice after the first call.
                  default_options={"max_tokens": MAX_TOKENS, "temperature": temperature, "tool_choice": "required"})
    final = (await agent.run(question)).text or ""
    print(f"answer: {' '.join(final.split())}")
    answer_sql = extract_sql(final)
    if re.match(r"(SELECT|WITH)\b", answer_sql, re.IGNORECASE):
        return answer_sql
    return executed[-1] if executed else ""


def run(task: dict, llm) -> str:
    """Entry point for lightning-otel's in-process mode (`--agent examples/agent_framework_sql/agent.py:run`):
    `task` has the question and db_path; `llm` any object with base_url, api_key and model."""
    return asyncio.run(answer(llm.base_url, llm.api_key, llm.model, task["question"], task["db_path"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--question", required=True)
    parser.add_argument("--db", required=True, help="SQLite database file")
    parser.add_argument("--model", default="gpt-4o-mini")
    parser.add_argument("--temperature", type=float, default=0.7)
    args = parser.parse_args()
    print(asyncio.run(answer(os.environ.get("OPENAI_BASE_URL"), os.environ.get("OPENAI_API_KEY"), args.model,
                             args.question, args.db, args.temperature)))


if __name__ == "__main__":
    main()
