"""CrewAI crew: one agent with one tool, one task."""
import os

from crewai import LLM, Agent, Crew, Process, Task
from crewai.tools import tool

import sql_tool
from sql_tool import MODEL, QUESTION


@tool("execute_sql")
def execute_sql(query: str) -> str:
    """Run a read-only SQL query on the singer database (table singer) and return the rows as JSON."""
    return sql_tool.execute_sql(query)


def main() -> None:
    llm = LLM(model=f"openai/{MODEL}", base_url=os.environ["OPENAI_BASE_URL"],
              api_key=os.environ["OPENAI_API_KEY"], temperature=0.0)
    analyst = Agent(role="SQL Analyst", goal="Answer questions about the singer database with SQL",
                    backstory="You know SQLite well and always check the data with a query.",
                    tools=[execute_sql], llm=llm, allow_delegation=False, max_iter=4, verbose=False)
    task = Task(description=QUESTION, expected_output="One sentence with the number of singers.",
                agent=analyst, name="count_singers")
    crew = Crew(agents=[analyst], tasks=[task], process=Process.sequential, verbose=False)
    print(crew.kickoff())


if __name__ == "__main__":
    main()
