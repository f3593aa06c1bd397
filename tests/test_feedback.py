"""Human feedback as rewards (`lightning-otel feedback`, POST /v1/feedback): a person's score is stored as a reward
row with its author and comment, only with the admin token, and the next compile trains on it."""
from __future__ import annotations

import math

import orjson
import polars as pl
import pytest

from lightning_otel.cli import main
from lightning_otel.span_store import client
from lightning_otel.train.transitions.compile import CompileConfig, compile_transitions
from lightning_otel.train.transitions.credit import EPS
from tests.conftest import post
from tests.helpers.rollout_store import store_rollouts

TOKENS = {"ingest_token": "in-token", "query_token": "query-token", "admin_token": "admin-token"}
SQL_ADVANTAGES = "SELECT DISTINCT rollout_id, advantage FROM transitions WHERE reward_name = 'exec'"


def advantages(db) -> dict[str, float]:
    """Per rollout, from the transitions view and from the compiler as `train --offline` runs it; they agree."""
    view = dict(client.query(SQL_ADVANTAGES, db).iter_rows())
    out, _ = compile_transitions(CompileConfig(db=db, reward="exec", emitted_rewards=False))
    compiled = dict(out.group_by("rollout_id").agg(pl.col("advantage").first()).iter_rows())
    assert compiled == pytest.approx(view)
    return view


def test_a_human_score_changes_the_advantage_in_the_next_compile(collector, db_path, capsys):
    store_rollouts(collector.url, db_path, {"r1": ("t1", 1.0, 1), "r2": ("t1", 0.0, 2), "r3": ("t1", 0.0, 1)})
    third = (1 / 3) / (math.sqrt(1 / 3) + EPS)  # rewards 1 0 0, then 1 0 1: sample std sqrt(1/3) both times
    assert advantages(db_path) == pytest.approx({"r1": 2 * third, "r2": -third, "r3": -third})

    # A reviewer finds r3's answer right after all: through the running collector, with its admin token.
    assert main(["feedback", "--db", str(db_path), "--rollout", "r3", "--name", "exec", "--value", "1",
                 "--comment", "the join is right; the checker's gold query is wrong", "--author", "ana"]) == 0
    assert "stored exec = 1 for rollout r3 by ana" in capsys.readouterr().out
    assert advantages(db_path) == pytest.approx({"r1": third, "r2": -2 * third, "r3": third})
    # The reward function runs again: the person's correction still stands over what it computes.
    client.write_records(db_path, "rewards", [{"rollout_id": "r3", "name": "exec", "value": 0.0, "source": "function"}])
    assert advantages(db_path)["r3"] == pytest.approx(third)
    stored = client.query("SELECT rollout_id, span_id, name, value, source, author, comment FROM rewards "
                          "WHERE source = 'human'", db_path).to_dicts()
    assert stored == [{"rollout_id": "r3", "span_id": None, "name": "exec", "value": 1.0, "source": "human",
                       "author": "ana", "comment": "the join is right; the checker's gold query is wrong"}]

    # With no collector on the file, the score goes into it directly; a new name is a reward of its own.
    collector.close()
    assert main(["feedback", "--db", str(db_path), "--rollout", "r2", "--name", "helpful", "--value", "0.5"]) == 0
    assert client.query("SELECT count(*) AS n FROM episode_rewards WHERE reward_name = 'helpful'", db_path)["n"][0] == 1
    assert main(["feedback", "--db", str(db_path), "--rollout", "r2", "--name", "helpful", "--value", "good"]) == 2
    assert "feedback value 'good' is not a number" in capsys.readouterr().err


def send(url: str, body, token: str | None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    status, _, answer = post(url + "/v1/feedback", raw, "application/json", headers)
    return status, answer.decode()


def test_only_the_admin_token_may_score_and_bad_scores_write_nothing(make_collector, db_path):
    collector = make_collector(**TOKENS)
    store_rollouts(collector.url, db_path, {"r1": ("t1", 1.0, 1), "r2": ("t1", 0.0, 1)}, token=TOKENS["ingest_token"])
    calls = client.query("SELECT rollout_id, span_id FROM llm_calls ORDER BY rollout_id", db_path)
    r1_call, r2_call = calls["span_id"].to_list()
    good = {"rollout_id": "r1", "name": "tone", "value": 0.25}
    assert send(collector.url, good, None)[0] == 401
    for role in ("ingest_token", "query_token"):
        status, message = send(collector.url, good, TOKENS[role])
        assert status == 403 and "needs the admin token" in message, message

    before = client.query("SELECT count(*) AS n FROM rewards", db_path)["n"][0]
    admin = TOKENS["admin_token"]
    for body, message in [
        ({**good, "rollout_id": "r9"}, "no rollout 'r9' in this store"),
        ({**good, "value": "abc"}, "feedback value 'abc' is not a number"),
        ({**good, "value": True}, "is not a number"),
        ({**good, "value": "nan"}, "must be a finite number"),
        ({**good, "name": " "}, "feedback needs a name"),
        ({"rollout_id": "r1", "value": 1}, "feedback needs name"),
        ({**good, "span_id": r2_call}, f"span {r2_call} is not a span of rollout 'r1' (it belongs to r2)"),
        ({**good, "span_id": "0123456789abcdef"}, "(no such span)"),
        ({**good, "span_id": "xyz"}, "is not a span id (16 hex digits"),
        ({**good, "score": 1}, "feedback has no field(s) ['score']"),
        ([good], "feedback body must be a JSON object"),
        (b"{not json", "feedback body must be JSON"),
    ]:
        status, answer = send(collector.url, body, admin)
        assert status == 400 and message in orjson.loads(answer)["message"], (body, answer)
    assert client.query("SELECT count(*) AS n FROM rewards", db_path)["n"][0] == before  # nothing half-written

    status, answer = send(collector.url, {**good, "span_id": r1_call.upper(), "value": "0.75", "comment": "curt",
                                          "author": "bo"}, admin)
    assert status == 200, answer
    row = orjson.loads(answer)
    assert row["span_id"] == r1_call and row["trace_id"] and row["value"] == 0.75 and row["source"] == "human"
    stored = client.query("SELECT trace_id, span_id, name, value, author, comment FROM rewards WHERE source = 'human'",
                          db_path).to_dicts()
    assert stored == [{"trace_id": row["trace_id"], "span_id": r1_call, "name": "tone", "value": 0.75,
                       "author": "bo", "comment": "curt"}]
    # A score on an inner span is no episode reward: the compiler credits it with --intermediate tone.
    assert client.query("SELECT count(*) AS n FROM episode_rewards WHERE reward_name = 'tone'", db_path)["n"][0] == 0
    out, _ = compile_transitions(CompileConfig(db=db_path, reward="exec", intermediate=["tone"]))
    assert out.filter(pl.col("rollout_id") == "r1")["return"].to_list() == pytest.approx([1.75])
