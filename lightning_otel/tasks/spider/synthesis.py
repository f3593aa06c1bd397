"""Templated questions over Spider databases: SFT data that teaches reading the schema, not the gold set.

Plain SFT on Spider's few training databases fits their questions (about half of them answered right
afterwards) but carries their table names and query shapes over to unseen databases (benchmarks/RESULTS.md).
These rows add schema-grounded variety: for each table and column of a database, questions in Spider's style
("How many singers are there?", "Show the name of the singer with the highest age.") with the query that
answers them, written from the table and column names and from values read out of the database. Every query is
executed before it is kept: it must run and, except for counts, return rows (so databases without rows, as
Spider's geo, imdb, restaurants, scholar and yelp files, give none). Nothing here chooses databases: the caller
names them, and keeps held-out ones out (lightning_otel.tasks.spider.splits.HELD_OUT).

Rows have the task file's shape (`id`, `db_id`, `question`, `query`, `hardness`), `hardness` being the
template's class in Spider's counting (easy: one table, at most one condition or aggregate; medium: one more).
`synthesize` is reproducible and prefix-stable: for one seed, the first k rows of a larger count are the rows
of count k.
"""
from __future__ import annotations

import random
import re
import sqlite3
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path

NUMERIC_TYPES = ("INT", "REAL", "NUM", "FLOAT", "DOUBLE", "DEC")
ID_PREFIX = "synth-"  # every generated row's id starts with it, which tells them from Spider's own questions

Candidate = tuple[str, str, str]  # (question, query, hardness)


@dataclass
class Column:
    name: str
    words: str          # "template type code" for Template_Type_Code
    numeric: bool
    values: list        # distinct non-null values read from the table (at most 50)


@dataclass
class Table:
    name: str
    singular: str
    plural: str
    columns: list[Column]
    links: list[tuple[str, str, str]]   # (column here, other table, its column): the declared foreign keys


def round_robin(*lists: list) -> list:
    """The lists' items one from each in turn; a list that runs out drops out."""
    return [item for turn in zip_longest(*lists) for item in turn if item is not None]


def by_database(rows: list[dict]) -> list[dict]:
    """`rows` taken from each database (db_id) in turn, in their order within a database."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["db_id"], []).append(row)
    return round_robin(*groups.values())


def words_of(name: str) -> str:
    """Identifier to words: TV_Channel -> "tv channel", templateTypeCode -> "template type code"."""
    spaced = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", " ", name).replace("_", " ")
    return " ".join(spaced.lower().split())


def singular_of(words: str) -> str:
    """Spider's table names are singular (singer) or plural (Dogs): both are named as one of them."""
    if words.endswith("ies"):
        return words[:-3] + "y"
    if words.endswith(("ches", "shes", "xes", "sses")):
        return words[:-2]
    return words[:-1] if words.endswith("s") and not words.endswith(("ss", "us", "is")) else words


def plural_of(words: str) -> str:
    """English plural of a singular noun phrase (its last word)."""
    if words.endswith(("ss", "x", "ch", "sh")):
        return words + "es"
    if words.endswith("s"):
        return words
    if words.endswith("y") and words[-2:-1] not in ("a", "e", "o", "u"):
        return words[:-1] + "ies"
    return words + "s"


def quote(value) -> str:
    """`value` as an SQL literal."""
    return str(value) if isinstance(value, (int, float)) else "'" + str(value).replace("'", "''") + "'"


