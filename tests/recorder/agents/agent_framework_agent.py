"""Microsoft Agent Framework Agent with one function tool, over chat completions (OpenAIChatCompletionClient).
Agent Framework emits its own GenAI spans (invoke_agent, chat, execute_tool) through opentelemetry-api."""
import asyncio
import os

from agent_framework import Agent
from agent_framework.openai import OpenAIChatCompletionClient

import sql_tool
from sql_tool import MODEL, QUESTION, SYSTEM


def execute_sql(query: str) -> str:
    """Run a read-only SQL query on the singer database and return the rows as JSON."""
    return sql_tool.execute_sql(query)


async def main() -> None:
    client = OpenAIChatCompletionClient(model=MODEL, base_url=os.environ["OPENAI_BASE_URL"],
                                        api_key=os.environ["OPENAI_API_KEY"])
    agent = Agent(client, instructions=SYSTEM, name="sql_agent", tools=[execute_sql],
                  default_options={"temperature": 0.0})
    result = await agent.run(QUESTION)
    print(result.text)


if __name__ == "__main__":
    asyncio.run(main())
