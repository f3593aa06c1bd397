"""OpenAI Agents SDK Agent with one function tool, over chat completions (OpenAIChatCompletionsModel)."""
import asyncio
import os

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool
from openai import AsyncOpenAI

import sql_tool
from sql_tool import MODEL, QUESTION, SYSTEM


@function_tool
def execute_sql(query: str) -> str:
    """Run a read-only SQL query on the singer database and return the rows as JSON.

    Args:
        query: a SQLite SELECT statement.
    """
    return sql_tool.execute_sql(query)


async def main() -> None:
    client = AsyncOpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"])
    agent = Agent(name="sql_agent", instructions=SYSTEM, tools=[execute_sql],
                  model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
                  model_settings=ModelSettings(temperature=0.0))
    result = await Runner.run(agent, QUESTION, max_turns=4)
    print(result.final_output)
    await client.close()


if __name__ == "__main__":
    asyncio.run(main())
