"""Text-to-SQL agent as a LangGraph graph: write_query -> execute_query -> check_query -> rewrite_query,
looping back to execute_query until the check passes or three queries were tried.

    python agent.py --question "How many singers do we have?" --db singer.sqlite [--model gpt-4o-mini]

Uses langchain-openai's ChatOpenAI against any OpenAI-compatible endpoint (OPENAI_BASE_URL,
OPENAI_API_KEY). The last line of stdout is the final SQL (empty when the model never wrote any).
`run(task, llm)` is the same graph as a function, for the runner's in-process mode
(`--agent examples/sql_agent/agent.py:run`); it takes `llm` by duck typing and does not import lightning-otel.
"""
from __future__ import annotations

import argparse
import re
import sqlite3
import time
from typing import TypedDict

from langchain_core.messages import HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph

MAX_TURNS = 3
MAX_TOKENS = 96
WRITE = ("You write SQLite queries. Answer with one SQL query in a ```sql``` block and nothing else.\n"
         "The database has these tables:\n{schema}")
CHECK = ("You review SQLite queries. If the query answers the question, reply exactly THE QUERY IS CORRECT. "
         "Otherwise say briefly what is wrong.\nThe database has these tables:\n{schema}")
REWRITE = ("You fix SQLite queries. Answer with one corrected SQL query in a ```sql``` block and nothing else.\n"
           "The database has these tables:\n{schema}")


class State(TypedDict, total=False):
    question: str
    schema: str
    db: str
    sql: str
    result: str
    feedback: str
    turns: int


def read_schema(db: str) -> str:
    """One line per table, `name(column, ...)`: a quarter to a third of the tokens of the CREATE TABLE
    statements on Spider's databases, so prompts are cheaper to serve and to train on."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        tables = [name for (name,) in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY rowid")]
        lines = []
        for table in tables:
            columns = [name for (name,) in conn.execute("SELECT name FROM pragma_table_info(?) ORDER BY cid", (table,))]
            lines.append(f"{table}({', '.join(columns)})")
    return "\n".join(lines)


FENCE = r"```(?:sqlite|sql)?"  # a fence mark and its language tag (the longer tag first, so "sqlite" is read whole)


def extract_sql(text: str) -> str:
    """The query in the answer, on one line: a ```sql``` block, else from the first SELECT/WITH, else all but
    fence marks (an empty block is no query: "")."""
    fenced = re.search(FENCE + r"\s*(.*?)(?:```|$)", text, re.DOTALL | re.IGNORECASE)
    if fenced and fenced.group(1).strip():
        text = fenced.group(1)
    else:
        start = re.search(r"\b(SELECT|WITH)\b", text, re.IGNORECASE)
        text = text[start.start():] if start else re.sub(FENCE, " ", text, flags=re.IGNORECASE)
    return " ".join(text.split())


def run_sql(db: str, sql: str, timeout_s: float = 10.0) -> str:
    """The first rows, or the error, as text. Queries running past timeout_s are interrupted."""
    if not sql:
        return "Error: the answer contains no SQL query"
    deadline = time.monotonic() + timeout_s
    conn = sqlite3.connect(db)
    conn.set_progress_handler(lambda: time.monotonic() > deadline, 10_000)
    try:
        return repr(conn.execute(sql).fetchmany(20))
    except (sqlite3.Error, sqlite3.Warning, ValueError) as exc:
        return f"Error: {type(exc).__name__}: {exc}"
    finally:
        conn.close()


def review_request(question: str, sql: str, result: str) -> str:
    """The reviewer's user message: the question, the query and the start of what it returned."""
    return f"Question: {question}\nQuery: {sql}\nResult: {result[:500]}"


def build_graph(llm: ChatOpenAI):
    def ask(system: str, user: str, state: State) -> str:
        reply = llm.invoke([SystemMessage(system.format(schema=state["schema"])), HumanMessage(user)])
        return reply.content if isinstance(reply.content, str) else str(reply.content)

    def write_query(state: State) -> State:
        return {"sql": extract_sql(ask(WRITE, state["question"], state)), "turns": 1}

    def execute_query(state: State) -> State:
        return {"result": run_sql(state["db"], state["sql"])}

    def check_query(state: State) -> State:
        return {"feedback": ask(CHECK, review_request(state["question"], state["sql"], state["result"]), state)}

    def rewrite_query(state: State) -> State:
        user = review_request(state["question"], state["sql"], state["result"]) + f"\nReview: {state['feedback']}"
        return {"sql": extract_sql(ask(REWRITE, user, state)) or state["sql"], "turns": state["turns"] + 1}

    def after_execute(state: State) -> str:
        return END if state["turns"] >= MAX_TURNS else "check_query"

    def after_check(state: State) -> str:
        return END if "THE QUERY IS CORRECT" in state["feedback"].upper() else "rewrite_query"

    graph = StateGraph(State)
    graph.add_node("write_query", write_query)
    graph.add_node("execute_query", execute_query)
    graph.add_node("check_query", check_query)
    graph.add_node("rewrite_query", rewrite_query)
    graph.add_edge(START, "write_query")
    graph.add_edge("write_query", "execute_query")
    graph.add_conditional_edges("execute_query", after_execute, ["check_query", END])
    graph.add_conditional_edges("check_query", after_check, ["rewrite_query", END])
    graph.add_edge("rewrite_query", "execute_query")
    return graph.compile()


def run(task: dict, llm, temperature: float = 0.7, max_tokens: int = 256) -> str:
    """Entry point for the in-process mode: `task` has the question and db_path; `llm` any object with
    base_url, api_key and model. Answers may run to `max_tokens` (the training gateway caps them lower)."""
    chat = ChatOpenAI(model=llm.model, base_url=llm.base_url, api_key=llm.api_key, temperature=temperature,
                      max_tokens=max_tokens)
    final = build_graph(chat).invoke({"question": task["question"], "schema": read_schema(task["db_path"]),
                                      "db": task["db_path"]})
    return final.get("sql", "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--question", required=True)
    parser.add_argument("--db", required=True, help="SQLite database file")
    parser.add_argument("--model", default="gpt-4o-mini")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="the longest answer of each call")
    args = parser.parse_args()

    llm = ChatOpenAI(model=args.model, temperature=args.temperature, max_tokens=args.max_tokens)  # OPENAI_* env
    final = build_graph(llm).invoke({"question": args.question, "schema": read_schema(args.db), "db": args.db})
    print(f"result: {final.get('result', '')}")
    print(final.get("sql", ""))


if __name__ == "__main__":
    main()
