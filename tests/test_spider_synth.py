"""The Spider pack's templated questions (lightning_otel.tasks.spider.synthesis) over real Spider databases,
every query checked there; the held-out split (splits) and schema-linked labels (linking) built on them."""
from __future__ import annotations

import pytest

from lightning_otel.tasks.spider.linking import LINKED_LABEL, linked_schema, with_links
from lightning_otel.tasks.spider.rewards import bundled_data_dir, database_path, spider_exec
from lightning_otel.tasks.spider.splits import HELD_OUT, read_rows, split
from lightning_otel.tasks.spider.synthesis import (ID_PREFIX, by_database, plural_of, round_robin, singular_of,
                                                   synthesize, words_of)
from tests.helpers.examples import example_module


@pytest.mark.parametrize("name,words,singular,plural", [
    ("TV_Channel", "tv channel", "tv channel", "tv channels"),
    ("templateTypeCode", "template type code", "template type code", "template type codes"),
    ("Dogs", "dogs", "dog", "dogs"),
    ("Student_Course", "student course", "student course", "student courses"),
    ("Addresses", "addresses", "address", "addresses"),
    ("city", "city", "city", "cities"),
    ("Highschooler", "highschooler", "highschooler", "highschoolers"),
])
def test_identifiers_read_as_words(name, words, singular, plural):
    assert words_of(name) == words
    assert singular_of(words) == singular and plural_of(singular) == plural


def test_every_row_answers_its_own_question_on_its_database_and_the_set_is_reproducible():
    rows = synthesize(database_path(bundled_data_dir(), "dog_kennels"), "dog_kennels", 60, seed=3)
    assert len(rows) == 60 and len({r["id"] for r in rows}) == 60 and len({r["question"] for r in rows}) == 60
    assert {r["db_id"] for r in rows} == {"dog_kennels"}
    assert {r["hardness"] for r in rows} <= {"easy", "medium", "hard"} and len({r["hardness"] for r in rows}) >= 2
    assert all(spider_exec(r, {"final_output": r["query"]}) == 1.0 for r in rows)
    assert any(" JOIN " in r["query"] for r in rows) and any("GROUP BY" in r["query"] for r in rows)
    assert synthesize(database_path(bundled_data_dir(), "dog_kennels"), "dog_kennels", 60, seed=3) == rows


def test_a_database_without_rows_gives_no_questions():
    assert synthesize(database_path(bundled_data_dir(), "geo"), "geo", 20) == []


def test_lists_interleave_and_rows_spread_over_their_databases():
    assert round_robin([1, 2, 3], ["a"], ["b", "c"]) == [1, "a", "b", 2, "c", 3]
    assert round_robin([], [1]) == [1] and round_robin() == []
    rows = [{"db_id": db, "n": n} for n, db in enumerate(["x", "x", "x", "y", "z", "z"])]
    assert [r["n"] for r in by_database(rows)] == [0, 3, 4, 1, 5, 2]


def test_the_learning_split_keeps_held_out_databases_apart_and_grpo_questions_out_of_the_sft_set(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    files = split(tmp_path / "a", 150, 40, 100, synthetic=20, grpo_synthetic=True)
    plain = split(tmp_path / "b", 150, 40, 100, synthetic=20)
    held, sft, grpo = (read_rows(files[k]) for k in ("eval", "sft", "grpo"))
    assert {r["db_id"] for r in held} == set(HELD_OUT)
    assert not {r["db_id"] for r in sft + grpo} & set(HELD_OUT)
    assert sft == read_rows(plain["sft"])  # drawing GRPO questions further leaves the SFT set as it was
    assert len(grpo) == 40 and all(r["id"].startswith(ID_PREFIX) for r in grpo)
    assert len({r["db_id"] for r in grpo}) == 5 and not {r["question"] for r in grpo} & {r["question"] for r in sft}
    assert all(spider_exec(r, {"final_output": r["query"]}) == 1.0 for r in grpo[:10])
    assert not any(r["id"].startswith(ID_PREFIX) for r in read_rows(plain["grpo"]))


def test_the_sft_set_takes_the_dev_databases_first_and_spreads_a_cut_evenly(tmp_path):
    data = bundled_data_dir()
    dev, train = read_rows(data / "dev.jsonl"), read_rows(data / "train.jsonl")
    trainable = [r for r in dev if r["db_id"] not in HELD_OUT]
    for name, count, expected in [("all", None, trainable + train),
                                  ("cut", 42, trainable[::10][:42]),  # every 10th of the 420 dev questions
                                  ("more", len(trainable) + 5, trainable + train[::210][:5]),
                                  ("none", 0, [])]:  # no SFT set (apo_vs_grpo's Spider task)
        files = split(tmp_path / name, 132, 8, count)
        assert read_rows(files["sft"]) == expected, name
        held = read_rows(files["eval"])
        assert len(held) == 132 and {r["db_id"] for r in held} == set(HELD_OUT)  # every held-out question
        grpo = read_rows(files["grpo"])  # the easy questions first
        assert len(grpo) == 8 and {r["hardness"] for r in grpo} == {"easy"} and grpo[0] in trainable


def test_linked_schema_copies_the_lines_of_the_tables_a_query_names_and_the_agent_still_reads_the_query():
    agent = example_module("sql_agent")
    extract_sql, read_schema = agent.extract_sql, agent.read_schema
    data = bundled_data_dir()
    schema = read_schema(str(database_path(data, "student_transcripts_tracking")))
    lines = dict((line.split("(")[0], line) for line in schema.splitlines())
    query = ("SELECT T1.first_name FROM Students AS T1 JOIN student_enrolment_courses AS T2 "
             "ON T1.student_id = T2.student_enrolment_id WHERE T2.course_id = 'Students'")
    # in the order named; case-insensitive; Student_Enrolment is only a prefix of the table named, not itself named
    assert linked_schema(schema, query) == "\n".join([lines["Students"], lines["Student_Enrolment_Courses"]])
    assert linked_schema(schema, "SELECT 1") == ""
    rows = read_rows(data / "dev.jsonl")[:200]
    for row in with_links(rows, data, read_schema):  # real gold queries: every one names a table of its schema
        assert row["link"] and set(row["link"].splitlines()) <= set(
            read_schema(str(database_path(data, row["db_id"]))).splitlines()), row
        assert extract_sql(LINKED_LABEL.format(**row)) == " ".join(row["query"].split())


def test_the_sql_agent_reads_an_empty_answer_block_as_no_query():
    """An answer of bare fence marks is no query, so the agent's rewrite step keeps the query it had (an untrained
    rewrite call answered "```" and the agent passed that on as its final SQL)."""
    agent = example_module("sql_agent")
    for empty in ("```", "```sql\n```", "``` ```", "```SQLite\n"):
        assert agent.extract_sql(empty) == "", empty
    assert agent.extract_sql("Sure:\n```sql\nSELECT count(*)\nFROM singer\n```") == "SELECT count(*) FROM singer"
    assert agent.extract_sql("```sqlite\nSELECT Name FROM singer\n```") == "SELECT Name FROM singer"
    assert agent.extract_sql("the answer is SELECT 1") == "SELECT 1"
    assert agent.extract_sql("I cannot tell") == "I cannot tell"  # prose stays: the reviewer sees SQLite's error
