"""Spider's rewards: execution match of the rollout's final SQL against the gold query on the task's database.

    --reward spider_exec     1 for the gold result, else 0
    --reward spider_shaped   the same, with partial credit for SQL that gets part of the way

The final SQL is the query in the agent's final output; when that holds none (an agent that ends in prose, as
LangGraph's SQL tutorial does), it is the last SQL the agent ran through a tool, read from the rollout's spans.
Data in Spider's layout: <data_dir>/database/<db_id>/<db_id>.sqlite (default: the subset bundled here).
"""
from __future__ import annotations

import re
import sqlite3
import time
from collections import Counter
from importlib import resources
from pathlib import Path

from lightning_otel.errors import UserError
from lightning_otel.rollouts.trace_view import ToolCall, tool_calls


def bundled_data_dir() -> Path:
    """The Spider subset shipped with the package (see its README for the source and licence)."""
    return Path(str(resources.files("lightning_otel.tasks.spider") / "data"))


def database_path(data_dir: Path | str, db_id: str) -> Path:
    """Spider's layout: <data_dir>/database/<db_id>/<db_id>.sqlite."""
    return Path(data_dir) / "database" / db_id / f"{db_id}.sqlite"


ORDER_BY = re.compile(r"\border\s+by\b", re.IGNORECASE)
FENCE = re.compile(r"^```(?:sql)?\s*|\s*```$", re.IGNORECASE)
# The first fenced block anywhere in an answer (an unclosed one runs to the end): models often write a line of
# prose, or the schema lines they read, before the query.
FENCED_BLOCK = re.compile(r"```(?:sqlite|sql)?[ \t]*\n?(.*?)(?:```|\Z)", re.IGNORECASE | re.DOTALL)
# A query, as opposed to prose: what the outcome classes call SQL (outcomes.py, `no_sql`).
SQL_START = re.compile(r"^\s*(SELECT|WITH)\b", re.IGNORECASE)
SQL_ARGUMENTS = ("query", "sql")  # the names a SQL tool gives its statement (the tutorials' sql_db_query: query)


class QueryTimeout(Exception):
    pass


def run_query(db: Path, sql: str, timeout_s: float) -> list[tuple]:
    """Run one statement on a read-only connection (the file cannot change), stopping at the timeout."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    con.set_progress_handler(lambda: 1 if time.monotonic() > deadline else 0, 10_000)
    try:
        return con.execute(sql).fetchall()
    except sqlite3.OperationalError as exc:
        if "interrupted" in str(exc) and time.monotonic() > deadline:
            raise QueryTimeout(f"query ran past {timeout_s:g} s") from None
        raise
    finally:
        con.close()


def results_match(gold: list[tuple], predicted: list[tuple], ordered: bool) -> bool:
    """Spider's execution match: same rows as multisets (as sequences when `ordered`), allowing the
    prediction's columns in another order."""
    if len(gold) != len(predicted):
        return False
    if not gold:
        return True
    width = len(gold[0])
    if any(len(row) != width for row in predicted):
        return False
    gold_columns = list(zip(*gold))
    pred_columns = list(zip(*predicted))
    # A gold column can only map to a prediction column holding the same values.
    key = (lambda col: col) if ordered else (lambda col: Counter(col))
    candidates = [[j for j, pc in enumerate(pred_columns) if key(pc) == key(gc)] for gc in gold_columns]
    if any(not c for c in candidates):
        return False
    target = gold if ordered else Counter(gold)
    for perm in _assignments(candidates):
        reordered = [tuple(row[j] for j in perm) for row in predicted]
        if (reordered if ordered else Counter(reordered)) == target:
            return True
    return False


def _assignments(candidates: list[list[int]]):
    """Injective choices of one prediction column per gold column, each from that column's candidates."""
    chosen: list[int] = []

    def walk(i: int):
        if i == len(candidates):
            yield list(chosen)
            return
        for j in candidates[i]:
            if j not in chosen:
                chosen.append(j)
                yield from walk(i + 1)
                chosen.pop()

    yield from walk(0)


