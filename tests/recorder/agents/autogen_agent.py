"""autogen-agentchat AssistantAgent with one function tool."""
import asyncio
import os

from autogen_agentchat.agents import AssistantAgent
from autogen_ext.models.openai import OpenAIChatCompletionClient

import sql_tool
from sql_tool import MODEL, QUESTION, SYSTEM


async def execute_sql(query: str) -> str:
    """Run a read-only SQL query on the singer database and return the rows as JSON."""
    return sql_tool.execute_sql(query)


async def main() -> None:
    client = OpenAIChatCompletionClient(model=MODEL, base_url=os.environ["OPENAI_BASE_URL"],
                                        api_key=os.environ["OPENAI_API_KEY"], temperature=0.0)
    agent = AssistantAgent("sql_agent", model_client=client, tools=[execute_sql], system_message=SYSTEM,
                           reflect_on_tool_use=True)
    result = await agent.run(task=QUESTION)
    print(result.messages[-1].content)
    await client.close()


if __name__ == "__main__":
    asyncio.run(main())
