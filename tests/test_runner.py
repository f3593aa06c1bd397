"""The rollout runner on real processes: an agent script that knows nothing of lightning-otel, run under
opentelemetry-instrument over Spider tasks with per-rollout database copies, scored by spider_exec."""
from __future__ import annotations

import hashlib
import json
import sys
import textwrap
from pathlib import Path

import pytest

from lightning_otel.cli import main
from lightning_otel.errors import UserError
from lightning_otel.tasks.spider.rewards import bundled_data_dir, database_path
from lightning_otel.rollouts.environment import resource_attributes
from lightning_otel.rollouts.runner import RolloutConfig, instrumented, load_tasks, run_rollouts
from lightning_otel.span_store import client

pytestmark = pytest.mark.usefixtures("plain_sdk_agents")  # its agents use the plain OpenAI SDK (conftest.py)

# Behaviour keyed on the question, so one script covers every outcome the runner must record.
AGENT = textwrap.dedent("""
    import argparse, sqlite3, sys, time
    from opentelemetry import trace
    parser = argparse.ArgumentParser()
    parser.add_argument("--question")
    parser.add_argument("--db")
    args = parser.parse_args()
    tracer = trace.get_tracer("test-agent")
    with tracer.start_as_current_span("invoke_agent sql_writer") as span:
        span.set_attribute("gen_ai.agent.name", "sql_writer")
        con = sqlite3.connect(args.db)
        con.execute("DELETE FROM singer")  # the runner's copy, never the shared file
        con.commit()
    if "crash" in args.question:
        sys.exit(3)
    if "hang" in args.question:
        time.sleep(600)
    print("thinking...")
    print("SELECT count(*) FROM singer" if "How many" in args.question else "SELECT Name FROM singer")
""")


@pytest.fixture
def setup(tmp_path: Path):
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    tasks = tmp_path / "tasks.jsonl"
    rows = [  # the hanging task first: its rollouts wait out their timeout while the others run beside them
        {"id": "hang", "db_id": "singer", "question": "hang please", "query": "SELECT 1"},
        {"id": "count", "db_id": "singer", "question": "How many singers are there?",
         "query": "SELECT count(*) FROM singer"},
        {"id": "names", "db_id": "singer", "question": "How many names? no: list names",
         "query": "SELECT Name FROM singer"},
        {"id": "wrong", "db_id": "singer", "question": "Net worth of each singer",
         "query": "SELECT Net_Worth_Millions FROM singer"},
        {"id": "crash", "db_id": "singer", "question": "crash please", "query": "SELECT 1"},
    ]
    tasks.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return agent, tasks


def config(agent_script: Path, tasks: Path, db: Path, **kw) -> RolloutConfig:
    # 60 s (the task that hangs waits it out): on a loaded 2-core AVX2 machine (the engine tests and a sanitizer
    # build beside it) the agents that answer at once took over 20 s to start and finish, and all timed out.
    import sys
    defaults = dict(tasks=tasks, agent=f"{sys.executable} {agent_script} --question {{question}} --db {{db_path}}", n=2,
                    concurrency=3, db=db, base_url="http://127.0.0.1:9/v1", reward="spider_exec", rollout_timeout_s=60)
    defaults.update(kw)
    return RolloutConfig(**defaults)


@pytest.mark.heavy
def test_every_rollout_is_recorded_and_scored(setup, db_path):
    agent, tasks = setup
    original = hashlib.sha256(database_path(bundled_data_dir(), "singer").read_bytes()).hexdigest()
    summary = run_rollouts(config(agent, tasks, db_path))
    assert len(summary.results) == 10
    assert (summary.count("ok"), summary.count("failed"), summary.count("timeout")) == (6, 2, 2)
    rows = client.query("SELECT task_id, attempt, status, error_class, exit_code, final_output, spans, rewards "
                        "FROM rollouts ORDER BY task_id, attempt", db_path).to_dicts()
    by_task = {}
    for row in rows:
        by_task.setdefault(row["task_id"], []).append(row)
    assert [r["attempt"] for r in by_task["count"]] == [0, 1]
    assert all(r["status"] == "ok" and r["final_output"] == "SELECT count(*) FROM singer" for r in by_task["count"])
    assert [r["rewards"][0]["value"] for r in by_task["count"]] == [1.0, 1.0]
    assert [r["rewards"][0]["value"] for r in by_task["names"]] == [0.0, 0.0]  # counted 0 rows != names
    assert [r["rewards"][0]["value"] for r in by_task["wrong"]] == [0.0, 0.0]
    assert all((r["status"], r["error_class"], r["exit_code"]) == ("failed", "NonZeroExit", 3)
               for r in by_task["crash"])
    assert all(r["status"] == "timeout" and r["error_class"] == "Timeout" for r in by_task["hang"])
    # The agent's own span reached the store under the rollout's id, task id and attempt.
    assert all(r["spans"] >= 1 for r in by_task["count"])
    tasks_stored = client.query("SELECT task_id, fields->>'question' AS q FROM tasks ORDER BY 1", db_path)
    assert tasks_stored["task_id"].to_list() == ["count", "crash", "hang", "names", "wrong"]
    # Every rollout worked on its own copy: the bundled database is untouched.
    assert hashlib.sha256(database_path(bundled_data_dir(), "singer").read_bytes()).hexdigest() == original


