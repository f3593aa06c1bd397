"""`lightning-otel export --otlp URL --where SQL`: stored rollouts replayed over OTLP/HTTP to another endpoint,
with reward, advantage and policy version added. The endpoints are real: a second collector on its own DuckDB file
(its store must then hold the same spans), small HTTP servers that fail the way endpoints do, and a real Phoenix."""
from __future__ import annotations


import orjson
import pytest

from lightning_otel.cli import main
from lightning_otel.errors import UserError
from lightning_otel.span_store import client
from lightning_otel.span_store.otlp_encode import SPAN_COLUMNS
from lightning_otel.span_store.replay import ReplayConfig, replay
from lightning_otel.span_store.tour import sample_requests
from tests.conftest import post
from tests.helpers.loopback import LoopbackServer, QuietHandler
from tests.helpers.rollout_store import store_rollouts
from tests.helpers.phoenix import running_phoenix, wait_for

ADDED = ("lightning.reward", "lightning.advantage", "lightning.policy.version")
# A request with the values the SDK never makes: a key-value list, bytes, an empty value, a double that is whole,
# a 64-bit integer, nested arrays; and a span with a link and an unknown kind.
EDGE_BODY = orjson.dumps({"resourceSpans": [{
    "resource": {"attributes": [{"key": "lightning.rollout.id", "value": {"stringValue": "ro-edge"}},
                                {"key": "lightning.task.id", "value": {"stringValue": "t-edge"}}]},
    "scopeSpans": [{"scope": {"name": "hand-made"}, "spans": [{
        "traceId": "5b8efff798038103d269b633813fc60c", "spanId": "eee19b7ec3c1b174", "name": "edge",
        "kind": 3, "startTimeUnixNano": "1700000000000000000", "endTimeUnixNano": "1700000000500000000",
        "traceState": "rojo=00f067aa0ba902b7", "flags": 257,
        "attributes": [
            {"key": "kv", "value": {"kvlistValue": {"values": [
                {"key": "a", "value": {"intValue": "9007199254740993"}},
                {"key": "b", "value": {"arrayValue": {"values": [{"doubleValue": 2.0}, {"boolValue": True},
                                                                 {"arrayValue": {"values": []}}]}}}]}}},
            {"key": "raw", "value": {"bytesValue": "AAEC/w=="}},
            {"key": "nothing", "value": {}},
            {"key": "whole", "value": {"doubleValue": 3.0}},
            {"key": "tiny", "value": {"doubleValue": 1e-300}}],
        "events": [{"timeUnixNano": "1700000000100000000", "name": "e",
                    "attributes": [{"key": "k", "value": {"kvlistValue": {"values": []}}}]}],
        "links": [{"traceId": "0af7651916cd43dd8448eb211c80319c", "spanId": "b7ad6b7169203331",
                   "traceState": "a=b"}],
        "status": {"code": 2, "message": "boom"}}]}]}]})
ROLLOUTS = {"r1": ("t1", 1.0, 2), "r2": ("t1", 0.0, 1), "r3": ("t2", 0.5, 1)}


def spans_of(db, where: str = "true") -> dict[tuple[str, str], dict]:
    frame = client.query(f"SELECT {', '.join(SPAN_COLUMNS)}, rollout_id FROM spans WHERE {where}", db)
    out = {}
    for row in frame.to_dicts():
        for key in ("attributes", "resource", "events", "links"):
            row[key] = orjson.loads(row[key]) if row[key] is not None else None
        out[(row["trace_id"], row["span_id"])] = row
    return out


def added(row: dict) -> dict:
    return {k: v for k, v in row["attributes"].items() if k.startswith(ADDED)}


@pytest.fixture
def first(make_collector, tmp_path):
    """A store of the recorded traces of real agents, a hand-made edge case and scored rollouts."""
    collector = make_collector(db=tmp_path / "first.duckdb")
    for path, body in sample_requests():
        assert post(collector.url + path, body, "application/json")[0] == 200
    assert post(collector.url + "/v1/traces", EDGE_BODY, "application/json")[0] == 200
    store_rollouts(collector.url, collector.db, ROLLOUTS)
    client.write_records(collector.db, "rewards", [{"rollout_id": "r1", "name": "judge", "value": 0.25,
                                                    "source": "function"}])
    return collector


