"""Renamed copies of Spider databases: the same rows under other table and column names, and labelled
questions asked again on them with their gold query rewritten to the new names.

On held-out databases most of a small model's wrong answers name a table or column the schema lacks
(benchmarks/RESULTS.md): it writes the names it learned on the training databases, or the ones its pretraining
suggests (`singers` for `singer`), instead of copying them out of the schema in its prompt. A question asked
on a renamed copy of its database can only be answered by reading the schema. The new names are the kind the
model gets wrong (plural for singular and back, underscores dropped or added, a prefix or suffix, another
letter case), so recalling the usual spelling is wrong there.

`renamed_tasks()` writes a Spider-layout data folder (every database of the source folder, plus one renamed
copy `<db_id>_renamed` of each database the rows use) and returns the renamed rows. A row is kept only when its
rewritten query returns on the copy exactly what the gold query returns on the original. Train with the
folder as the run's `data_dir`, so the agent and the reward open the copies.
"""
from __future__ import annotations

import logging
import random
import re
import shutil
import sqlite3
from contextlib import closing
from pathlib import Path

from lightning_otel.tasks.spider.repair import name_variants, replace_words, schema_names
from lightning_otel.tasks.spider.rewards import QueryTimeout, database_path, run_query
from lightning_otel.tasks.spider.synthesis import by_database, read_tables, round_robin

log = logging.getLogger(__name__)

SUFFIX = "_renamed"
BARE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# Words a bare name must not become: the query would no longer parse.
KEYWORDS = {"abort", "action", "add", "all", "alter", "and", "as", "asc", "between", "by", "case", "cast", "check",
            "column", "create", "cross", "current", "default", "delete", "desc", "distinct", "drop", "else", "end",
            "escape", "except", "exists", "filter", "from", "full", "glob", "group", "having", "in", "index", "inner",
            "insert", "intersect", "into", "is", "isnull", "join", "key", "left", "like", "limit", "match",
            "natural", "not", "notnull", "null", "of", "offset", "on", "or", "order", "outer", "over", "primary",
            "references", "right", "rows", "select", "set", "table", "then", "to", "union", "unique", "update",
            "using", "values", "view", "when", "where", "with"}


def new_name(name: str, rng: random.Random) -> str:
    """Another spelling of `name`: one of name_variants (plural/singular, underscores dropped, ...), a prefix or
    suffix, or the other case convention (snake_case <-> CamelCase)."""
    parts = [p for p in re.split(r"_|(?<=[a-z0-9])(?=[A-Z])", name) if p]
    choices = name_variants(name) + [f"{rng.choice(('tbl', 'the', 'my', 'x'))}_{name}",
                                     f"{name}_{rng.choice(('info', 'data', 'rec', 'list'))}"]
    if len(parts) > 1:
        choices += ["".join(p[:1].upper() + p[1:] for p in parts) if "_" in name else "_".join(parts).lower()]
    return rng.choice(choices)


def renaming(db: Path, rng: random.Random) -> dict[str, str]:
    """Old name (lower case) -> new name for every bare table and column name of `db`. A name used by several
    tables gets one new name everywhere, so a query is rewritten word by word; new names are distinct from each
    other and from every name kept."""
    tables, columns = schema_names(db)
    names = list(dict.fromkeys(n.lower() for n in tables + columns))
    spelled = {n.lower(): n for n in tables + columns}
    taken = {n for n in names if not BARE.match(spelled[n])}  # names left as they are
    out: dict[str, str] = {}
    for lower in names:
        if lower in taken:
            continue
        for _ in range(8):
            candidate = new_name(spelled[lower], rng)
            key = candidate.lower()
            if BARE.match(candidate) and key not in KEYWORDS and key not in taken and key not in names:
                out[lower] = candidate
                taken.add(key)
                break
        else:
            taken.add(lower)  # no free spelling: the name stays
    return out


def _rename(conn: sqlite3.Connection, statement: str, done: dict[str, str], old: str, new: str) -> None:
    try:
        conn.execute(statement)
        done[old.lower()] = new
    except sqlite3.Error as exc:  # a view or trigger SQLite cannot rewrite: the name stays
        log.debug("%s: %s", statement, exc)


def rename_database(source: Path, target: Path, mapping: dict[str, str]) -> dict[str, str]:
    """A copy of `source` at `target` with its tables and columns renamed by `mapping`. Returns the renames
    SQLite carried out (a rename it refuses, say in a view or trigger it cannot rewrite, is left out)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    done: dict[str, str] = {}
    with closing(sqlite3.connect(target)) as conn:
        for table in read_tables(conn):  # the names before any rename
            for column in table.columns:
                new = mapping.get(column.name.lower())
                if new:
                    _rename(conn, f'ALTER TABLE "{table.name}" RENAME COLUMN "{column.name}" TO "{new}"', done,
                            column.name, new)
            new = mapping.get(table.name.lower())
            if new:
                _rename(conn, f'ALTER TABLE "{table.name}" RENAME TO "{new}"', done, table.name, new)
        conn.commit()
    return done


def same_answer(original: Path, renamed: Path, query: str, rewritten: str, timeout_s: float = 5.0) -> bool:
    """`rewritten` returns on `renamed` what `query` returns on `original` (False when either fails)."""
    try:
        before, after = run_query(original, query, timeout_s), run_query(renamed, rewritten, timeout_s)
    except (sqlite3.Error, QueryTimeout):
        return False
    return before == after


def renamed_tasks(rows: list[dict], source: Path, out: Path, count: int, seed: int = 0,
                  suffix: str = SUFFIX) -> list[dict]:
    """Up to `count` of the labelled `rows` (with db_id and query), taken from each database in turn, asked on a
    renamed copy of their database; `out` becomes a Spider-layout data folder with every database of the
    Spider-layout folder `source` and the copies. Each row keeps its fields; its db_id gets `suffix` ("_renamed"),
    its id the same without the underscore ("-renamed"), its query the new names. Another `suffix` (and `seed`)
    writes a second set of copies beside the first, renamed otherwise: a call leaves other suffixes' copies."""
    if out.resolve() == source.resolve():
        raise ValueError(f"{out} is the source data folder: give renamed_tasks another folder to write")
    rng = random.Random(seed)
    shutil.copytree(source / "database", out / "database", dirs_exist_ok=True)
    renames: dict[str, dict[str, str]] = {}
    for db_id in dict.fromkeys(row["db_id"] for row in rows):
        mapping = renaming(database_path(source, db_id), rng)
        renames[db_id] = rename_database(database_path(source, db_id), database_path(out, db_id + suffix), mapping)
    made = []
    for row in by_database(rows):
        if len(made) >= count:
            break
        db_id = row["db_id"]
        rewritten = replace_words(row["query"], renames[db_id])
        if rewritten != row["query"] and same_answer(database_path(source, db_id),
                                                     database_path(out, db_id + suffix), row["query"], rewritten):
            made.append({**row, "id": f"{row['id']}-{suffix.strip('_')}", "db_id": db_id + suffix, "query": rewritten})
    return made


def with_renamed(rows: list[dict], source: Path, out: Path, count: int) -> list[dict]:
    """`rows` with up to `count` renamed questions (renamed_tasks, written into data folder `out`) taken in turn
    with them."""
    return round_robin(rows, renamed_tasks(rows, source, out, count))