@pytest.mark.heavy
def test_wrong_answers_score_zero_and_no_gold_means_no_reward(setup, db_path, tmp_path):
    agent, _ = setup
    tasks = tmp_path / "t.jsonl"
    tasks.write_text(json.dumps({"id": "w", "db_id": "singer", "question": "Net worth?",
                                 "query": "SELECT Net_Worth_Millions FROM singer"}) + "\n"
                     + json.dumps({"id": "nogold", "db_id": "singer", "question": "Net worth?"}) + "\n")
    summary = run_rollouts(config(agent, tasks, db_path, n=1))
    rewards = {r.task_id: r.reward for r in summary.results}
    assert rewards == {"w": 0.0, "nogold": None}
    stored = client.query("SELECT rollout_id FROM rewards", db_path)
    assert stored.height == 1  # a rollout without a reward gets no row, never a 0


@pytest.mark.parametrize("change,needle", [
    (dict(agent="no-such-agent-binary --x {question}"), "agent command not found"),
    (dict(agent=f"{sys.executable} agent.py --q {{nonexistent_field}}"), "no field(s) ['nonexistent_field']"),
    (dict(reward="nope"), "unknown reward"),
    (dict(n=0), "at least 1"),
    (dict(model="/nonexistent/model"), "not both"),
])
def test_bad_inputs_fail_before_any_rollout(setup, db_path, change, needle):
    agent, tasks = setup
    with pytest.raises(UserError) as info:
        run_rollouts(config(agent, tasks, db_path, **change))
    assert needle in str(info.value)
    assert not db_path.exists() or client.query("SELECT count(*) AS n FROM rollout_runs", db_path)["n"][0] == 0


def test_bad_task_files_are_named_by_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a"}\n\n{oops\n')
    with pytest.raises(UserError, match="bad.jsonl:3: not JSON"):
        load_tasks(bad)
    bad.write_text('{"id": "a"}\n[1]\n')
    with pytest.raises(UserError, match=":2: a task must be a JSON object"):
        load_tasks(bad)
    bad.write_text('{"id": "a"}\n{"id": "a"}\n')
    with pytest.raises(UserError, match="repeats line 1"):
        load_tasks(bad)
    bad.write_text('{"question": "x"}\n{"question": "y"}\n')
    assert [t.task_id for t in load_tasks(bad)] == ["1", "2"]


def test_resource_attribute_values_are_percent_encoded():
    assert resource_attributes("service.name=a", {"lightning.task.id": "x,y=z"}) == \
        "service.name=a,lightning.task.id=x%2Cy%3Dz"


@pytest.mark.heavy
def test_rollout_cli(setup, db_path, capsys, tmp_path):
    import sys
    agent, tasks = setup
    # Without the hanging task: it would hold the test for its whole timeout, and the runner's timeouts are
    # test_every_rollout_is_recorded_and_scored's; this test is the command's flags and its summary line.
    quick = tmp_path / "quick.jsonl"
    rows = [json.loads(line) for line in tasks.read_text().splitlines()]
    quick.write_text("".join(json.dumps(r) + "\n" for r in rows if r["id"] != "hang"))
    code = main(["rollout", "--tasks", str(quick), "--agent",
                 f"{sys.executable} {agent} --question {{question}} --db {{db_path}}", "-n", "1",
                 "--concurrency", "4", "--db", str(db_path), "--base-url", "http://127.0.0.1:9/v1",
                 "--reward", "spider_exec", "--rollout-timeout", "60"])  # 4 instrumented starts at once on 2 cores
    captured = capsys.readouterr()
    assert code == 0
    assert "4 rollouts: 3 ok, 1 failed, 0 timed out, 0 could not start" in captured.out
    assert "rollouts [" in captured.err and "4/4" in captured.err
    assert main(["rollout", "--tasks", str(tasks), "--agent", "nope {question}", "--db", str(db_path),
                 "--base-url", "http://x"]) == 2