def extract_sql(output: str | None) -> str | None:
    """The SQL in an answer: the first fenced block's content when the answer has one, else the whole answer."""
    if output is None:
        return None
    block = FENCED_BLOCK.search(output)
    text = (block.group(1).strip() if block else "") or FENCE.sub("", output.strip()).strip()
    return text or None


def is_sql(text: str | None) -> bool:
    """Whether an answer holds a query: its SQL (extract_sql) begins with SELECT or WITH."""
    sql = extract_sql(text)
    return sql is not None and SQL_START.match(sql) is not None


def call_sql(call: ToolCall) -> str | None:
    """The SQL a tool call ran: its `query` or `sql` argument, else the first text argument that is a query."""
    if isinstance(call.arguments, dict):
        for key, value in call.arguments.items():
            if str(key).lower() in SQL_ARGUMENTS and isinstance(value, str) and value.strip():
                return extract_sql(value)
    return next((extract_sql(text) for text in call.strings() if is_sql(text)), None)


def last_tool_sql(rollout: dict) -> str | None:
    """The last SQL the rollout ran through a tool, from its spans (None when no tool call ran any)."""
    return next((sql for sql in map(call_sql, reversed(tool_calls(rollout))) if sql), None)


def final_sql(rollout: dict) -> str | None:
    """The SQL a rollout is scored on: the query in its final output; when that holds none, the last SQL it ran
    through a tool; with neither, the final output itself (prose, which SQLite refuses)."""
    answer = extract_sql(rollout.get("final_output"))
    if answer is not None and SQL_START.match(answer):
        return answer
    return last_tool_sql(rollout) or answer


def spider_exec(task: dict, rollout: dict, timeout_s: float = 10.0) -> float | None:
    """1.0 when the rollout's final SQL (final_sql: its final output's query, else the last one it ran through a
    tool) returns the gold query's result on the task's database, else 0.0.

    None when the task has no gold query or database (nothing to score against). A prediction that errors,
    times out or tries to write scores 0.0.
    """
    shaped = spider_shaped(task, rollout, timeout_s)
    return None if shaped is None else float(shaped == 1.0)


# Partial credit of spider_shaped, by how far the final SQL got (an exact execution match scores 1.0).
SHAPED = {"no_sql": 0.0, "refused": 0.1, "unknown_name": 0.25, "executes": 0.5}
UNKNOWN_NAME = re.compile(r"^no such (table|column)|^ambiguous column name", re.IGNORECASE)


def sql_outcome(db: Path, sql: str | None, timeout_s: float = 10.0) -> tuple[str, list[tuple] | None]:
    """How far `sql` gets on `db`: no_sql, refused (a syntax error, a write, a timeout...), unknown_name (valid
    SQL naming a table or column the schema lacks), or executes, with its rows."""
    if sql is None:
        return "no_sql", None
    try:
        return "executes", run_query(db, sql, timeout_s)
    except sqlite3.Error as exc:
        return ("unknown_name" if UNKNOWN_NAME.search(str(exc)) else "refused"), None
    except (QueryTimeout, ValueError):
        return "refused", None


def spider_shaped(task: dict, rollout: dict, timeout_s: float = 10.0) -> float | None:
    """spider_exec with partial credit for SQL that gets part of the way: 1.0 for the gold result, 0.5 for a
    query that executes with another result, 0.25 for valid SQL naming a table or column the database lacks,
    0.1 for SQL SQLite refuses otherwise, 0.0 for no SQL at all. For a model that rarely answers right, most
    GRPO groups of spider_exec score all 0 and give no gradient; these steps separate them."""
    gold_sql, db_id = task.get("query"), task.get("db_id")
    if not gold_sql or not db_id:
        return None
    db = database_path(rollout.get("data_dir") or bundled_data_dir(), db_id)
    if not db.is_file():
        raise UserError(f"database {db} of task {task.get('id')!r} does not exist; check --data-dir")
    outcome, predicted = sql_outcome(db, final_sql(rollout), timeout_s)
    if outcome != "executes":
        return SHAPED[outcome]
    gold = run_query(db, gold_sql, timeout_s)
    return 1.0 if results_match(gold, predicted, ordered=bool(ORDER_BY.search(gold_sql))) else SHAPED["executes"]
