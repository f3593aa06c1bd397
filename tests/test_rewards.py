"""Reward functions: spider_exec on the real Spider databases with hand-picked gold/prediction pairs."""
from __future__ import annotations

import hashlib
import json
import time

import pytest

from lightning_otel.errors import UserError
from lightning_otel.rollouts.rewards import call_reward, resolve_reward
from lightning_otel.tasks.spider.rewards import (bundled_data_dir, database_path, final_sql, results_match,
                                                 spider_exec, spider_shaped)

SINGER = {"id": "t1", "db_id": "singer"}


def score(gold: str, predicted: str | None, **task) -> float | None:
    return spider_exec({**SINGER, "query": gold, **task}, {"final_output": predicted})


@pytest.mark.parametrize("gold,predicted,expected", [
    ("SELECT count(*) FROM singer", "SELECT count(*) FROM singer", 1.0),
    ("SELECT count(*) FROM singer", "select COUNT(Singer_ID) from singer;", 1.0),
    ("SELECT count(*) FROM singer", "SELECT count(*) FROM singer WHERE Birth_Year > 1950", 0.0),
    # Columns in another order still match.
    ("SELECT Name, Citizenship FROM singer", "SELECT Citizenship, Name FROM singer", 1.0),
    ("SELECT Name, Citizenship FROM singer", "SELECT Name FROM singer", 0.0),
    ("SELECT Name, Citizenship FROM singer", "SELECT Name, Citizenship, Birth_Year FROM singer", 0.0),
    # Row order matters only when the gold query has ORDER BY.
    ("SELECT Name FROM singer ORDER BY Net_Worth_Millions ASC",
     "SELECT Name FROM singer ORDER BY Net_Worth_Millions DESC", 0.0),
    ("SELECT Name FROM singer ORDER BY Net_Worth_Millions ASC",
     "SELECT Name FROM singer ORDER BY Net_Worth_Millions", 1.0),
    ("SELECT Name FROM singer", "SELECT Name FROM singer ORDER BY Name DESC", 1.0),
    # Duplicates count: a multiset, not a set.
    ("SELECT Citizenship FROM singer", "SELECT DISTINCT Citizenship FROM singer", 0.0),
    # Errors, writes and several statements score 0.
    ("SELECT count(*) FROM singer", "SELECT nope FROM singer", 0.0),
    ("SELECT count(*) FROM singer", "DELETE FROM singer", 0.0),
    ("SELECT count(*) FROM singer", "SELECT count(*) FROM singer; DROP TABLE singer", 0.0),
    ("SELECT count(*) FROM singer", "The answer is six singers.", 0.0),
    ("SELECT count(*) FROM singer", "", 0.0),
    ("SELECT count(*) FROM singer", None, 0.0),
    # A one-line fenced answer is unwrapped.
    ("SELECT count(*) FROM singer", "```sql SELECT count(*) FROM singer```", 1.0),
    # The first fenced block is read wherever it starts: after prose or the schema lines a linked answer copies.
    ("SELECT count(*) FROM singer", "singer(Singer_ID, Name)\n```sql\nSELECT count(*) FROM singer\n```", 1.0),
    ("SELECT count(*) FROM singer",
     "Here it is:\n```SQLite\nSELECT count(*) FROM singer;\n```\n```sql\nSELECT 1\n```", 1.0),
    # cut off at max_tokens
    ("SELECT count(*) FROM singer", "singer(Singer_ID)\n```sql\nSELECT count(*) FROM singer", 1.0),
    ("SELECT count(*) FROM singer", "Counting:\n```sql\nSELECT count(*) FROM singer WHERE Age > 40\n```", 0.0),
])
def test_spider_exec_pairs(gold, predicted, expected):
    assert score(gold, predicted) == expected


@pytest.mark.parametrize("predicted,expected", [
    ("SELECT count(*) FROM singer", 1.0),
    ("```sql SELECT count(*) FROM singer```", 1.0),
    ("SELECT count(*) FROM singer WHERE Birth_Year > 1950", 0.5),  # executes, another result
    ("SELECT Name FROM singer", 0.5),
    ("SELECT nope FROM singer", 0.25),  # valid SQL, a column the schema lacks
    ("SELECT count(*) FROM singers", 0.25),  # a table it lacks
    ("SELECT Singer_ID FROM singer JOIN song ON singer.Singer_ID = song.Singer_ID", 0.25),  # ambiguous name
    ("SELEC count(*) FROM singer", 0.1),  # a syntax error
    ("DELETE FROM singer", 0.1),  # a write: refused by the read-only connection
    ("SELECT 1; SELECT 2", 0.1),
    ("The answer is six singers.", 0.1),  # prose is offered to SQLite as SQL, and refused
    ("", 0.0),
    (None, 0.0),
])
def test_spider_shaped_gives_partial_credit_by_how_far_the_sql_got(predicted, expected):
    task = {**SINGER, "query": "SELECT count(*) FROM singer"}
    assert spider_shaped(task, {"final_output": predicted}) == expected
    assert spider_exec(task, {"final_output": predicted}) == float(expected == 1.0)
    assert resolve_reward("spider_shaped") is spider_shaped


