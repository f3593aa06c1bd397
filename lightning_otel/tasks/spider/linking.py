"""Schema linking as an answer's first step: SFT labels whose answer copies the schema lines of the tables its
query names, then writes the query.

On held-out databases most wrong answers name a table or column the schema lacks (benchmarks/RESULTS.md). An
answer that first copies the lines it needs has every name written just before the query that uses them.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from lightning_otel.tasks.spider.repair import TOKEN
from lightning_otel.tasks.spider.rewards import database_path

SQL_LABEL = "```sql\n{query}\n```"
LINKED_LABEL = "{link}\n" + SQL_LABEL  # the schema lines the query needs (a row's `link`), copied first
LINKED_MAX_TOKENS = 192  # a linked answer's length: its schema lines run ~38 tokens on average, up to ~135


def linked_schema(schema: str, query: str) -> str:
    """The lines of `schema` (one `table(column, ...)` per line, the LangGraph example's format) whose table
    `query` names, in the order the query first names them."""
    lines = {line.split("(", 1)[0].lower(): line for line in schema.splitlines()}
    # the query's bare words (quoted text is not a name), in order, each line once
    return "\n".join(dict.fromkeys(lines[word.lower()] for word in TOKEN.findall(query) if word.lower() in lines))


def with_links(rows: list[dict], data: Path, read_schema: Callable[[str], str]) -> list[dict]:
    """`rows` with their `link` field: linked_schema of the schema the agent shows for the row's database and
    of the row's gold query. `read_schema(db_path)` is the agent's own schema text (one `table(column, ...)`
    per line), read once per database from the Spider-layout folder `data` (which may hold renamed copies)."""
    schemas: dict[str, str] = {}
    for row in rows:
        if row["db_id"] not in schemas:
            schemas[row["db_id"]] = read_schema(str(database_path(data, row["db_id"])))
    return [{**row, "link": linked_schema(schemas[row["db_id"]], row["query"])} for row in rows]