SQL_AGENT = textwrap.dedent("""
    # An unchanged OpenAI SDK agent: asks for SQL, prints the answer's first line as its final output.
    import argparse, os, openai
    parser = argparse.ArgumentParser()
    parser.add_argument("--question")
    args = parser.parse_args()
    client = openai.OpenAI()
    answer = client.chat.completions.create(
        model=os.environ.get("LIGHTNING_MODEL", "gpt-4o"), max_tokens=32, temperature=1.0,
        messages=[{"role": "system", "content": "Answer with one SQLite query."},
                  {"role": "user", "content": args.question}]).choices[0].message.content
    print((answer.strip().splitlines() or [""])[0])
""")


def test_rollouts_through_the_gateway_are_token_exact(engine, db_path, tmp_path):
    engine.use_base()  # the shared engine may serve what an earlier test trained; these rollouts are version 0
    agent = tmp_path / "sql_agent.py"
    agent.write_text(SQL_AGENT)
    tasks = tmp_path / "tasks.jsonl"
    rows = [json.loads(line) for line in (bundled_data_dir() / "dev.jsonl").read_text().splitlines()
            if json.loads(line)["db_id"] == "singer"][:2]
    tasks.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = run_rollouts(RolloutConfig(tasks=tasks, agent=f"{sys.executable} {agent} --question {{question}}",
                                         n=2, concurrency=4, db=db_path, reward="spider_exec", rollout_timeout_s=120),
                           engine=engine)
    assert [r.status for r in summary.results] == ["ok"] * 4
    assert all(r.reward in (0.0, 1.0) for r in summary.results)
    joined = client.query("""
        SELECT r.rollout_id, r.policy_version, count(c.span_id) AS calls, count(g.span_id) AS records,
               bool_and(g.rollout_id = r.rollout_id) AS same_rollout
        FROM rollouts r JOIN llm_calls c ON c.rollout_id = r.rollout_id
        LEFT JOIN generations g ON g.trace_id = c.trace_id AND g.llm_span_id = c.span_id
        GROUP BY ALL""", db_path).to_dicts()
    assert len(joined) == 4
    assert all(j["calls"] == 1 and j["records"] == 1 and j["same_rollout"] and j["policy_version"] == 0
               for j in joined)
    groups = client.query("SELECT task_id, count(*) AS n, count(DISTINCT attempt) AS attempts FROM rollouts "
                          "GROUP BY 1", db_path).to_dicts()
    assert sorted((g["n"], g["attempts"]) for g in groups) == [(2, 2), (2, 2)]


@pytest.mark.heavy
def test_a_command_already_under_opentelemetry_instrument_is_not_wrapped_twice(tmp_path, db_path):
    # A second wrapper would run the user's own wrapper (a Python program) under the first one's sitecustomize:
    # every instrumentation loaded twice, seconds per rollout. The user's "opentelemetry-instrument" here is a
    # shell script that tells the agent whether the real one already ran (it puts its folder on PYTHONPATH).
    wrapper = tmp_path / "bin" / "opentelemetry-instrument"
    wrapper.parent.mkdir()
    wrapper.write_text('#!/bin/sh\nexport OUTER="$(echo "$PYTHONPATH" | grep -c auto_instrumentation)"\nexec "$@"\n')
    wrapper.chmod(0o755)
    agent = tmp_path / "agent.py"
    agent.write_text("import os\nprint(os.environ.get('OUTER', 'no wrapper'), os.environ.get('PYTHONPATH', '')"
                     ".count('auto_instrumentation'))\n")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "t", "question": "q"}) + "\n")
    outputs = {}
    for command in (f"{sys.executable} {agent}", f"{wrapper} {sys.executable} {agent}"):
        summary = run_rollouts(RolloutConfig(tasks=tasks, agent=command, n=1, db=db_path,
                                             base_url="http://127.0.0.1:9/v1", rollout_timeout_s=30))
        outputs[command.split()[0]] = summary.results[0].final_output
    assert outputs == {sys.executable: "no wrapper 1", str(wrapper): "0 0"}
    assert instrumented("/x/opentelemetry-instrument", ["python", "a.py"]) == \
        ["/x/opentelemetry-instrument", "python", "a.py"]