def test_spider_shaped_has_nothing_to_score_without_gold_or_database():
    assert spider_shaped({"id": "t", "db_id": "singer"}, {"final_output": "SELECT 1"}) is None
    with pytest.raises(UserError, match="does not exist; check --data-dir"):
        spider_shaped({"id": "t", "db_id": "nope", "query": "SELECT 1"}, {"final_output": "SELECT 1"})


def tool_span(start_ns: int, name: str, arguments) -> dict:
    """A tool span as the GenAI instrumentations record it (trace_view reads the other conventions too)."""
    return {"name": f"execute_tool {name}", "operation_name": "execute_tool", "start_ns": start_ns,
            "attributes": json.dumps({"gen_ai.tool.name": name, "gen_ai.tool.call.arguments": json.dumps(arguments)})}


@pytest.mark.parametrize("final_output,spans,expected", [
    # prose at the end: the last SQL the agent ran through a tool is scored
    ("There are 6 singers.", [tool_span(1, "sql_db_query", {"query": "SELECT count(*) FROM singer"})], 1.0),
    (None, [tool_span(1, "run", {"sql": "SELECT Name FROM singer"})], 0.5),
    ("", [tool_span(2, "sql_db_query", {"query": "SELECT count(*) FROM singer"}),
          tool_span(1, "sql_db_query", {"query": "SELECT nope FROM singer"})], 1.0),  # time order, not list order
    ("Done.", [tool_span(1, "sql_db_query", {"query": "SELECT count(*) FROM singer"}),
               tool_span(2, "sql_db_query", {"query": "SELECT nope FROM singer"})], 0.25),  # the last one counts
    # a call without SQL (the schema lookup) is passed over; any text argument that is a query counts
    ("6", [tool_span(1, "execute", {"statement": "SELECT count(*) FROM singer", "limit": 5}),
           tool_span(2, "sql_db_schema", {"table_names": "singer"})], 1.0),
    ("6", [tool_span(1, "sql_db_schema", {"table_names": "singer"})], 0.1),  # no SQL ran: the prose is scored
    # a query in the final output wins over the tools'
    ("SELECT Name FROM singer", [tool_span(1, "sql_db_query", {"query": "SELECT count(*) FROM singer"})], 0.5),
    ("```sql\nSELECT count(*) FROM singer\n```", [tool_span(1, "q", {"query": "SELECT 1"})], 1.0),
    ("", [], 0.0),
])
def test_spider_scores_the_last_sql_a_tool_ran_when_the_answer_holds_none(final_output, spans, expected):
    task = {**SINGER, "query": "SELECT count(*) FROM singer"}
    rollout = {"final_output": final_output, "spans": spans}
    assert spider_shaped(task, rollout) == expected
    assert spider_exec(task, rollout) == float(expected == 1.0)


def test_final_sql_reads_tool_arguments_in_each_form():
    langchain = {"name": "execute_tool sql_db_query", "start_ns": 1, "attributes": {
        "traceloop.span.kind": "tool", "gen_ai.tool.call.arguments": json.dumps(
            {"input_str": "{'query': 'SELECT 1'}", "inputs": {"query": "SELECT 1"}, "kwargs": {"tool_call_id": "a"}})}}
    text = tool_span(1, "sql", "```sql\nSELECT 2\n```")  # arguments that are no JSON object: the text itself
    assert final_sql({"final_output": "ok", "spans": [langchain]}) == "SELECT 1"
    assert final_sql({"final_output": "ok", "spans": [text]}) == "SELECT 2"
    assert final_sql({"final_output": "ok", "spans": [tool_span(1, "search", {"q": "singers"})]}) == "ok"
    assert final_sql({"final_output": None}) is None