def read_tables(conn: sqlite3.Connection) -> list[Table]:
    """The database's tables in creation order, with their columns, sample values and foreign keys."""
    tables = []
    names = [n for (n,) in conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY rowid")]
    for name in names:
        columns = []
        for column, declared in conn.execute("SELECT name, upper(type) FROM pragma_table_info(?) ORDER BY cid",
                                             (name,)):
            values = [v for (v,) in conn.execute(
                f'SELECT DISTINCT "{column}" FROM "{name}" WHERE "{column}" IS NOT NULL LIMIT 50')]
            numeric = any(t in declared for t in NUMERIC_TYPES) and all(isinstance(v, (int, float)) for v in values)
            columns.append(Column(column, words_of(column), numeric, values))
        links = [(src, other, dst or "") for other, src, dst in conn.execute(
            'SELECT "table", "from", "to" FROM pragma_foreign_key_list(?)', (name,))]
        singular = singular_of(words_of(name))
        tables.append(Table(name, singular, plural_of(singular), columns, links))
    return tables


# The template groups below draw from the one `rng` in a fixed order (a row set is reproducible from its seed):
# a change of order changes every generated set.

def _listing_questions(t: Table, cols: list[Column], rng: random.Random) -> list[Candidate]:
    """Counts and projections of the whole table."""
    a, b = rng.choice(cols), rng.choice(cols)
    out = [
        (rng.choice([f"How many {t.plural} are there?", f"Count the number of {t.plural}.",
                     f"What is the total number of {t.plural}?"]), f"SELECT count(*) FROM {t.name}", "easy"),
        (rng.choice([f"List the {a.words} of all {t.plural}.", f"What are the {a.words} of the {t.plural}?",
                     f"Show the {a.words} of each {t.singular}."]), f"SELECT {a.name} FROM {t.name}", "easy"),
        (rng.choice([f"What are the distinct {a.words} values of {t.plural}?",
                     f"List the different {a.words} of the {t.plural}."]), f"SELECT DISTINCT {a.name} FROM {t.name}",
         "easy"),
        (f"How many different {a.words} values do the {t.plural} have?",
         f"SELECT count(DISTINCT {a.name}) FROM {t.name}", "easy"),
    ]
    if a.name != b.name:
        out.append((f"Show the {a.words} and {b.words} of all {t.plural}.",
                    f"SELECT {a.name}, {b.name} FROM {t.name}", "medium"))
    return out


def _text_questions(t: Table, cols: list[Column], text: list[Column], rng: random.Random) -> list[Candidate]:
    """Filters on a real value of a text column, and groupings by it."""
    c = rng.choice(text)
    value = rng.choice(c.values)
    other = rng.choice([x for x in cols if x.name != c.name] or [c])
    return [
        (rng.choice([f"How many {t.plural} have {c.words} {value}?",
                     f"Count the {t.plural} whose {c.words} is {value}."]),
         f"SELECT count(*) FROM {t.name} WHERE {c.name} = {quote(value)}", "easy"),
        (rng.choice([f"What is the {other.words} of the {t.singular} whose {c.words} is {value}?",
                     f"Show the {other.words} of {t.plural} with {c.words} {value}."]),
         f"SELECT {other.name} FROM {t.name} WHERE {c.name} = {quote(value)}", "easy"),
        (rng.choice([f"For each {c.words}, how many {t.plural} are there?",
                     f"Show each {c.words} and the number of {t.plural} with it."]),
         f"SELECT {c.name}, count(*) FROM {t.name} GROUP BY {c.name}", "medium"),
        (rng.choice([f"Which {c.words} is the most common among {t.plural}?",
                     f"What is the {c.words} shared by the most {t.plural}?"]),
         f"SELECT {c.name} FROM {t.name} GROUP BY {c.name} ORDER BY count(*) DESC LIMIT 1", "hard"),
        (f"Which {c.words} values are shared by more than one {t.singular}?",
         f"SELECT {c.name} FROM {t.name} GROUP BY {c.name} HAVING count(*) > 1", "easy"),
    ]


def _numeric_questions(t: Table, cols: list[Column], numeric: list[Column], text: list[Column],
                       rng: random.Random) -> list[Candidate]:
    """Aggregates, orderings and comparisons on a numeric column."""
    n = rng.choice(numeric)
    other = rng.choice([x for x in cols if x.name != n.name] or [n])
    agg, word = rng.choice([("avg", "average"), ("max", "maximum"), ("min", "minimum"), ("sum", "total")])
    pivot = rng.choice(n.values)
    out = [
        (rng.choice([f"What is the {word} {n.words} of all {t.plural}?",
                     f"Find the {word} {n.words} of the {t.plural}."]),
         f"SELECT {agg}({n.name}) FROM {t.name}", "easy"),
        (f"What are the maximum and minimum {n.words} of the {t.plural}?",
         f"SELECT max({n.name}), min({n.name}) FROM {t.name}", "medium"),
        (rng.choice([f"List the {other.words} of the {t.plural} sorted by {n.words} in descending order.",
                     f"Show the {other.words} of all {t.plural}, from the highest {n.words} to the lowest."]),
         f"SELECT {other.name} FROM {t.name} ORDER BY {n.name} DESC", "easy"),
        (f"List the {other.words} of the {t.plural} in ascending order of {n.words}.",
         f"SELECT {other.name} FROM {t.name} ORDER BY {n.name} ASC", "easy"),
        (rng.choice([f"What is the {other.words} of the {t.singular} with the highest {n.words}?",
                     f"Which {t.singular} has the largest {n.words}? Give its {other.words}."]),
         f"SELECT {other.name} FROM {t.name} ORDER BY {n.name} DESC LIMIT 1", "medium"),
        (f"What is the {other.words} of the {t.singular} with the lowest {n.words}?",
         f"SELECT {other.name} FROM {t.name} ORDER BY {n.name} ASC LIMIT 1", "medium"),
        (f"Show the {other.words} of {t.plural} whose {n.words} is greater than {pivot}.",
         f"SELECT {other.name} FROM {t.name} WHERE {n.name} > {pivot}", "easy"),
        (f"How many {t.plural} have a {n.words} less than {pivot}?",
         f"SELECT count(*) FROM {t.name} WHERE {n.name} < {pivot}", "easy"),
    ]
    if text:
        c = rng.choice(text)
        out.append((f"What is the {word} {n.words} for each {c.words}?",
                    f"SELECT {c.name}, {agg}({n.name}) FROM {t.name} GROUP BY {c.name}", "medium"))
    return out


def _join_questions(t: Table, cols: list[Column], tables: dict[str, Table], rng: random.Random) -> list[Candidate]:
    """One join along each declared foreign key whose other table is known."""
    out = []
    for here, other_name, there in t.links:
        other = tables.get(other_name)
        if other is None or not there:
            continue
        shown = rng.choice([c for c in other.columns if c.values] or other.columns)
        own = rng.choice(cols)
        out.append((f"Show the {own.words} of each {t.singular} and the {shown.words} of its {other.singular}.",
                    f"SELECT T1.{own.name}, T2.{shown.name} FROM {t.name} AS T1 JOIN {other.name} AS T2 "
                    f"ON T1.{here} = T2.{there}", "medium"))
    return out


def questions_for(table: Table, tables: dict[str, Table], rng: random.Random) -> list[Candidate]:
    """(question, query, hardness) candidates for one table; some templates are skipped when no column fits."""
    cols = [c for c in table.columns if c.values]
    if not cols:
        return []
    text = [c for c in cols if not c.numeric]
    numeric = [c for c in cols if c.numeric]
    out = _listing_questions(table, cols, rng)
    if text:
        out += _text_questions(table, cols, text, rng)
    if numeric:
        out += _numeric_questions(table, cols, numeric, text, rng)
    return out + _join_questions(table, cols, tables, rng)


def keeps(conn: sqlite3.Connection, query: str) -> bool:
    """The query runs, and returns rows unless it counts."""
    try:
        rows = conn.execute(query).fetchmany(1)
    except sqlite3.Error:
        return False
    return bool(rows) and (rows[0][0] is not None or "count(" in query)


def synthesize(db_path: Path, db_id: str, per_db: int, seed: int = 0) -> list[dict]:
    """Up to `per_db` distinct (question, query) rows for one database, spread over its tables."""
    rng = random.Random(f"{seed}:{db_id}")
    with sqlite3.connect(f"file:{db_path}?mode=ro", uri=True) as conn:
        conn.text_factory = lambda raw: raw.decode("utf-8", "replace")
        tables = read_tables(conn)
        by_name = {t.name: t for t in tables}
        rows, seen, stale = [], set(), 0
        checked: dict[str, bool] = {}  # a query drawn again in a later pass is not run again
        while len(rows) < per_db and stale < 20:  # a pass: every table's templates, drawn in random order
            candidates = [c for table in tables for c in questions_for(table, by_name, rng)]
            rng.shuffle(candidates)
            added = 0
            for question, query, hardness in candidates:
                if question in seen or len(rows) >= per_db:
                    continue
                if query not in checked:
                    checked[query] = keeps(conn, query)
                if not checked[query]:
                    continue
                seen.add(question)
                rows.append({"id": f"{ID_PREFIX}{db_id}-{len(rows)}", "db_id": db_id, "question": question,
                             "query": query, "hardness": hardness})
                added += 1
            stale = 0 if added else stale + 1
    return rows