def test_scripted_answers_walk_a_multi_turn_agent_along_its_labelled_path(engine, db_path, tmp_path):
    # The streaming plain-SDK example asks for a fix when its query fails: a script of (failing query, gold
    # query) makes it take exactly two calls, the second prompt carrying the first answer and its error.
    from transformers import AutoTokenizer

    from lightning_otel.train.sft import call_prompts, demonstration_rows

    tokenizer = AutoTokenizer.from_pretrained(engine.config.model_dir)  # the learner's tokenizer
    tasks = tmp_path / "tasks.jsonl"
    rows = [json.loads(line) for line in (bundled_data_dir() / "dev.jsonl").read_text().splitlines()
            if json.loads(line)["db_id"] == "singer"][:2]
    tasks.write_text("".join(json.dumps(r) + "\n" for r in rows))
    agent = Path(__file__).resolve().parent.parent / "examples" / "openai_sql" / "agent.py"
    answers = ["```sql\nSELECT no_such_column FROM singer\n```", "```sql\n{query}\n```"]
    summary = run_rollouts(RolloutConfig(tasks=tasks, agent=f"{sys.executable} {agent} --question {{question}} "
                                         "--db {db_path}", n=1, concurrency=2, db=db_path, reward="spider_exec",
                                         rollout_timeout_s=120, answers=answers), engine=engine)
    assert [r.status for r in summary.results] == ["ok", "ok"]
    assert [r.reward for r in summary.results] == [1.0, 1.0]  # the agent's final SQL is the scripted gold
    records = client.query("SELECT g.rollout_id, completion_ids, json_extract_string(s.attributes, "
                           "'$.\"lightning.scripted.answer\"') AS answer FROM generations g JOIN spans s "
                           "USING (trace_id, span_id) ORDER BY g.start_ns", db_path).to_dicts()
    assert len(records) == 4 and all(r["completion_ids"] == [] for r in records)
    assert sorted(r["answer"] for r in records) == sorted([answers[0]] * 2 + [f"```sql\n{t['query']}\n```"
                                                                            for t in rows])
    prompts = call_prompts(db_path, [r.rollout_id for r in summary.results])
    by_id = {t.task_id: t for t in load_tasks(tasks)}
    walked = {r.task_id: r.rollout_id for r in summary.results}
    demos, short = demonstration_rows(walked, by_id, answers, prompts, tokenizer)
    assert short == 0 and [d["turn"] for d in demos] == [0, 1, 0, 1]
    for result, first, second in zip(summary.results, demos[::2], demos[1::2]):
        fix_prompt = tokenizer.decode(second["prompt_ids"])
        assert "no_such_column" in fix_prompt and "no such column" in fix_prompt  # answer 1 and its error
        assert tokenizer.decode(first["completion_ids"], skip_special_tokens=True) == answers[0]
        assert tokenizer.decode(second["completion_ids"], skip_special_tokens=True) == \
            f"```sql\n{by_id[result.task_id].fields['query']}\n```"
    # A repair path: the wrong first answer is only there to be repaired, so only the fix is trained.
    repaired, _ = demonstration_rows(walked, by_id, answers, prompts, tokenizer, untrained=[0])
    assert [d["turn"] for d in repaired] == [1, 1] and repaired == demos[1::2]
    # A third call would be refused: a script of one answer stops the agent after its first call.
    one = run_rollouts(RolloutConfig(tasks=tasks, agent=f"{sys.executable} {agent} --question {{question}} "
                                     "--db {db_path}", n=1, db=db_path, rollout_timeout_s=120, answers=answers[:1],
                                     task_pack="spider"),
                       engine=engine)
    assert all("may make 1 model call(s)" in r.stderr_tail for r in one.results)


def test_scripted_answers_that_do_not_fit_the_tasks_fail_before_any_rollout(setup, db_path):
    agent_script, tasks = setup
    with pytest.raises(UserError, match="needs field 'nope'"):
        run_rollouts(config(agent_script, tasks, db_path, base_url=None, answers=["{nope}"]))
    with pytest.raises(UserError, match="literal braces"):
        run_rollouts(config(agent_script, tasks, db_path, base_url=None, answers=["SELECT '{'"]))
    with pytest.raises(UserError, match="non-empty list"):
        config(agent_script, tasks, db_path, base_url=None, answers=[])
    with pytest.raises(UserError, match="leave out base_url"):
        config(agent_script, tasks, db_path, answers=["{query}"])
