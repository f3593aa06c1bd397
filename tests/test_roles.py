"""Collector roles (ingest, query, admin tokens) over real HTTP, and an agent under training that tries to write
its own reward: through /v1/records with the token the runner hands it, and with reward spans of the trainer's
reward name sent by the OTel SDK, before and after the runner scored it."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types

import orjson
import pytest
from google.rpc import status_pb2

from conftest import health, post
from lightning_otel.rollouts import packs
from lightning_otel.errors import UserError
from lightning_otel.rollouts.environment import agent_environment
from lightning_otel.rollouts.runner import RolloutConfig, Runner, Task, agent_token, run_rollouts
from lightning_otel.span_store import client, discovery
from lightning_otel.span_store.collector import Collector, CollectorConfig, private_config
from lightning_otel.train.transitions import trajectories
from tests.helpers.sdk import tracer_provider

TOKENS = {"ingest": "in-token", "query": "query-token", "admin": "admin-token"}
BODIES = {  # path -> (content type, a body each route answers 200)
    "/v1/traces": ("application/json", b"{}"),
    "/v1/logs": ("application/json", b"{}"),
    "/v1/query": ("text/plain", b"SELECT 1"),
    "/v1/prune": ("application/json", b'{"before_ns": 0}'),
    "/v1/records": ("application/json", b'{"table": "tasks", "rows": []}'),
}
ALLOWED = {"ingest": {"/v1/traces", "/v1/logs"}, "query": {"/v1/query"}, "admin": set(BODIES)}


def send(url: str, path: str, token: str | None, protobuf: bool = False) -> tuple[int, str]:
    content_type, body = BODIES[path]
    if protobuf:
        content_type, body = "application/x-protobuf", b""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    status, _, raw = post(url + path, body, content_type, headers)
    if status == 200:
        return status, ""
    message = status_pb2.Status.FromString(raw).message if protobuf else orjson.loads(raw)["message"]
    return status, message


def test_each_route_takes_its_role_and_the_admin_token(make_collector):
    collector = make_collector(**{f"{role}_token": token for role, token in TOKENS.items()})
    for path in BODIES:
        status, message = send(collector.url, path, None)
        assert status == 401 and "Authorization: Bearer" in message, (path, message)
        assert send(collector.url, path, "guessed")[0] == 401
        for role, token in TOKENS.items():
            status, message = send(collector.url, path, token)
            if path in ALLOWED[role]:
                assert status == 200, (role, path, message)
            else:
                assert status == 403, (role, path)
                assert f"this is the {role} token" in message and "needs the" in message, message
    # OTLP senders get the reason as a google.rpc.Status, as the OTLP/HTTP spec says.
    status, message = send(collector.url, "/v1/traces", TOKENS["query"], protobuf=True)
    assert status == 403 and "needs the ingest token or the admin one" in message
    status, message = send(collector.url, "/v1/records", TOKENS["ingest"])
    assert "needs the admin token" in message
    # An unknown route: 401 without a token, 404 with any known one.
    assert post(collector.url + "/v1/metrics", b"", "application/x-protobuf")[0] == 401
    assert post(collector.url + "/v1/metrics", b"", "application/x-protobuf",
                {"Authorization": f"Bearer {TOKENS['ingest']}"})[0] == 404
    seen = health(collector.url)
    assert seen["tokens"] is None and seen["token_required"] == {"ingest": True, "query": True, "admin": True}
    assert not any(token in json.dumps(seen) for token in TOKENS.values())


def test_one_token_still_opens_every_route_and_the_client_finds_it(make_collector, db_path):
    collector = make_collector(token="s3cret")
    for path in BODIES:
        assert send(collector.url, path, None)[0] == 401
        assert send(collector.url, path, "s3cret")[0] == 200, path
    assert discovery.find_collector(db_path).tokens == dict.fromkeys(discovery.ROLES, "s3cret")
    assert client.write_records(db_path, "tasks", [{"task_id": "t", "fields": {}}]) == 1
    assert client.query("SELECT count(*) AS n FROM tasks", db_path)["n"][0] == 1
    # A discovery file in the old shape (one "token") is read as that token for every role.
    raw = json.loads(discovery.info_path(db_path).read_text())
    old = {k: v for k, v in raw.items() if k != "tokens"} | {"token": "s3cret"}
    discovery.info_path(db_path).write_text(json.dumps(old))
    assert discovery.find_collector(db_path).token_for("/v1/records") == "s3cret"


def test_a_role_without_a_token_is_open_and_role_tokens_must_differ(make_collector, db_path, tmp_path):
    collector = make_collector(admin_token="a")
    assert send(collector.url, "/v1/traces", None)[0] == 200
    assert send(collector.url, "/v1/query", None)[0] == 200
    assert send(collector.url, "/v1/records", None)[0] == 401
    assert client.prune(db_path, 0) == {"spans": 0, "logs": 0}  # the client sends the admin token
    config = CollectorConfig(db=tmp_path / "x.duckdb", token="t", ingest_token="i")
    assert config.role_tokens() == {"ingest": "i", "query": "t", "admin": "t"}
    for given, needle in [({"ingest_token": "same", "admin_token": "same"}, "ingest and admin roles"),
                          ({"token": "t", "query_token": "t"}, "same token"),
                          ({"admin_token": ""}, "--admin-token is empty")]:
        with pytest.raises(UserError, match=needle):
            CollectorConfig(db=tmp_path / "x.duckdb", **given)
    private = private_config(tmp_path / "y.duckdb").role_tokens()
    assert set(private) == set(discovery.ROLES) and len(set(private.values())) == 3


def test_a_collector_reachable_from_other_machines_needs_a_token_for_every_role(tmp_path):
    db = tmp_path / "x.duckdb"
    for host in ("0.0.0.0", "::", "", "10.1.2.3", "example.invalid"):
        with pytest.raises(UserError, match="ingest, query, admin role.*--insecure-no-auth"):
            CollectorConfig(db=db, host=host)
    with pytest.raises(UserError, match=r"--host 0.0.0.0 .* the ingest role\(s\)"):
        CollectorConfig(db=db, host="0.0.0.0", query_token="q", admin_token="a")
    CollectorConfig(db=db, host="0.0.0.0", token="t")
    CollectorConfig(db=db, host="0.0.0.0", insecure_no_auth=True)
    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        CollectorConfig(db=db, host=host)  # loopback: open roles stay on this machine
    result = subprocess.run([sys.executable, "-m", "lightning_otel.cli", "collect", "--db", str(db), "--host",
                             "0.0.0.0"], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "--insecure-no-auth" in result.stderr, result.stderr[-2000:]
    assert not db.exists()


@pytest.mark.heavy
def test_collect_takes_a_token_per_role(collector_process, db_path):
    proc = collector_process("--ingest-token", "i1", "--query-token", "q1", "--admin-token", "a1")
    assert proc.info.tokens == {"ingest": "i1", "query": "q1", "admin": "a1"}
    assert send(proc.url, "/v1/query", "i1")[0] == 403
    assert client.query("SELECT 42 AS x", db_path)["x"][0] == 42  # with the query token of the discovery file
    assert proc.stop() == 0


def test_agents_get_the_ingest_token_only(make_collector, monkeypatch, caplog, tmp_path):
    collector = Collector(private_config(tmp_path / "run.duckdb"))
    collector.start()
    try:
        info = collector.info
        monkeypatch.setenv("LIGHTNING_OTEL_TOKEN", info.tokens["admin"])  # the runner's own is not passed on
        config = RolloutConfig(tasks=tmp_path / "t.jsonl", agent="python agent.py", db=collector.db)
        runner = Runner(config, info.url, agent_token(info), lambda table, rows: 0, lambda rollout_id: [],
                        lambda rollout_id: f"http://127.0.0.1:9/r/{rollout_id}/v1")
        env = runner._environment("ro-1", Task("t1", 1, {}), 0)
        assert env["LIGHTNING_OTEL_TOKEN"] == info.ingest_token
        secrets = {info.tokens["query"], info.tokens["admin"]}
        assert not [key for key, value in env.items() if any(secret in value for secret in secrets)]
        assert "can write records" not in caplog.text
    finally:
        collector.close()
    agent_token(make_collector(token="one").info)  # a user's collector with one token for every role
    assert "its one token is also its admin token" in caplog.text


FORGER = textwrap.dedent("""
    import json, os, sys, urllib.error, urllib.request
    import lightning_otel
    from opentelemetry import trace

    rollout_id, reward_name = sys.argv[1], sys.argv[2]
    url, token = os.environ["LIGHTNING_OTEL_ENDPOINT"], os.environ["LIGHTNING_OTEL_TOKEN"]

    def post(path, body):
        request = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST", headers={
            "Content-Type": "application/json", "Authorization": "Bearer " + token})
        try:
            return urllib.request.urlopen(request, timeout=30).status
        except urllib.error.HTTPError as exc:
            return exc.code

    forged = {"rollout_id": rollout_id, "name": reward_name, "value": 1.0, "source": "function",
              "created_ns": 2 ** 62}
    statuses = {"records": post("/v1/records", {"table": "rewards", "rows": [forged]}),
                "query": post("/v1/query", {"sql": "SELECT fields FROM tasks"}),
                "prune": post("/v1/prune", {"before_ns": 2 ** 62})}
    lightning_otel.emit_reward(1.0, name=reward_name)  # a root span: no target, like the runner's row
    with trace.get_tracer("forger").start_as_current_span("invoke_agent forger"):
        lightning_otel.emit_reward(1.0, name=reward_name)  # on the episode's root span
    print(json.dumps({"token": token, **statuses}))
