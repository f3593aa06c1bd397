"""Text-to-SQL agent on the OpenAI Agents SDK (openai-agents): one Agent("sql_agent") with an execute_sql tool.

    python agent.py --question "How many singers do we have?" --db singer.sqlite [--model gpt-4o-mini]

It knows nothing of lightning-otel: the SDK's own OpenTelemetry instrumentation
(opentelemetry-instrumentation-openai-agents) and the OpenAI one trace it under `opentelemetry-instrument`.
The SDK's default model provider (the Responses API) against any OpenAI-compatible endpoint that serves it
(OPENAI_BASE_URL, OPENAI_API_KEY). The first answer must call the tool; at most three model calls. The last
line of stdout is the final SQL: the query in the final answer, else the last one the agent ran (empty when
there is none). `run(task, llm)` is the same agent as a function, for the runner's in-process mode.
"""
from __future__ import annotations

import argparse
import asyncio
import re
import sqlite3
import time

from agents import Agent, ModelSettings, MultiProvider, RunConfig, Runner, function_tool
from agents.exceptions import AgentsException
from openai import AsyncOpenAI

MAX_TURNS = 3
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
    @function_tool
    def execute_sql(query: str) -> str:
        """Run one SQLite query on the database and return the first rows, or the error.

        Args:
            query: one SQLite SELECT statement.
        """
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


async def answer(model: str, question: str, db: str, temperature: float = 0.7,
                 run_config: RunConfig | None = None) -> str:
    """The agent's run: returns the final SQL, printing the final answer. `run_config` None is the SDK's
    default (its provider reads OPENAI_BASE_URL)."""
    executed: list[str] = []
    agent = Agent(name="sql_agent", instructions=INSTRUCTIONS.format(schema=read_schema(db)),
                  tools=[make_tool(db, executed)], model=model,
                  model_settings=ModelSettings(max_tokens=MAX_TOKENS, temperature=temperature,
                                               tool_choice="required"))  # the SDK resets it after the call
    try:
        final = str((await Runner.run(agent, question, max_turns=MAX_TURNS, run_config=run_config)).final_output)
    except AgentsException as exc:  # MaxTurnsExceeded; ModelBehaviorError for a reply cut at MAX_TOKENS (the
        # Responses API calls it incomplete): the episode ends without a final answer
        final = f"no answer: {type(exc).__name__}"
    print(f"answer: {' '.join(final.split())}")
    answer_sql = extract_sql(final)
    if re.match(r"(SELECT|WITH)\b", answer_sql, re.IGNORECASE):
        return answer_sql
    return executed[-1] if executed else ""


def run(task: dict, llm) -> str:
    """Entry point for lightning-otel's in-process mode (`--agent examples/openai_agents_sql/agent.py:run`):
    `task` has the question and db_path; `llm` any object with base_url, api_key and model. Many rollouts
    share the process, each with its own base URL: the default provider gets this rollout's client."""
    async def go() -> str:
        async with AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key) as client:
            config = RunConfig(model_provider=MultiProvider(openai_client=client))
            return await answer(llm.model, task["question"], task["db_path"], run_config=config)
    return asyncio.run(go())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--question", required=True)
    parser.add_argument("--db", required=True, help="SQLite database file")
    parser.add_argument("--model", default="gpt-4o-mini")
    parser.add_argument("--temperature", type=float, default=0.7)
    args = parser.parse_args()
    print(asyncio.run(answer(args.model, args.question, args.db, args.temperature)))


if __name__ == "__main__":
    main()
