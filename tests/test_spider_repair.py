"""The Spider pack's repair paths (lightning_otel.tasks.spider.repair): wrong first queries made from gold ones on
real Spider databases, and the labelled repair path they start, walked by the real LangGraph agent through the
gateway."""
from __future__ import annotations

import json
import random
import sqlite3
import sys
from collections import Counter
from contextlib import closing
from pathlib import Path

from lightning_otel.tasks.spider.repair import (REPAIR_LABELS, REPAIR_UNTRAINED, corrupt, name_variants, repair_tasks,
                                                replace_word, schema_names)
from lightning_otel.tasks.spider.rewards import bundled_data_dir, database_path, spider_exec


def rows_of(*databases: str) -> list[dict]:
    rows = [json.loads(line) for line in (bundled_data_dir() / "dev.jsonl").read_text().splitlines()]
    return [r for r in rows if r["db_id"] in databases]


def test_names_vary_the_way_a_small_model_misreads_them():
    assert name_variants("TV_Channel") == ["TV_Channels", "TVChannel", "Channel", "T_Channel"]
    assert name_variants("Dogs") == ["Dog"]
    assert name_variants("poker_player")[-1] == "p_player"


def test_only_bare_identifiers_are_replaced_never_quoted_text():
    query = "SELECT name FROM singer WHERE name = 'name' AND \"name\" != Name_2 AND T1.NAME > 1"
    assert replace_word(query, "Name", "title") == \
        "SELECT title FROM singer WHERE title = 'name' AND \"name\" != Name_2 AND T1.title > 1"


def test_a_corrupted_query_fails_for_a_missing_name_and_its_gold_query_still_answers():
    rng = random.Random(0)
    rows = rows_of("dog_kennels", "world_1")
    data = bundled_data_dir()
    made = 0
    names = {db_id: schema_names(database_path(data, db_id)) for db_id in ("dog_kennels", "world_1")}
    for row in rows[:40]:
        db = database_path(data, row["db_id"])
        result = corrupt(db, names[row["db_id"]], row["query"], rng)
        if result is None:
            continue
        wrong, error = result
        made += 1
        assert wrong != row["query"] and error.startswith(("no such table", "no such column"))
        with closing(sqlite3.connect(db)) as conn:
            try:
                conn.execute(wrong)
                raise AssertionError(f"{wrong} runs")
            except sqlite3.OperationalError as exc:
                assert str(exc) == error
    assert made >= 30  # nearly every gold query names something that can be misnamed


def test_repair_tasks_take_each_database_in_turn_and_their_labels_fill_from_the_fields():
    rows = rows_of("dog_kennels", "world_1", "network_1")
    data = bundled_data_dir()
    tasks = repair_tasks(rows, lambda db_id: database_path(data, db_id), 30, seed=1)
    assert len(tasks) == 30 and Counter(t["db_id"] for t in tasks) == {"dog_kennels": 10, "world_1": 10,
                                                                      "network_1": 10}
    assert len({t["id"] for t in tasks}) == 30 and all(t["id"].endswith("-repair") for t in tasks)
    for task in tasks:
        assert spider_exec(task, {"final_output": task["query"]}) == 1.0
        assert spider_exec(task, {"final_output": task["wrong_query"]}) == 0.0
        assert task["review"].startswith("The query fails: no such ")
        answers = [label.format(**task) for label in REPAIR_LABELS]
        assert task["wrong_query"] in answers[0] and task["query"] in answers[2]
    assert repair_tasks(rows, lambda db_id: database_path(data, db_id), 30, seed=1) == tasks


def test_the_langgraph_agent_walks_the_repair_path_and_only_the_repair_is_trained(engine, db_path, tmp_path):
    from transformers import AutoTokenizer

    from lightning_otel.rollouts.runner import RolloutConfig, load_tasks, run_rollouts
    from lightning_otel.train.sft import call_prompts, demonstration_rows

    data = bundled_data_dir()
    made = repair_tasks(rows_of("world_1"), lambda db_id: database_path(data, db_id), 2, seed=2)
    tasks = tmp_path / "repair.jsonl"
    tasks.write_text("".join(json.dumps(t) + "\n" for t in made))
    agent = Path(__file__).resolve().parent.parent / "examples" / "sql_agent" / "agent.py"
    summary = run_rollouts(RolloutConfig(
        tasks=tasks, agent=f"{sys.executable} {agent} --question {{question}} --db {{db_path}}", n=1, concurrency=2,
        db=db_path, reward="spider_exec", rollout_timeout_s=120, answers=REPAIR_LABELS), engine=engine)
    assert [r.status for r in summary.results] == ["ok", "ok"]
    assert [r.reward for r in summary.results] == [1.0, 1.0]  # reviewed, rewritten to the gold query, accepted
    prompts = call_prompts(db_path, [r.rollout_id for r in summary.results])
    assert sorted(len(p) for p in prompts.values()) == [4, 4]
    tokenizer = AutoTokenizer.from_pretrained(engine.config.model_dir)
    by_id = {t.task_id: t for t in load_tasks(tasks)}
    walked = {r.task_id: r.rollout_id for r in summary.results}
    rows, short = demonstration_rows(walked, by_id, REPAIR_LABELS, prompts, tokenizer, REPAIR_UNTRAINED)
    assert short == 0 and [r["turn"] for r in rows] == [1, 2, 3, 1, 2, 3]
    for result, review, rewrite in zip(summary.results, rows[::3], rows[1::3]):
        task = by_id[result.task_id].fields
        assert tokenizer.decode(review["completion_ids"], skip_special_tokens=True) == task["review"]
        seen = tokenizer.decode(rewrite["prompt_ids"])  # the rewrite step sees the wrong query, error, review
        assert " ".join(task["wrong_query"].split()) in seen  # the agent reads the query on one line
        assert task["review"] in seen and "OperationalError" in seen
        assert tokenizer.decode(rewrite["completion_ids"], skip_special_tokens=True) == f"```sql\n{task['query']}\n```"
