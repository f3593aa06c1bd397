"""Reward functions, called by the rollout runner after each rollout as `fn(task, rollout) -> float | None`.

`task` is the task row (a dict from the task file); `rollout` is the rollout's row (`final_output`, status,
exit code, ...) plus `spans` (its spans as dicts) and `data_dir`. Returning None means "no reward": the
rollout is then excluded from training and counted, never scored 0.

Give one by registered name (`spider_exec`), as `module:function` or as `path/to/file.py:function`.
"""
from __future__ import annotations

import importlib
import re
import sqlite3
import time
from collections import Counter
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Protocol

from lightning_otel.errors import UserError


class RewardFunction(Protocol):
    def __call__(self, task: dict, rollout: dict) -> float | None: ...


def bundled_data_dir() -> Path:
    """The Spider subset shipped with the package (see its README for the source and licence)."""
    return Path(str(resources.files("lightning_otel") / "data" / "spider"))


def database_path(data_dir: Path | str, db_id: str) -> Path:
    """Spider's layout: <data_dir>/database/<db_id>/<db_id>.sqlite."""
    return Path(data_dir) / "database" / db_id / f"{db_id}.sqlite"


# ---- Spider execution match ------------------------------------------------------------------------

ORDER_BY = re.compile(r"\border\s+by\b", re.IGNORECASE)
FENCE = re.compile(r"^```(?:sql)?\s*|\s*```$", re.IGNORECASE)
# The first fenced block anywhere in an answer (an unclosed one runs to the end): models often write a line of
# prose, or the schema lines they read, before the query.
FENCED_BLOCK = re.compile(r"```(?:sqlite|sql)?[ \t]*\n?(.*?)(?:```|\Z)", re.IGNORECASE | re.DOTALL)


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


def spider_exec(task: dict, rollout: dict, timeout_s: float = 10.0) -> float | None:
    """1.0 when the rollout's final SQL returns the gold query's result on the task's database, else 0.0.

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
    outcome, predicted = sql_outcome(db, extract_sql(rollout.get("final_output")), timeout_s)
    if outcome != "executes":
        return SHAPED[outcome]
    gold = run_query(db, gold_sql, timeout_s)
    return 1.0 if results_match(gold, predicted, ordered=bool(ORDER_BY.search(gold_sql))) else SHAPED["executes"]


# ---- numeric answers -------------------------------------------------------------------------------

NUMBER = re.compile(r"(?<![\w.])-?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\w])|-?\d+(?:\.\d+)?")


def last_number(text: str | None) -> float | None:
    """The last number written in `text` ("1,234" and "-5.5" included), or None when it has none."""
    found = NUMBER.findall(text or "")
    return float(found[-1].replace(",", "")) if found else None


def number_match(task: dict, rollout: dict) -> float | None:
    """1.0 when the last number in the rollout's final output equals the task's `answer` (within 1e-6 of
    it, relative for large answers), else 0.0; None when the task has no numeric `answer`."""
    gold = task.get("answer")
    try:
        gold = float(str(gold).replace(",", "")) if gold is not None and not isinstance(gold, bool) else None
    except ValueError:
        gold = None
    if gold is None:
        return None
    predicted = last_number(rollout.get("final_output"))
    return float(predicted is not None and abs(predicted - gold) <= 1e-6 * max(1.0, abs(gold)))


# ---- registry --------------------------------------------------------------------------------------

REGISTRY: dict[str, RewardFunction] = {"spider_exec": spider_exec, "spider_shaped": spider_shaped,
                                       "number_match": number_match}


def resolve_reward(spec: str) -> RewardFunction:
    """A registered name, `module:function` importable from the current environment, or
    `path/to/file.py:function` (imported as `python file.py` would: its folder's modules import)."""
    if spec in REGISTRY:
        return REGISTRY[spec]
    if ":" not in spec:
        raise UserError(f"unknown reward {spec!r}: use one of {sorted(REGISTRY)}, module:function or "
                        "path/to/file.py:function")
    from lightning_otel.capture.agent_fn import load_agent_function, parse_agent_function

    in_file = parse_agent_function(spec)
    if in_file is not None and in_file.is_file:
        return load_agent_function(in_file, what="reward", call="fn(task, rollout)")
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(f"cannot import reward module {module_name!r}: {exc}") from None
    fn: Any = getattr(module, attr, None)
    if not callable(fn):
        raise UserError(f"{spec!r}: {module_name} has no function {attr!r}")
    return fn


def call_reward(fn: Callable[..., Any], task: dict, rollout: dict) -> float | None:
    """Call a reward function and check what it returned."""
    value = fn(task, rollout)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise UserError(f"reward function {getattr(fn, '__name__', fn)!r} returned {value!r}; "
                        f"return a finite number or None")
    return float(value)
