"""The tiny text-to-SQL world shared by the recorder's agent scripts (no lightning-otel imports)."""
import json
import sqlite3

QUESTION = "How many singers are there?"
SYSTEM = ("You answer questions about a SQLite database with one table "
          "singer(singer_id INTEGER, name TEXT, country TEXT, age INTEGER). "
          "Use the execute_sql tool to run a query, then answer in one sentence.")
MODEL = "gpt-4o-mini"


def make_db() -> sqlite3.Connection:
    db = sqlite3.connect(":memory:", check_same_thread=False)
    db.execute("CREATE TABLE singer (singer_id INTEGER PRIMARY KEY, name TEXT, country TEXT, age INTEGER)")
    db.executemany("INSERT INTO singer VALUES (?, ?, ?, ?)",
                   [(1, "Joe Sharp", "Netherlands", 52), (2, "Timbaland", "United States", 32),
                    (3, "Justin Brown", "France", 29)])
    return db


DB = make_db()


def execute_sql(query: str) -> str:
    """Run a read-only SQL query on the singer database and return the rows as JSON."""
    try:
        rows = DB.execute(query).fetchall()
    except sqlite3.Error as e:
        return json.dumps({"error": str(e)})
    return json.dumps(rows)


OPENAI_TOOLS = [{
    "type": "function",
    "function": {
        "name": "execute_sql",
        "description": "Run a read-only SQL query on the singer database and return the rows as JSON.",
        "parameters": {"type": "object",
                       "properties": {"query": {"type": "string", "description": "a SQLite SELECT statement"}},
                       "required": ["query"]},
    },
}]
