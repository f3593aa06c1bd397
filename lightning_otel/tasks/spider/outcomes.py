"""Why a Spider answer failed, for reports: each scored, not-correct rollout gets one class, checked in order
(the generic classes correct, timeout, agent_error and unscored come first, see TaskPack.outcome):
- `no_sql`: the final output line is missing, or, once a code fence is removed, does not begin with SELECT or
  WITH (the model answered in prose);
- `sql_error`: the final SQL fails on the task's database (syntax, unknown column, time limit);
- `wrong_result`: the SQL runs but returns other rows than the gold query.
"""
from __future__ import annotations

import sqlite3
from pathlib import Path

from lightning_otel.tasks.spider.rewards import (SQL_START, QueryTimeout, bundled_data_dir, database_path, extract_sql,
                                                 run_query)

OUTCOME_CLASSES = {  # name -> meaning, in report order
    "wrong_result": "the final SQL runs but returns other rows",
    "sql_error": "the final SQL fails on the database (error or time limit)",
    "no_sql": "no final query: empty, prose, or not a SELECT/WITH statement",
}
SQL_RAN = ("correct", "wrong_result")  # the classes whose final SQL runs on its database
HARDNESS_ORDER = ("easy", "medium", "hard", "extra")


def classify(row: dict, data_dir: Path | None, timeout_s: float = 10.0) -> str:
    """The class of one scored, not-correct rollout row, re-running its SQL on the task's database."""
    sql = extract_sql(row.get("final_output"))
    if sql is None or not SQL_START.match(sql):
        return "no_sql"
    try:
        run_query(database_path(data_dir or bundled_data_dir(), str(row.get("db_id"))), sql, timeout_s)
    except (sqlite3.Error, sqlite3.Warning, QueryTimeout, ValueError):
        return "sql_error"
    return "wrong_result"
