"""Text-to-SQL agent on AutoGen AgentChat: one AssistantAgent with an execute_sql tool.

    python agent.py --question "How many singers do we have?" --db singer.sqlite [--model gpt-4o-mini]

Uses autogen-ext's OpenAIChatCompletionClient against any OpenAI-compatible endpoint (OPENAI_BASE_URL,
OPENAI_API_KEY). At most three tool rounds. The last line of stdout is the final SQL: the last query the
agent ran with the tool, else the query in its final answer (empty when there is none).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import sqlite3
import time

from autogen_agentchat.agents import AssistantAgent
from autogen_core.models import ModelInfo
from autogen_ext.models.openai import OpenAIChatCompletionClient

MAX_TOOL_ROUNDS = 3
MAX_TOKENS = 96
SYSTEM = ("You write SQLite queries. Call execute_sql with your query to check it, fix it if it fails, and "
          "finish with the final query in a ```sql``` block.\nThe database has these tables:\n{schema}")
# Capabilities of a model AutoGen does not know by name (any model behind an OpenAI-compatible server).
MODEL_INFO = ModelInfo(vision=False, function_calling=True, json_output=False, family="unknown",
                       structured_output=False)


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
        conn = sqlite3.connect(db)
        conn.set_progress_handler(lambda: time.monotonic() > deadline, 10_000)
        try:
            return repr(conn.execute(str(query)).fetchmany(20))
        except (sqlite3.Error, sqlite3.Warning, ValueError) as exc:
            return f"Error: {type(exc).__name__}: {exc}"
        finally:
            conn.close()
    return execute_sql


async def run(args: argparse.Namespace) -> str:
    client = OpenAIChatCompletionClient(model=args.model, base_url=os.environ.get("OPENAI_BASE_URL"),
                                        api_key=os.environ.get("OPENAI_API_KEY"), model_info=MODEL_INFO,
                                        max_tokens=MAX_TOKENS, temperature=args.temperature)
    executed: list[str] = []
    agent = AssistantAgent("sql_agent", model_client=client, tools=[make_tool(args.db, executed)],
                           system_message=SYSTEM.format(schema=read_schema(args.db)),
                           max_tool_iterations=MAX_TOOL_ROUNDS, reflect_on_tool_use=False)
    try:
        result = await agent.run(task=args.question)
    finally:
        await client.close()
    last = result.messages[-1] if result.messages else None
    final = last.to_text() if last is not None else ""
    print(f"answer: {' '.join(final.split())}")
    # A query in the final answer wins; else the last one the agent ran.
    answer_sql = extract_sql(final) if last is not None and last.type == "TextMessage" else ""
    if re.match(r"(SELECT|WITH)\b", answer_sql, re.IGNORECASE) or not executed:
        return answer_sql
    return executed[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--question", required=True)
    parser.add_argument("--db", required=True, help="SQLite database file")
    parser.add_argument("--model", default="gpt-4o-mini")
    parser.add_argument("--temperature", type=float, default=0.7)
    args = parser.parse_args()
    print(asyncio.run(run(args)))


if __name__ == "__main__":
    main()
