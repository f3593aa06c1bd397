"""LangGraph text-to-SQL agent: write_query -> execute_query -> answer."""
from typing import Annotated, TypedDict

from langchain_core.messages import AnyMessage, HumanMessage, SystemMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages

import sql_tool
from sql_tool import MODEL, QUESTION, SYSTEM


@tool
def execute_sql(query: str) -> str:
    """Run a read-only SQL query on the singer database and return the rows as JSON."""
    return sql_tool.execute_sql(query)


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


llm = ChatOpenAI(model=MODEL, temperature=0.0, max_tokens=256)  # base_url/api key from OPENAI_* env
llm_with_tools = llm.bind_tools([execute_sql])


def write_query(state: State) -> dict:
    return {"messages": [llm_with_tools.invoke(state["messages"])]}


def execute_query(state: State) -> dict:
    last = state["messages"][-1]
    return {"messages": [execute_sql.invoke(tc) for tc in last.tool_calls]}


def answer(state: State) -> dict:
    return {"messages": [llm.invoke(state["messages"])]}


def build():
    g = StateGraph(State)
    g.add_node("write_query", write_query)
    g.add_node("execute_query", execute_query)
    g.add_node("answer", answer)
    g.add_edge(START, "write_query")
    g.add_edge("write_query", "execute_query")
    g.add_edge("execute_query", "answer")
    g.add_edge("answer", END)
    return g.compile()


if __name__ == "__main__":
    out = build().invoke({"messages": [SystemMessage(SYSTEM), HumanMessage(QUESTION)]})
    print(out["messages"][-1].content)
