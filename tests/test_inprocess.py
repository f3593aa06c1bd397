"""The runner's in-process mode on real components: agent functions (tests/helpers/inprocess_agents.py, and the
plain-SDK example's `run`) called in one worker process under opentelemetry-instrument, through the real
gateway over vLLM (the `engine` fixture), into the real collector and DuckDB store."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_otel import LLM
from lightning_otel.capture.agent_fn import parse_agent_function
from lightning_otel.cli import main
from lightning_otel.errors import UserError
from lightning_otel.tasks.spider.rewards import bundled_data_dir
from lightning_otel.rollouts.runner import RolloutConfig, run_rollouts
from lightning_otel.span_store import client

HERE = Path(__file__).resolve().parent
HELPERS = HERE / "helpers" / "inprocess_agents.py"
EXAMPLE = HERE.parent / "examples" / "openai_sql" / "agent.py"
NOWHERE = "http://127.0.0.1:9/v1"  # for agents that make no model call


def write_tasks(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def singer_tasks(count: int) -> list[dict]:
    rows = [json.loads(line) for line in (bundled_data_dir() / "dev.jsonl").read_text().splitlines()]
    return [r for r in rows if r["db_id"] == "singer"][:count]


def by_task_config(tasks: Path, db: Path, **kw) -> RolloutConfig:
    defaults = dict(tasks=tasks, agent=f"{HELPERS}:by_task", n=1, concurrency=1, db=db, base_url=NOWHERE,
                    reward="spider_exec", rollout_timeout_s=20)
    defaults.update(kw)
    return RolloutConfig(**defaults)


def runs(db: Path, rollout_ids) -> dict[str, dict]:
    ids = ", ".join(client.sql_literal(r) for r in rollout_ids)
    return {r["rollout_id"]: r for r in client.query(f"SELECT * FROM rollout_runs WHERE rollout_id IN ({ids})",
                                                     db).to_dicts()}


# ---- the same records as the subprocess mode ---------------------------------------------------------

# What legitimately differs between the modes, per span: ids and times; the resource (the subprocess's
# carries the rollout ids, the worker's does not); the rollout ids as span attributes (a call's spans get
# them from the lightning.rollout span's baggage, the subprocess's from its resource; the store's columns
# are the same); the gateway's URL (its port, and the rollout id in its prefix); the completion ids.
VOLATILE_ATTRIBUTES = {"gen_ai.response.id", "gen_ai.openai.api_base", "lightning.rollout.id", "lightning.task.id",
                       "lightning.attempt"}


def span_shapes(db: Path, rollout_id: str) -> list[dict]:
    frame = client.query(f"""
        SELECT s.name, s.kind, s.status_code, s.scope_name, p.name AS parent, s.attributes, s.task_id, s.attempt
        FROM spans s LEFT JOIN spans p ON p.trace_id = s.trace_id AND p.span_id = s.parent_span_id
        WHERE s.rollout_id = {client.sql_literal(rollout_id)} ORDER BY s.start_ns""", db)
    shapes = []
    for row in frame.to_dicts():
        attributes = json.loads(row.pop("attributes"))
        if row["name"] == "openai.chat":
            assert f"/r/{rollout_id}/v1" in attributes["gen_ai.openai.api_base"]
        row["attributes"] = {k: v for k, v in attributes.items() if k not in VOLATILE_ATTRIBUTES}
        shapes.append(row)
    return shapes


def calls(db: Path, rollout_id: str) -> list[dict]:
    return client.query(f"""
        SELECT c.turn, c.agent, c.agent_path, c.request_model, c.input_tokens, c.output_tokens, g.policy_version,
               g.prompt_ids, g.completion_ids, g.completion_logprobs, g.rollout_id = c.rollout_id AS joined
        FROM llm_calls c JOIN generations g ON g.trace_id = c.trace_id AND g.llm_span_id = c.span_id
        WHERE c.rollout_id = {client.sql_literal(rollout_id)} ORDER BY c.turn""", db).to_dicts()


def transitions(db: Path, sub_id: str, fn_id: str) -> dict[str, list[dict]]:
    """Both rollouts' compiled transitions. They are one group (same task, same policy) and their spider_exec
    rewards are equal, so the compiler would leave the group out (zero variance): a marker reward told apart
    by mode gives it a spread, and is left out of the comparison with the advantage it makes."""
    from lightning_otel.train.transitions.compile import CompileConfig, compile_transitions

    client.write_records(db, "rewards", [{"rollout_id": rid, "name": "mode_marker", "value": value,
                                          "source": "function", "created_ns": time.time_ns()}
                                         for rid, value in ((sub_id, 0.0), (fn_id, 1.0))])
    frame, account = compile_transitions(CompileConfig(db=db, reward="mode_marker",
                                                       rollout_ids=frozenset({sub_id, fn_id})))
    assert account.compiled_rollouts == 2, account
    columns = ["task_id", "attempt", "policy_version", "agent", "agent_path", "turn", "prompt_ids",
               "completion_ids", "loss_mask", "token_source"]
    return {rid: frame.filter(frame["rollout_id"] == rid).sort("turn").select(columns).to_dicts()
            for rid in (sub_id, fn_id)}


def test_in_process_records_match_the_subprocess_mode(engine, db_path, tmp_path):
    tasks = write_tasks(tmp_path / "tasks.jsonl", singer_tasks(1))
    common = dict(tasks=tasks, n=1, concurrency=1, db=db_path, reward="spider_exec", rollout_timeout_s=180,
                  temperature=0.0, max_tokens=48)
    command = f"{sys.executable} {EXAMPLE} --question {{question}} --db {{db_path}} --model {{model}}"
    sub = run_rollouts(RolloutConfig(agent=command, **common), engine=engine).results[0]
    fn = run_rollouts(RolloutConfig(agent=f"{EXAMPLE}:run", **common), engine=engine).results[0]

    rows = runs(db_path, [sub.rollout_id, fn.rollout_id])
    same = ("task_id", "attempt", "policy_version", "status", "error_class", "final_output")
    assert {k: rows[fn.rollout_id][k] for k in same} == {k: rows[sub.rollout_id][k] for k in same}
    assert rows[fn.rollout_id]["status"] == "ok" and rows[fn.rollout_id]["final_output"]
    assert (rows[sub.rollout_id]["exit_code"], rows[fn.rollout_id]["exit_code"]) == (0, None)
    assert rows[fn.rollout_id]["command"] == f"{EXAMPLE}:run"
    # The subprocess prints the final SQL as its last line; the function returns it instead.
    assert rows[sub.rollout_id]["stdout_tail"] == rows[fn.rollout_id]["stdout_tail"] + fn.final_output + "\n"
    assert rows[fn.rollout_id]["stderr_tail"] == ""

    sub_spans, fn_spans = span_shapes(db_path, sub.rollout_id), span_shapes(db_path, fn.rollout_id)
    # The call's own root span; under it, the very spans the subprocess has (its LLM spans are roots there).
    assert [(s["name"], s["kind"], s["parent"]) for s in fn_spans[:1]] == [("lightning.rollout", "INTERNAL", None)]
    unrooted = [{**s, "parent": None if s["parent"] == "lightning.rollout" else s["parent"]} for s in fn_spans[1:]]
    assert unrooted == sub_spans
    names = [(s["name"], s["parent"]) for s in sub_spans]
    assert names and names == [("openai.chat", None), ("lightning.generate", "openai.chat")] * (len(names) // 2)

    sub_calls, fn_calls = calls(db_path, sub.rollout_id), calls(db_path, fn.rollout_id)
    assert len(fn_calls) == len(sub_spans) // 2 and all(c["joined"] for c in fn_calls + sub_calls)
    for a, b in zip(fn_calls, sub_calls, strict=True):
        assert a["completion_logprobs"] == pytest.approx(b.pop("completion_logprobs"), abs=1e-4)
        # llm_calls.agent_path names every ancestor span: the call's lightning.rollout is one.
        assert (a.pop("agent_path"), b.pop("agent_path")) == ("lightning.rollout", None)
        assert {k: v for k, v in a.items() if k != "completion_logprobs"} == b

    compiled = transitions(db_path, sub.rollout_id, fn.rollout_id)
    assert compiled[fn.rollout_id] == compiled[sub.rollout_id] and len(compiled[fn.rollout_id]) == len(fn_calls)
    assert fn.reward == sub.reward and fn.reward in (0.0, 1.0)
    stored = client.query("SELECT rollout_id, value FROM rewards WHERE name = 'spider_exec'", db_path).to_dicts()
    assert sorted(r["rollout_id"] for r in stored) == sorted([sub.rollout_id, fn.rollout_id])


def test_concurrent_calls_in_one_worker_keep_their_rollouts_apart(engine, db_path, tmp_path):
    tasks = write_tasks(tmp_path / "tasks.jsonl", singer_tasks(3))
    summary = run_rollouts(RolloutConfig(tasks=tasks, agent=f"{HELPERS}:chatty", n=2, concurrency=3, db=db_path,
                                         rollout_timeout_s=180, max_tokens=4), engine=engine)
    assert [r.status for r in summary.results] == ["ok"] * 6
    assert all(r.final_output == f"{r.rollout_id} 2" for r in summary.results)
    ids = {r.rollout_id for r in summary.results}
    spans = client.query("""
        SELECT s.trace_id, s.name, s.rollout_id, s.task_id, s.attempt, s.start_ns, s.end_ns,
               json_extract_string(s.attributes, '$."test.given_rollout_id"') AS given,
               json_extract_string(s.attributes, '$."test.pid"') AS pid
        FROM spans s""", db_path).to_dicts()
    # Every span of a call's trace, the gateway's token records included, carries that call's rollout id.
    by_trace: dict[str, set] = {}
    for s in spans:
        by_trace.setdefault(s["trace_id"], set()).add(s["rollout_id"])
    assert all(len(owners) == 1 for owners in by_trace.values()) and set().union(*by_trace.values()) == ids
    checks = [s for s in spans if s["name"] == "check_turn"]
    assert len(checks) == 12 and all(s["given"] == s["rollout_id"] for s in checks)
    assert len({s["pid"] for s in checks}) == 1 and int(checks[0]["pid"]) != os.getpid()  # one worker process
    expected = {(r.rollout_id, r.task_id, r.attempt) for r in summary.results}
    # The agent's spans carry its task and attempt too (the gateway's token records know only the rollout).
    assert {(s["rollout_id"], s["task_id"], s["attempt"]) for s in spans if s["name"] != "lightning.generate"} \
        == expected
    joined = client.query("SELECT count(*) AS n FROM llm_calls c JOIN generations g ON g.trace_id = c.trace_id "
                          "AND g.llm_span_id = c.span_id AND g.rollout_id = c.rollout_id", db_path)["n"][0]
    assert joined == 12
    # The calls did overlap: at some moment at least two rollouts were in flight.
    episodes = sorted((s["start_ns"], s["end_ns"]) for s in spans if s["name"] == "lightning.rollout")
    assert any(later[0] < earlier[1] for earlier, later in zip(episodes, episodes[1:]))


# ---- failures --------------------------------------------------------------------------------------

@pytest.mark.heavy
def test_a_raise_a_hang_and_a_dead_worker_are_recorded_and_the_rest_still_runs(db_path, tmp_path):
    order = ["ok-1", "raise-1", "hang-1", "ok-2", "die-1", "ok-3", "none-1"]
    tasks = write_tasks(tmp_path / "tasks.jsonl", [{"id": i, "db_id": "singer", "question": i,
                                                     "query": "SELECT count(*) FROM singer"} for i in order])
    started = time.monotonic()
    summary = run_rollouts(by_task_config(tasks, db_path, rollout_timeout_s=4))
    assert time.monotonic() - started < 120
    by_id = {r.task_id: r for r in summary.results}
    assert sorted(by_id) == sorted(order)
    rows = runs(db_path, [r.rollout_id for r in summary.results])
    assert len(rows) == len(order)  # every job has its row
    status = {r.task_id: (r.status, r.error_class, r.exit_code) for r in summary.results}
    assert status == {"ok-1": ("ok", None, None), "raise-1": ("failed", "RuntimeError", None),
                      "hang-1": ("timeout", "Timeout", None), "ok-2": ("ok", None, None),
                      "die-1": ("error", "WorkerDied", None), "ok-3": ("ok", None, None),
                      "none-1": ("ok", None, None)}
    failed = rows[by_id["raise-1"].rollout_id]
    assert failed["stdout_tail"] == "working on raise-1\n"
    assert failed["stderr_tail"].startswith("about to fail\nTraceback (most recent call last):")
    assert "inprocess_agents.py" in failed["stderr_tail"] and "RuntimeError: boom in raise-1" in failed["stderr_tail"]
    assert "exited with code 7" in by_id["die-1"].stderr_tail
    # The hung call's worker was replaced, and so was the one that died: three workers served the ok calls.
    pids = {by_id[i].stdout_tail.splitlines()[-1] for i in ("ok-1", "ok-2", "ok-3")}
    assert len(pids) == 3 and all(p.startswith("pid ") for p in pids)
    assert all(by_id[i].final_output == "SELECT count(*) FROM singer" for i in ("ok-1", "ok-2", "ok-3"))
    assert [by_id[i].reward for i in ("ok-1", "ok-2", "ok-3", "none-1")] == [1.0, 1.0, 1.0, 0.0]
    assert by_id["none-1"].final_output is None
    assert client.query("SELECT count(DISTINCT rollout_id) AS n FROM spans WHERE name = 'lightning.rollout'",
                        db_path)["n"][0] >= 5  # the hung and the dead call's spans may be lost with their worker


@pytest.mark.heavy
def test_a_failing_call_leaves_concurrent_ones_alone(db_path, tmp_path):
    tasks = write_tasks(tmp_path / "tasks.jsonl", [{"id": i, "question": i} for i in
                                                   ("ok-1", "raise-1", "ok-2", "ok-3", "raise-2")])
    summary = run_rollouts(by_task_config(tasks, db_path, n=2, concurrency=3, reward=None))
    assert sorted((r.task_id, r.status) for r in summary.results) == sorted(
        [(t, "failed" if t.startswith("raise") else "ok") for t in ("ok-1", "raise-1", "ok-2", "ok-3", "raise-2")
         for _ in range(2)])
    # Each call's own prints, and one worker process for all of them.
    assert all(r.stdout_tail.startswith(f"working on {r.task_id}\npid ") for r in summary.results if r.status == "ok")
    assert len({r.stdout_tail.splitlines()[1] for r in summary.results if r.status == "ok"}) == 1
    assert all(f"boom in {r.task_id}" in r.stderr_tail for r in summary.results if r.status == "failed")


def _dead(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")  # a zombie has ended
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True


@pytest.mark.heavy
def test_the_worker_dies_with_a_sigkilled_runner(db_path, tmp_path):
    pid_file = tmp_path / "worker.pid"
    tasks = write_tasks(tmp_path / "tasks.jsonl", [{"id": "sleep", "pid_file": str(pid_file)}])
    script = ("import sys\nfrom lightning_otel.rollouts.runner import RolloutConfig, run_rollouts\n"
              "run_rollouts(RolloutConfig(tasks=sys.argv[1], agent=sys.argv[2], n=1, db=sys.argv[3], "
              f"base_url={NOWHERE!r}, rollout_timeout_s=600))\n")
    runner = subprocess.Popen([sys.executable, "-c", script, str(tasks), f"{HELPERS}:sleeper", str(db_path)],
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline and runner.poll() is None, "the worker never ran the call"
            time.sleep(0.2)
        worker = int(pid_file.read_text())
        assert not _dead(worker)
        os.kill(runner.pid, signal.SIGKILL)
        runner.wait(10)
        deadline = time.monotonic() + 15
        while not _dead(worker):
            assert time.monotonic() < deadline, f"worker {worker} outlived its runner"
            time.sleep(0.1)
    finally:
        if runner.poll() is None:
            runner.kill()


# ---- the agent spec --------------------------------------------------------------------------------

def test_what_is_a_function_and_what_stays_a_command():
    assert parse_agent_function("examples/openai_sql/agent.py:run").target == "examples/openai_sql/agent.py"
    assert parse_agent_function("my_pkg.agents:solve").name == "solve"
    for command in ("python agent.py:run", "python agent.py --x {question}", "./run.sh:x", "agent.py:",
                    "a.py:1bad", "opentelemetry-instrument python a.py"):
        assert parse_agent_function(command) is None, command


@pytest.mark.parametrize("agent,needle", [
    ("no_such_module_for_lightning:run", "cannot import module 'no_such_module_for_lightning'"),
    ("nowhere/agent.py:run", "file nowhere/agent.py does not exist"),
    (f"{HELPERS}:no_such_function", "has no function 'no_such_function'"),
    (f"{HELPERS}:NOT_CALLABLE", "NOT_CALLABLE is a int, not a function"),
    ("broken", "does not import (SyntaxError"),
])
def test_bad_agent_functions_fail_before_any_rollout(db_path, tmp_path, agent, needle):
    if agent == "broken":
        broken = tmp_path / "broken.py"
        broken.write_text("def run(task, llm)\n    return 1\n")
        agent = f"{broken}:run"
    tasks = write_tasks(tmp_path / "tasks.jsonl", [{"id": "ok-1", "question": "q"}])
    with pytest.raises(UserError) as info:
        run_rollouts(by_task_config(tasks, db_path, agent=agent))
    assert needle in str(info.value)
    assert not db_path.exists() or client.query("SELECT count(*) AS n FROM rollout_runs", db_path)["n"][0] == 0


@pytest.mark.heavy
def test_a_module_spec_and_the_cli(db_path, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PYTHONPATH", str(HERE.parent))  # the worker imports the module as the runner does
    tasks = write_tasks(tmp_path / "tasks.jsonl", [{"id": i, "db_id": "singer", "question": i,
                                                     "query": "SELECT count(*) FROM singer"}
                                                    for i in ("ok-1", "raise-1")])
    code = main(["rollout", "--tasks", str(tasks), "--agent", "tests.helpers.inprocess_agents:by_task", "-n", "2",
                 "--concurrency", "2", "--db", str(db_path), "--base-url", NOWHERE, "--reward", "spider_exec",
                 "--rollout-timeout", "20"])
    out = capsys.readouterr().out
    assert code == 0
    assert "4 rollouts: 2 ok, 2 failed, 0 timed out, 0 could not start" in out
    assert "reward spider_exec: mean 0.500 over 4 scored rollouts" in out
    assert main(["rollout", "--tasks", str(tasks), "--agent", "tests.helpers.inprocess_agents:nope", "--db",
                 str(db_path), "--base-url", NOWHERE]) == 2


def test_llm_gives_an_openai_client_on_the_rollouts_url():
    llm = LLM(base_url="http://127.0.0.1:9/r/ro-1/v1", api_key="k", model="policy", rollout_id="ro-1",
              task_id="t", attempt=0)
    client_ = llm.openai(max_retries=0)
    assert str(client_.base_url).rstrip("/") == llm.base_url and client_.api_key == "k"
    with pytest.raises(Exception):
        llm.rollout_id = "other"  # frozen