def test_replayed_rollouts_land_whole_in_a_second_collector(first, make_collector, tmp_path):
    second = make_collector(db=tmp_path / "second.duckdb")
    report = replay(ReplayConfig(db=first.db, url=second.url, reward="exec", batch_spans=5))
    mine, theirs = spans_of(first.db, "rollout_id IS NOT NULL"), spans_of(second.db)
    assert report.spans == len(mine) == len(theirs) == 24 + 1 + 15 and report.rejected_spans == 0
    assert report.rollouts == 10 and report.requests >= len(mine) / 5
    assert mine.keys() == theirs.keys()
    labels = {}
    for key, row in mine.items():
        copy = dict(theirs[key])
        labels[key] = {k: v for k, v in copy["attributes"].items() if k not in row["attributes"]}
        copy["attributes"] = {k: v for k, v in copy["attributes"].items() if k in row["attributes"]}
        assert copy == row, key  # the span's own attributes, in their order, with their values
        assert all(k.startswith(ADDED) for k in labels[key]), labels[key]

    edge = theirs[("5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b174")]
    assert edge["attributes"] == {"kv": {"a": 9007199254740993, "b": [2.0, True, []]}, "raw": "AAEC/w==",
                                  "nothing": None, "whole": 3.0, "tiny": 1e-300}
    assert isinstance(edge["attributes"]["whole"], float) and edge["kind"] == "CLIENT" and edge["flags"] == 257

    advantages = dict(client.query("SELECT DISTINCT rollout_id, advantage FROM transitions WHERE reward_name = 'exec'",
                                   first.db).iter_rows())
    assert set(advantages) == {"r1", "r2"} and advantages["r1"] > 0 > advantages["r2"]  # t2 has one rollout only
    for key, row in theirs.items():
        rollout = row["rollout_id"]
        if rollout not in ROLLOUTS:
            assert labels[key] == {}, row["name"]  # the recorded traces have no rewards
            continue
        reward = {"lightning.reward": ROLLOUTS[rollout][1]}
        if rollout == "r1":
            reward |= {"lightning.reward.exec": 1.0, "lightning.reward.judge": 0.25}
        if row["name"] != "openai.chat":
            assert labels[key] == reward, (rollout, row["name"])  # the gateway's records keep their own version
            continue
        call = reward | {"lightning.policy.version": 3}
        if rollout in advantages:
            call["lightning.advantage"] = pytest.approx(advantages[rollout])
        assert labels[key] == call, rollout
    # The gateway's records came back whole: the second store made the same typed token records of them.
    records = "SELECT * FROM token_records ORDER BY ALL"
    assert client.query(records, second.db).equals(client.query(records, first.db))


def test_where_chooses_rollouts_through_the_collector_or_the_file(first, make_collector, tmp_path):
    second = make_collector(db=tmp_path / "second.duckdb")
    report = replay(ReplayConfig(db=first.db, url=second.url, where="task_id = 't2'"))
    assert report.rollouts == 1 and set(spans_of(second.db).keys()) == set(spans_of(first.db, "rollout_id = 'r3'"))
    only = [row for row in spans_of(second.db).values() if row["name"] == "lightning.rollout"]
    assert added(only[0]) == {"lightning.reward": 0.5}  # one reward name: it is lightning.reward without --reward
    first.close()  # now the file is read directly
    third = make_collector(db=tmp_path / "third.duckdb")
    report = replay(ReplayConfig(db=first.db, url=third.url + "/v1/traces", where="rollout_id IN ('r1', 'r2') "
                                                                                   "-- the two of task t1"))
    assert report.rollouts == 2 and report.spans == len(spans_of(third.db)) == 7 + 4
    r1 = [row for row in spans_of(third.db).values() if row["rollout_id"] == "r1"][0]
    assert "lightning.reward" not in r1["attributes"]  # two names and no --reward: only the named ones
    assert r1["attributes"]["lightning.reward.judge"] == 0.25


BAD_WHERE = [
    ("no_such_column = 1", "is not a condition over the rollouts view"),
    ("task_id = 'x') UNION (SELECT 'y', 1, 0", "is not one condition"),
    ("true; DELETE FROM spans", "is not one condition"),
    ("rollout_id IN (SELECT * FROM read_text('/etc/passwd'))", "read_text() is disabled here"),
    ("task_id = 'nothing-here'", "no rollout with spans matches"),
    ("  ", "--where is empty"),
]


def test_a_bad_where_is_refused_with_what_to_do(first):
    for where, message in BAD_WHERE:
        with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
            replay(ReplayConfig(db=first.db, url="http://127.0.0.1:9", where=where))
    assert client.query("SELECT count(*) AS n FROM spans", first.db)["n"][0] == 40  # nothing happened to the store