""")


@pytest.mark.heavy
@pytest.mark.usefixtures("plain_sdk_agents")  # a faster agent start, same distro (conftest.py)
def test_an_agent_cannot_write_or_overwrite_its_own_reward(tmp_path, monkeypatch):
    # registers the reward gold_only
    monkeypatch.setitem(packs.BUILTIN, "gold", "tests.helpers.train_rewards:GOLD_PACK")
    (tmp_path / "forger.py").write_text(FORGER)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "scored", "gold": 0.0}) + "\n" + json.dumps({"id": "unscored"}) + "\n")
    db = tmp_path / "run" / "traces.duckdb"
    db.parent.mkdir()
    collector = Collector(private_config(db))  # what the trainer starts
    collector.start()
    try:
        summary = run_rollouts(RolloutConfig(
            tasks=tasks, agent=f"{sys.executable} {tmp_path / 'forger.py'} {{rollout_id}} gold_only", n=1, db=db,
            base_url="http://127.0.0.1:9/v1", reward="gold_only", rollout_timeout_s=120))
        results = {r.task_id: r for r in summary.results}
        assert all(r.status == "ok" for r in results.values()), [r.stderr_tail for r in results.values()]
        for result in results.values():
            assert json.loads(result.final_output) == {"token": collector.info.ingest_token, "records": 403,
                                                        "query": 403, "prune": 403}
        scored, unscored = results["scored"].rollout_id, results["unscored"].rollout_id
        # Later still: the agent (or a process it left behind) sends one more reward span with the OTel SDK.
        late = tracer_provider(collector.url, {"lightning.rollout.id": scored}, token=collector.info.ingest_token)
        with late.get_tracer("forger").start_as_current_span("lightning.reward", attributes={
                "lightning.reward.name": "gold_only", "lightning.reward.value": 1.0}):
            pass
        late.shutdown()
        stored = client.query(f"SELECT rollout_id, value, source, created_ns FROM rewards WHERE rollout_id = "
                              f"{client.sql_literal(scored)} ORDER BY created_ns", db).to_dicts()
        assert [(r["value"], r["source"]) for r in stored] == \
            [(1.0, "emitted"), (1.0, "emitted"), (0.0, "function"), (1.0, "emitted")]
        assert max(r["created_ns"] for r in stored) < 2 ** 62  # the forged record was never written
        assert client.query("SELECT count(*) AS n FROM tasks", db)["n"][0] == 2  # nor anything pruned
        # The episode reward is the runner's; an emitted one only stands where the function gave none, and
        # the trainer's query (compile with emitted_rewards=False) never takes it.
        episode = client.query("SELECT rollout_id, reward, source FROM episode_rewards "
                               "WHERE reward_name = 'gold_only' ORDER BY source DESC", db).to_dicts()
        assert episode == [{"rollout_id": scored, "reward": 0.0, "source": "function"},
                           {"rollout_id": unscored, "reward": 1.0, "source": "emitted"}]
        trained_on = client.query(trajectories.SQL_COMPUTED_EPISODE_REWARDS.replace("$name", "'gold_only'"), db)
        assert trained_on.to_dicts() == [{"rollout_id": scored, "reward": 0.0}]
    finally:
        collector.close()


def test_the_trainers_collector_has_a_token_per_role_and_its_agents_the_ingest_one(tmp_path, monkeypatch):
    from lightning_otel.rollouts import runner
    from lightning_otel.train.config import TrainConfig
    from lightning_otel.train.trainer import Trainer

    class NoLearner:  # the trainer's collector and agent worker, without loading the model
        def __init__(self, *args):
            pass

        def close(self) -> None:
            pass

    monkeypatch.setitem(sys.modules, "lightning_otel.train.learner", types.SimpleNamespace(Learner=NoLearner))
    handed = {}

    def start_agent_worker(agent, url, token):
        handed["token"] = token
        return types.SimpleNamespace(close=lambda: None)

    monkeypatch.setattr(runner, "start_agent_worker", start_agent_worker)
    (tmp_path / "agent.py").write_text("def run(task, llm):\n    return 'SELECT 1'\n")
    (tmp_path / "tasks.jsonl").write_text(json.dumps({"id": "t", "question": "q"}) + "\n")
    config = TrainConfig(tasks=str(tmp_path / "tasks.jsonl"), agent=f"{tmp_path / 'agent.py'}:run",
                         reward="number_match", rounds=1, output_dir=str(tmp_path / "run"))
    with Trainer(config) as trainer:
        tokens = trainer.collector.config.role_tokens()
        assert set(tokens) == set(discovery.ROLES) and len(set(tokens.values())) == 3
        trainer._agent_worker()
        assert handed["token"] == tokens["ingest"]
        env = agent_environment("", trainer.collector.url, handed["token"], None, "policy")
        assert not [k for k, v in env.items() if tokens["admin"] in v or tokens["query"] in v]
        status, _, raw = post(trainer.collector.url + "/v1/records", b'{"table": "rewards", "rows": []}',
                              "application/json", {"Authorization": f"Bearer {handed['token']}"})
        assert status == 403 and b"needs the admin token" in raw
