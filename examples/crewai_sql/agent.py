"""Text-to-SQL crew on CrewAI: one agent (role "SQL Analyst") with an execute_sql tool, one task.

    python agent.py --question "How many singers do we have?" --db singer.sqlite [--model gpt-4o-mini]

Uses CrewAI's native OpenAI provider against any OpenAI-compatible endpoint (OPENAI_BASE_URL,
OPENAI_API_KEY). The agent stops after two iterations. The last line of stdout is the final SQL: the
query in the crew's answer, else the last one the agent ran (empty when there is none).
"""
from __future__ import annotations

import argparse
import os
import re
import sqlite3
import time

from crewai import LLM, Agent, Crew, Process, Task
from crewai.tools import tool

MAX_ITER = 2
MAX_TOKENS = 96


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
    @tool("execute_sql")
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--question", required=True)
    parser.add_argument("--db", required=True, help="SQLite database file")
    parser.add_argument("--model", default="gpt-4o-mini")
    parser.add_argument("--temperature", type=float, default=0.7)
    args = parser.parse_args()

    llm = LLM(model=f"openai/{args.model}", base_url=os.environ.get("OPENAI_BASE_URL"),
              api_key=os.environ.get("OPENAI_API_KEY"), temperature=args.temperature, max_tokens=MAX_TOKENS)
    executed: list[str] = []
    # The schema goes in the backstory (the system prompt), not the task: CrewAI names the task's span
    # after its whole description.
    analyst = Agent(role="SQL Analyst", goal="Answer questions about a SQLite database with one correct query",
                    backstory=("You know SQLite well and check your queries with execute_sql before answering. "
                               f"The database has these tables:\n{read_schema(args.db)}"),
                    tools=[make_tool(args.db, executed)], llm=llm, allow_delegation=False, max_iter=MAX_ITER,
                    verbose=False)
    task = Task(description=f"Write one SQLite query that answers: {args.question}",
                expected_output="The final SQL query in a ```sql``` block.", agent=analyst)
    crew = Crew(agents=[analyst], tasks=[task], process=Process.sequential, verbose=False)
    answer = str(crew.kickoff().raw or "")
    print(f"answer: {' '.join(answer.split())}")
    answer_sql = extract_sql(answer)
    if re.match(r"(SELECT|WITH)\b", answer_sql, re.IGNORECASE) or not executed:
        print(answer_sql)
    else:
        print(executed[-1])


if __name__ == "__main__":
    main()