def test_the_database_is_never_changed():
    db = database_path(bundled_data_dir(), "singer")
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    assert score("SELECT count(*) FROM singer", "DELETE FROM singer") == 0.0
    assert score("SELECT count(*) FROM singer", "UPDATE singer SET Name = 'x'") == 0.0
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before


def test_a_runaway_prediction_times_out_with_zero():
    runaway = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"
    started = time.monotonic()
    value = spider_exec({**SINGER, "query": "SELECT count(*) FROM singer"}, {"final_output": runaway},
                        timeout_s=0.5)
    assert value == 0.0 and time.monotonic() - started < 5


def test_no_gold_means_no_reward_and_a_missing_database_is_an_error(tmp_path):
    assert spider_exec({"id": "x", "question": "q"}, {"final_output": "SELECT 1"}) is None
    with pytest.raises(UserError, match="does not exist"):
        spider_exec({**SINGER, "query": "SELECT 1"}, {"final_output": "SELECT 1", "data_dir": str(tmp_path)})


def test_results_match_on_hand_made_tables():
    assert results_match([(1, "a"), (2, "b")], [("b", 2), ("a", 1)], ordered=False)
    assert not results_match([(1, "a"), (2, "b")], [("b", 2), ("a", 1)], ordered=True)
    assert results_match([(1, "a"), (2, "b")], [("a", 1), ("b", 2)], ordered=True)
    # Two columns with equal values: either mapping must be tried.
    assert results_match([(1, 1, "x"), (2, 2, "y")], [("x", 1, 1), ("y", 2, 2)], ordered=False)
    assert not results_match([(1, 2)], [(1, 2), (1, 2)], ordered=False)
    assert results_match([], [], ordered=False)
    assert results_match([(6,)], [(6.0,)], ordered=False)


def test_every_bundled_gold_query_matches_itself():
    import json
    rows = [json.loads(line) for line in (bundled_data_dir() / "dev.jsonl").read_text().splitlines()[:60]]
    assert all(spider_exec(row, {"final_output": row["query"]}) == 1.0 for row in rows)


def test_resolving_reward_functions(tmp_path, monkeypatch):
    assert resolve_reward("spider_exec") is spider_exec
    (tmp_path / "my_rewards.py").write_text("def length(task, rollout):\n    return len(rollout['final_output'])\n"
                                            "def bad(task, rollout):\n    return 'yes'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = resolve_reward("my_rewards:length")
    assert call_reward(fn, {}, {"final_output": "abc"}) == 3.0
    with pytest.raises(UserError, match="finite number or None"):
        call_reward(resolve_reward("my_rewards:bad"), {}, {})
    for spec, needle in [("nope", "unknown reward"), ("no_such_module:f", "cannot import"),
                         ("my_rewards:missing", "no function")]:
        with pytest.raises(UserError, match=needle):
            resolve_reward(spec)


def test_a_reward_in_a_file_imports_with_its_folder_on_the_path(tmp_path):
    folder = tmp_path / "task_rewards"
    folder.mkdir()
    (folder / "helpers.py").write_text("def words(text):\n    return len(text.split())\n")
    (folder / "score.py").write_text("from helpers import words\nLIMIT = 3\n\ndef brevity(task, rollout):\n"
                                     "    return 1.0 / (1 + words(rollout['final_output']))\n")
    fn = resolve_reward(f"{folder / 'score.py'}:brevity")
    assert call_reward(fn, {}, {"final_output": "one two three"}) == 0.25
    for spec, needle in [(f"{folder / 'absent.py'}:f", "reward .* does not exist"),
                         (f"{folder / 'score.py'}:missing", "reward .* no function 'missing'"),
                         (f"{folder / 'score.py'}:LIMIT",
                          r"not a function; give a function called as fn\(task, rollout\)")]:
        with pytest.raises(UserError, match=needle):
            resolve_reward(spec)


def test_number_match_reads_the_last_number_of_the_final_output():
    from lightning_otel.tasks.math import last_number, number_match

    assert [last_number(t) for t in ("It is 1,234.", "-5.5 then 7", "x", "", None, "3,39")] == \
        [1234.0, 7.0, None, None, None, 39.0]
    assert number_match({"answer": 64}, {"final_output": "There are 64 passengers."}) == 1.0
    assert number_match({"answer": "1,234"}, {"final_output": "1234"}) == 1.0
    assert number_match({"answer": 64}, {"final_output": "64 or 63"}) == 0.0
    assert number_match({"answer": 64}, {"final_output": None}) == 0.0
    assert number_match({}, {"final_output": "64"}) is None and number_match({"answer": "many"}, {}) is None
