"""Runner records (tasks, rollout_runs, computed rewards) written through the collector or the file."""
from __future__ import annotations

import pytest

from conftest import post
from lightning_otel.errors import UserError
from lightning_otel.span_store import client


@pytest.mark.parametrize("live", [True, False], ids=["through-collector", "on-file"])
def test_records_are_upserted_and_show_in_the_rollouts_view(live, make_collector, db_path):
    if live:
        make_collector()
    else:
        make_collector().close()
    assert client.write_records(db_path, "tasks", [{"task_id": "t1", "fields": {"question": "q?", "db_id": "x"}}]) == 1
    run = {"rollout_id": "ro-1", "task_id": "t1", "attempt": 0, "status": "failed", "exit_code": 1,
           "started_ns": 10, "ended_ns": 2_000_000_010, "final_output": "SELECT 1"}
    client.write_records(db_path, "rollout_runs", [run])
    client.write_records(db_path, "rollout_runs", [{**run, "status": "ok", "exit_code": 0}])  # replaces
    client.write_records(db_path, "rewards", [{"rollout_id": "ro-1", "name": "spider_exec", "value": 0.0,
                                               "source": "function"}])
    client.write_records(db_path, "rewards", [{"rollout_id": "ro-1", "name": "spider_exec", "value": 1.0,
                                               "source": "function"}])  # recomputed: replaces
    row = client.query("SELECT * FROM rollouts", db_path).to_dicts()[0]
    assert (row["rollout_id"], row["task_id"], row["status"], row["exit_code"], row["duration_s"]) == \
        ("ro-1", "t1", "ok", 0, 2.0)
    assert [(r["name"], r["value"], r["source"]) for r in row["rewards"]] == [("spider_exec", 1.0, "function")]
    fields = client.query("SELECT fields->>'question' AS q FROM tasks", db_path)["q"][0]
    assert fields == "q?"


def test_bad_records_are_refused_with_the_reason(collector, db_path):
    for table, rows, needle in [
        ("spans", [{"x": 1}], "cannot be written"),
        ("tasks", [{"task_id": "t", "fields": "{}", "color": "red"}], "no column"),
        ("rollout_runs", [{"task_id": "t"}], "rollout_id is required"),
        ("rollout_runs", [{"rollout_id": "r", "attempt": "not a number"}], "cannot store"),
        ("tasks", "nope", "list of objects"),
    ]:
        with pytest.raises(UserError, match=needle):
            client.write_records(db_path, table, rows)
    status, _, raw = post(collector.url + "/v1/records", b"[]", "application/json")
    assert status == 400 and b"records body" in raw
    assert client.query("SELECT count(*) AS n FROM rollout_runs", db_path)["n"][0] == 0
