"""The SQL agent of LangGraph's tutorial "Build a custom SQL agent", in the tutorial's shape, on a SQLite file.

    python agent.py --question "How many singers do we have?" --db singer.sqlite [--model gpt-4o-mini]

The graph is the tutorial's: `list_tables` (a tool call made by code, no model), `call_get_schema` (the model
must call `sql_db_schema`: `bind_tools([get_schema_tool], tool_choice="any")`), `get_schema` and `run_query`
(ToolNodes), `generate_query` (the model may call `sql_db_query` or answer), `check_query` (the model reviews
the query and must call `sql_db_query`), looping generate -> check -> run until the model answers in prose.
The three tools behave like langchain_community's SQLDatabaseToolkit tools of the same names (not installed
here), written with @tool over sqlite3. The prompts are this project's wording of the tutorial's.

The agent knows nothing of lightning-otel: under `opentelemetry-instrument`, LangChain's instrumentation traces
its nodes, model calls and tool calls. Its last line of stdout is the model's final answer, in prose: a reward
that wants the SQL reads it from the tool spans (the Spider rewards do: lightning_otel.rollouts.trace_view).
`run(task, llm)` is the same agent as a function, for the runner's in-process mode.
"""
from __future__ import annotations

import argparse
import sqlite3
import time
from typing import Literal

from langchain.chat_models import init_chat_model
from langchain.tools import tool
from langchain_core.messages import AIMessage
from langgraph.errors import GraphRecursionError
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode

DIALECT = "sqlite"
TOP_K = 5
SAMPLE_ROWS = 3
# Graph steps before the run stops (LangGraph's recursion_limit; its default is 25): 10 allows three queries.
MAX_STEPS = 10

GENERATE_QUERY = f"""You work with a SQL database. Write a correct {DIALECT} query that answers the user's
question, run it with the tool, read what it returns and answer the question. Unless the question asks for a
number of rows, return at most {TOP_K}. Order by a column that makes the answer useful. Select only the columns
the question needs, never all the columns of a table. Never change the database: no INSERT, UPDATE, DELETE,
DROP or the like."""

CHECK_QUERY = f"""You review {DIALECT} queries with care. Look for the usual mistakes: NOT IN over values that
may be NULL; UNION where UNION ALL was meant; BETWEEN for a range that should leave out its ends; comparing
values of different types; identifiers that need quotes; functions given the wrong number of arguments; values
not cast to the type a function needs; joins on the wrong columns. If you find one, rewrite the query; if not,
repeat it unchanged. Then call the tool to run it."""


def sql_tools(db: str, timeout_s: float = 10.0) -> list:
    """sql_db_list_tables, sql_db_schema and sql_db_query over the SQLite file `db`, opened read-only."""
    def connect() -> sqlite3.Connection:
        return sqlite3.connect(f"file:{db}?mode=ro", uri=True)

    def tables() -> list[str]:
        with connect() as conn:
            return [name for (name,) in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY name")]

    @tool
    def sql_db_list_tables(tool_input: str = "") -> str:
        """Takes an empty string and returns the database's table names, separated by commas."""
        return ", ".join(tables())

    @tool
    def sql_db_schema(table_names: str) -> str:
        """Takes table names separated by commas and returns each table's CREATE statement with a few of its
        rows. Call sql_db_list_tables first to learn which tables exist. Example input: table1, table2"""
        wanted = [name.strip() for name in table_names.split(",") if name.strip()]
        known = {name.lower(): name for name in tables()}
        missing = [name for name in wanted if name.lower() not in known]
        if missing or not wanted:
            named = ", ".join(missing) or repr(table_names)
            return f"Error: no table named {named}; the tables are {', '.join(known.values())}"
        parts = []
        with connect() as conn:
            for name in (known[n.lower()] for n in wanted):
                (create,) = conn.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?",
                                         (name,)).fetchone()
                cursor = conn.execute(f'SELECT * FROM "{name}" LIMIT {SAMPLE_ROWS}')
                header = "\t".join(column[0] for column in cursor.description)
                rows = "\n".join("\t".join(str(value) for value in row) for row in cursor.fetchall())
                parts.append(f"{create}\n\n/*\n{SAMPLE_ROWS} rows from {name} table:\n{header}\n{rows}\n*/")
        return "\n\n".join(parts)

    @tool
    def sql_db_query(query: str) -> str:
        """Takes one detailed and correct SQL query and returns the database's result. A wrong query returns an
        error message: then rewrite the query, check it and try again. For an unknown column, call sql_db_schema
        to read the table's columns."""
        deadline = time.monotonic() + timeout_s
        conn = connect()
        conn.set_progress_handler(lambda: time.monotonic() > deadline, 10_000)
        try:
            rows = conn.execute(query).fetchall()
        except (sqlite3.Error, sqlite3.Warning, ValueError) as exc:
            return f"Error: {exc}"
        finally:
            conn.close()
        return str(rows) if rows else ""

    return [sql_db_list_tables, sql_db_schema, sql_db_query]