class Endpoint:
    """An OTLP/HTTP endpoint on 127.0.0.1 answering 200 to the first `accept` requests, then `then` forever."""

    def __init__(self, accept: int, then: int):
        self.requests = 0
        outer = self

        class Handler(QuietHandler):
            def do_POST(self):  # noqa: N802
                self.body()
                outer.requests += 1
                self.answer(200 if outer.requests <= accept else then)

        self.server = LoopbackServer(Handler)
        self.url = self.server.url

    def close(self):
        self.server.close()


@pytest.mark.heavy
def test_an_endpoint_that_goes_down_or_refuses_says_how_much_went_out(first):
    failing = Endpoint(accept=2, then=503)
    try:
        with pytest.raises(UserError, match=r"still failed after 1 retries over 0.6 s \(HTTP 503 .*\); [1-9]\d* of 40 "
                                            r"spans went out before it, in 2 requests"):
            replay(ReplayConfig(db=first.db, url=failing.url, batch_spans=10, max_retry_s=0.6))
        assert failing.requests == 4  # two sent, the third tried twice (backoff 0.5 s, then 1 s would pass 0.6 s)
    finally:
        failing.close()
    refusing = Endpoint(accept=0, then=401)
    try:
        with pytest.raises(UserError, match=r"refused the request \(HTTP 401.*0 of \d+ spans went out"):
            replay(ReplayConfig(db=first.db, url=refusing.url, max_retry_s=30))
        assert refusing.requests == 1  # not retried
    finally:
        refusing.close()


def test_the_cli_exports_with_headers_and_refuses_what_does_not_fit(first, make_collector, tmp_path, capsys):
    second = make_collector(db=tmp_path / "second.duckdb")
    assert main(["export", "--db", str(first.db), "--otlp", second.url, "--where", "task_id = 't1'",
                 "--header", "X-Tenant=a=b", "--reward", "exec"]) == 0
    assert "sent 11 spans of 2 rollouts to " in capsys.readouterr().out
    for argv, message in [([], "needs one of --parquet DIR"),
                          (["--otlp", second.url, "--parquet", str(tmp_path / "p")], "needs one of --parquet"),
                          (["--parquet", str(tmp_path / "p"), "--where", "true"], "are for --otlp"),
                          (["--otlp", "localhost:6006"], "is not an http(s) URL"),
                          (["--otlp", second.url, "--header", "nope"], "--header 'nope': give NAME=VALUE"),
                          (["--otlp", second.url, "--reward", "missing"], "no chosen rollout has a reward of that")]:
        assert main(["export", "--db", str(first.db), *argv]) == 2, argv
        assert message in capsys.readouterr().err, argv


@pytest.mark.heavy
def test_a_replayed_rollout_carries_its_reward_in_a_real_phoenix(first, tmp_path):
    with running_phoenix(tmp_path) as phoenix:
        report = replay(ReplayConfig(db=first.db, url=phoenix.url, where="task_id = 't1'", reward="exec"))
        spans = wait_for(lambda: (s := phoenix.spans()) and len(s) == report.spans and s, timeout=60,
                         detail=lambda: f"{len(phoenix.spans())} of {report.spans} spans in Phoenix")
        mine = spans_of(first.db, "task_id = 't1'")
        assert sorted(s["context"]["span_id"] for s in spans) == sorted(span for _, span in mine)
        chat = [s for s in spans if s["name"] == "openai.chat"]
        assert len(chat) == 3
        for span in chat:
            attributes = span["attributes"]
            rollout = attributes["lightning.rollout.id"]
            assert attributes["lightning.reward"] == ROLLOUTS[rollout][1]
            assert attributes["lightning.policy.version"] == 3
            assert (attributes["lightning.advantage"] > 0) == (rollout == "r1")


def test_which_reward_is_lightning_reward():
    import polars as pl

    from lightning_otel.span_store.replay import _named_values

    frame = pl.DataFrame({"rollout_id": ["a", "b", "b", "c"], "reward_name": ["exec", "exec", "judge", "judge"],
                          "reward": [1.0, 0.0, 0.5, 0.25]})
    assert _named_values(frame, "reward", "r", None) == {
        "a": {"r": 1.0}, "b": {"r.exec": 0.0, "r.judge": 0.5}, "c": {"r": 0.25}}
    assert _named_values(frame, "reward", "r", "exec") == {
        "a": {"r": 1.0}, "b": {"r": 0.0, "r.exec": 0.0, "r.judge": 0.5}, "c": {"r.judge": 0.25}}
