"""The Spider pack's renamed databases (lightning_otel.tasks.spider.renaming): real Spider databases copied under
other table and column names, and labelled questions moved onto the copies with their gold queries rewritten."""
from __future__ import annotations

import json
import random
import sqlite3
from collections import Counter
from contextlib import closing

import pytest

from lightning_otel.tasks.spider.renaming import (KEYWORDS, SUFFIX, rename_database, renamed_tasks, renaming,
                                                  with_renamed)
from lightning_otel.tasks.spider.repair import schema_names
from lightning_otel.tasks.spider.rewards import bundled_data_dir, database_path, run_query, spider_exec
from tests.helpers.examples import example_module

read_schema = example_module("sql_agent").read_schema  # the LangGraph example's schema text, as its prompt shows it


def rows_of(*databases: str) -> list[dict]:
    rows = [json.loads(line) for line in (bundled_data_dir() / "dev.jsonl").read_text().splitlines()]
    return [r for r in rows if r["db_id"] in databases]


@pytest.fixture(scope="module")
def renamed(tmp_path_factory):
    out = tmp_path_factory.mktemp("renamed")
    rows = rows_of("dog_kennels", "world_1", "network_1")
    return rows, out, renamed_tasks(rows, bundled_data_dir(), out, count=90)


def test_every_bare_name_gets_one_new_distinct_spelling():
    db = database_path(bundled_data_dir(), "world_1")
    mapping = renaming(db, random.Random(0))
    tables, columns = schema_names(db)
    old = {n.lower() for n in tables + columns}
    assert set(mapping) == old  # world_1's names are all bare identifiers and all found a spelling
    new = [n.lower() for n in mapping.values()]
    assert len(set(new)) == len(new) and not set(new) & old and not set(new) & KEYWORDS
    assert all(n.replace("_", "").isalnum() for n in new)


def test_the_copy_has_the_new_names_and_the_same_rows(tmp_path):
    source = database_path(bundled_data_dir(), "dog_kennels")
    mapping = renaming(source, random.Random(1))
    target = tmp_path / "copy.sqlite"
    done = rename_database(source, target, mapping)
    assert done == mapping
    tables, columns = schema_names(target)
    assert {n.lower() for n in tables + columns} == {n.lower() for n in mapping.values()}
    for table in schema_names(source)[0]:
        count = run_query(source, f'SELECT count(*) FROM "{table}"', 5)
        assert run_query(target, f'SELECT count(*) FROM "{mapping[table.lower()]}"', 5) == count
    # The agent's prompt shows the new names only.
    lines = [line.rstrip(")").split("(") for line in read_schema(str(target)).splitlines()]
    assert {table for table, _ in lines} == {mapping[t.lower()] for t in schema_names(source)[0]}
    assert {c for _, cols in lines for c in cols.split(", ")} == {mapping[c.lower()] for c in schema_names(source)[1]}


def test_renamed_questions_answer_the_same_on_the_copy_and_the_old_names_are_gone(renamed):
    rows, out, made = renamed
    assert len(made) == 90
    originals = {r["id"]: r for r in rows}
    for row in made:
        gold = originals[row["id"].removesuffix("-renamed")]
        assert row["db_id"] == gold["db_id"] + SUFFIX and row["question"] == gold["question"]
        copy = database_path(out, row["db_id"])
        assert run_query(copy, row["query"], 5) == run_query(database_path(out, gold["db_id"]), gold["query"], 5)
        with pytest.raises(sqlite3.OperationalError, match="no such (table|column)"):
            run_query(copy, gold["query"], 5)
        # The project's reward, given the run's data folder, scores the rewritten gold query right.
        rollout = {"final_output": row["query"], "data_dir": str(out), "status": "ok"}
        assert spider_exec(row, rollout) == 1.0


def test_the_data_folder_holds_every_bundled_database_and_the_copies_spread_evenly(renamed):
    _, out, made = renamed
    bundled = {p.name for p in (bundled_data_dir() / "database").iterdir()}
    held = {p.name for p in (out / "database").iterdir()}
    assert held == bundled | {f"{db}{SUFFIX}" for db in ("dog_kennels", "world_1", "network_1")}
    assert set(Counter(r["db_id"] for r in made).values()) == {30}


def test_a_database_sqlite_cannot_rename_gives_no_questions_and_no_error(tmp_path):
    source = tmp_path / "src"
    db = database_path(source, "broken")
    db.parent.mkdir(parents=True)
    with closing(sqlite3.connect(db)) as conn:
        conn.execute("CREATE TABLE pets (pet_id INTEGER, name TEXT)")
        conn.execute("INSERT INTO pets VALUES (1, 'Rex')")
        conn.execute("CREATE VIEW v AS SELECT x FROM missing")  # any ALTER TABLE now fails on this view
        conn.commit()
    row = {"id": "q1", "db_id": "broken", "question": "Names of pets?", "query": "SELECT name FROM pets"}
    assert renamed_tasks([row], source, tmp_path / "out", count=5) == []
    assert run_query(database_path(tmp_path / "out", "broken" + SUFFIX), "SELECT name FROM pets", 5) == [("Rex",)]
    # Writing into the source folder would replace its databases: refused before anything is touched.
    with pytest.raises(ValueError, match="is the source data folder"):
        renamed_tasks([row], source, source / ".", count=5)
    assert database_path(source, "broken").is_file()


def test_the_sft_mix_takes_renamed_questions_in_turn_with_the_originals(tmp_path):
    rows = rows_of("network_1")[:6]
    mixed = with_renamed(rows, bundled_data_dir(), tmp_path / "data", count=3)
    assert database_path(tmp_path / "data", "network_1" + SUFFIX).is_file()
    assert [r["id"] for r in mixed] == [x for r in rows[:3] for x in (r["id"], r["id"] + "-renamed")] + \
        [r["id"] for r in rows[3:]]


def test_a_second_renaming_is_written_beside_the_first_under_other_names(tmp_path):
    # benchmarks.learning.spider_agent --renamed and --grpo-renamed: the SFT copies and the GRPO questions' own
    # copies in one folder.
    rows = rows_of("network_1")
    first = renamed_tasks(rows, bundled_data_dir(), tmp_path, count=10)
    second = renamed_tasks(rows, bundled_data_dir(), tmp_path, count=10, seed=1, suffix="_grpo")
    assert first and second
    assert {r["db_id"] for r in second} == {"network_1_grpo"} and all(r["id"].endswith("-grpo") for r in second)
    one, two = (database_path(tmp_path, "network_1" + s) for s in (SUFFIX, "_grpo"))
    assert one.is_file() and two.is_file()  # the second call left the first copy in place
    names_one, names_two = ({n.lower() for n in sum(schema_names(db), [])} for db in (one, two))
    original = {n.lower() for n in sum(schema_names(database_path(bundled_data_dir(), "network_1")), [])}
    assert names_two != names_one and not names_two & original
    gold = {r["id"]: r["query"] for r in rows}
    source = database_path(bundled_data_dir(), "network_1")
    for row in first + second:  # each set's queries answer on its own copy as the gold query does on the original
        original_id = row["id"].rsplit("-", 1)[0]
        assert run_query(database_path(tmp_path, row["db_id"]), row["query"], 5) == run_query(source,
                                                                                              gold[original_id], 5)