def build_agent(model, db: str):
    """The tutorial's graph over `model` (a LangChain chat model) and the SQLite file `db`."""
    tools = sql_tools(db)
    list_tables_tool = next(t for t in tools if t.name == "sql_db_list_tables")
    get_schema_tool = next(t for t in tools if t.name == "sql_db_schema")
    run_query_tool = next(t for t in tools if t.name == "sql_db_query")

    def list_tables(state: MessagesState):
        # A tool call written by code: the tables are always listed first, without asking the model.
        tool_call = {"name": "sql_db_list_tables", "args": {}, "id": "list_tables_0", "type": "tool_call"}
        tool_call_message = AIMessage(content="", tool_calls=[tool_call])
        tool_message = list_tables_tool.invoke(tool_call)
        return {"messages": [tool_call_message, tool_message, AIMessage(f"Available tables: {tool_message.content}")]}

    def call_get_schema(state: MessagesState):
        # The model must call a tool here: "any" (LangChain's word for OpenAI's "required").
        llm_with_tools = model.bind_tools([get_schema_tool], tool_choice="any")
        return {"messages": [llm_with_tools.invoke(state["messages"])]}

    def generate_query(state: MessagesState):
        # Not forced: answering without a tool call ends the run.
        llm_with_tools = model.bind_tools([run_query_tool])
        return {"messages": [llm_with_tools.invoke([{"role": "system", "content": GENERATE_QUERY}]
                                                   + state["messages"])]}

    def check_query(state: MessagesState):
        tool_call = state["messages"][-1].tool_calls[0]
        llm_with_tools = model.bind_tools([run_query_tool], tool_choice="any")
        response = llm_with_tools.invoke([{"role": "system", "content": CHECK_QUERY},
                                          {"role": "user", "content": tool_call["args"]["query"]}])
        response.id = state["messages"][-1].id  # replaces the unchecked call in the state
        return {"messages": [response]}

    def should_continue(state: MessagesState) -> Literal["check_query", "__end__"]:
        return "check_query" if state["messages"][-1].tool_calls else END

    builder = StateGraph(MessagesState)
    builder.add_node(list_tables)
    builder.add_node(call_get_schema)
    builder.add_node("get_schema", ToolNode([get_schema_tool], name="get_schema"))
    builder.add_node(generate_query)
    builder.add_node(check_query)
    builder.add_node("run_query", ToolNode([run_query_tool], name="run_query"))
    builder.add_edge(START, "list_tables")
    builder.add_edge("list_tables", "call_get_schema")
    builder.add_edge("call_get_schema", "get_schema")
    builder.add_edge("get_schema", "generate_query")
    builder.add_conditional_edges("generate_query", should_continue)
    builder.add_edge("check_query", "run_query")
    builder.add_edge("run_query", "generate_query")
    return builder.compile()


def answer(model, question: str, db: str, max_steps: int = MAX_STEPS) -> str:
    """The agent's final answer: the last message when the model answered without a tool call, else "" (the
    run stopped at max_steps graph steps)."""
    agent, last = build_agent(model, db), None
    try:
        for state in agent.stream({"messages": [{"role": "user", "content": question}]},
                                  {"recursion_limit": max_steps}, stream_mode="values"):
            last = state["messages"][-1]
    except GraphRecursionError:
        return ""
    if not isinstance(last, AIMessage) or last.tool_calls:
        return ""
    return last.content if isinstance(last.content, str) else str(last.content)


def chat_model(model: str, **kwargs):
    return init_chat_model(model, model_provider="openai", **kwargs)


def run(task: dict, llm) -> str:
    """Entry point for lightning-otel's in-process mode (`--agent examples/langgraph_sql_tutorial/agent.py:run`):
    `task` has the question and db_path; `llm` any object with base_url, api_key and model."""
    model = chat_model(llm.model, base_url=llm.base_url, api_key=llm.api_key)
    return answer(model, task["question"], task["db_path"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--question", required=True)
    parser.add_argument("--db", required=True, help="SQLite database file")
    parser.add_argument("--model", default="gpt-4o-mini")
    parser.add_argument("--max-steps", type=int, default=MAX_STEPS, help="graph steps before the run stops")
    args = parser.parse_args()
    print(answer(chat_model(args.model), args.question, args.db, args.max_steps))  # OPENAI_* from the environment


if __name__ == "__main__":
    main()
