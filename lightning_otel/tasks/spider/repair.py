"""Repair demonstrations for a multi-turn SQL agent: a labelled question, a wrong first query of the kind a
small model writes on a schema it has not seen, and the labelled path that repairs it.

The LangGraph agent (examples/sql_agent) reviews each query together with its result and rewrites it when the
review rejects it. A warm start on gold queries only ever shows the reviewer accepting ("THE QUERY IS
CORRECT"), so the reviewer learns to accept everything and the rewrite step is never trained. On held-out
databases most wrong answers name a table or column the schema lacks (benchmarks/RESULTS.md): a plural or
shortened table name, a column looked up in the wrong table. `corrupt()` makes such a query from the gold
one (one identifier replaced everywhere it occurs) and keeps it only if SQLite refuses it with "no such table"
or "no such column"; the review quotes that error.

With REPAIR_LABELS as the SFT labels (and REPAIR_UNTRAINED as `sft_untrained`) the gateway walks the agent
along the path: the wrong query (answered, not trained), the review that rejects it, the gold query, the
review that accepts it.
"""
from __future__ import annotations

import random
import re
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Callable

from lightning_otel.tasks.spider.rewards import QueryTimeout, run_query
from lightning_otel.tasks.spider.synthesis import by_database, read_tables

REPAIR_LABELS = ["```sql\n{wrong_query}\n```", "{review}", "```sql\n{query}\n```", "THE QUERY IS CORRECT"]
REPAIR_UNTRAINED = [0]  # the wrong query is there to be repaired, not learned
# Quoted text (SQLite strings and quoted identifiers) is left alone; bare words are candidates.
TOKEN = re.compile(r"'(?:[^']|'')*'|\"[^\"]*\"|`[^`]*`|\[[^\]]*\]|[A-Za-z_][A-Za-z0-9_]*")


def schema_names(db: Path) -> tuple[list[str], list[str]]:
    """The database's table names and its column names (each once), read once per database."""
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        tables = read_tables(conn)
    return [t.name for t in tables], list(dict.fromkeys(c.name for t in tables for c in t.columns))


def name_variants(name: str) -> list[str]:
    """Names a model writes for `name` without reading the schema closely: plural for singular and back,
    underscores dropped, a part of a compound name alone, its first part cut to one letter."""
    out = [name[:-1] if name.lower().endswith("s") and len(name) > 2 else name + "s"]
    parts = [p for p in name.split("_") if p]
    if len(parts) > 1:
        out += ["".join(parts), parts[-1], parts[0][0] + "_" + "_".join(parts[1:])]
    return [v for v in dict.fromkeys(out) if v.lower() != name.lower()]


def replace_words(query: str, mapping: dict[str, str]) -> str:
    """`query` with each bare (unquoted) identifier that `mapping` names (lower-case keys) replaced, in one pass."""
    return TOKEN.sub(lambda m: mapping.get(m.group(0).lower(), m.group(0)), query)


def replace_word(query: str, old: str, new: str) -> str:
    """`query` with every bare (unquoted) occurrence of identifier `old` replaced, case-insensitively."""
    return replace_words(query, {old.lower(): new})


def failure(db: Path, query: str, timeout_s: float = 5.0) -> str | None:
    """SQLite's "no such table/column" message for `query`, or None when it runs or fails otherwise."""
    try:
        run_query(db, query, timeout_s)
    except (sqlite3.Error, QueryTimeout) as exc:
        message = str(exc)
        return message if message.startswith(("no such table", "no such column")) else None
    return None


def corrupt(db: Path, names: tuple[list[str], list[str]], query: str, rng: random.Random) -> tuple[str, str] | None:
    """(wrong query, SQLite's error) for the gold `query` on database file `db` whose `names` are
    schema_names(db): one table or column name replaced by a variant of it, by another table of the database,
    or by a column of another table. None when no candidate fails."""
    tables, columns = names
    known = {n.lower(): n for n in tables + columns}
    used = list(dict.fromkeys(known[t.lower()] for t in TOKEN.findall(query) if t.lower() in known))
    candidates = []
    for name in used:
        candidates += [(name, v) for v in name_variants(name)]
        pool = tables if name in tables else columns
        candidates += [(name, other) for other in rng.sample(pool, min(3, len(pool))) if other != name]
    rng.shuffle(candidates)
    for old, new in candidates:
        wrong = replace_word(query, old, new)
        error = failure(db, wrong) if wrong != query else None
        if error:
            return wrong, error
    return None


def repair_tasks(rows: list[dict], database: Callable[[str], Path], count: int, seed: int = 0) -> list[dict]:
    """Up to `count` repair tasks from labelled rows, taken from each database in turn: the row's fields plus
    `wrong_query` and `review`, id suffixed "-repair". `database(db_id)` gives the SQLite file."""
    rng = random.Random(seed)
    out, names = [], {}
    for row in by_database(rows):
        if len(out) >= count:
            break
        db = database(row["db_id"])
        if row["db_id"] not in names:
            names[row["db_id"]] = schema_names(db)
        made = corrupt(db, names[row["db_id"]], row["query"], rng)
        if made:
            wrong, error = made
            out.append({**row, "id": f"{row['id']}-repair", "wrong_query": wrong,
                        "review": f"The query fails: {error}."})
    return out
