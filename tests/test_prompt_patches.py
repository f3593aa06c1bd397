"""Prompt patches (lightning_otel/serve/prompts.py, prompt_export.py): matching by system-message fingerprint and
by agent name, replace / extend / demonstrations, calls of other agents untouched, bad patch files; the agents
map derived from the stored traces of LangGraph's SQL tutorial (examples/langgraph_sql_tutorial, against a
scripted model, no engine); export-prompt; and, over the real engine, that the engine gets the patched prompt of
the targeted agent only and the token records carry the patch's version and id.

The engine test sends the tutorial's two system messages (its generate_query and check_query nodes) through the
gateway from the plain OpenAI SDK (chat, streamed chat and Responses), not the tutorial's graph: the graph on the
135M model takes minutes, and which node a call came from is, at the gateway, only its system message; that
the tutorial's nodes send exactly those messages is what the stored-traces test shows.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from lightning_otel.cli import main
from lightning_otel.errors import UserError
from lightning_otel.serve import prompt_export
from lightning_otel.serve.prompts import (PATCH_ID_ATTRIBUTE, VERSION_ATTRIBUTE, fingerprint, load_patches,
                                          parse_patches)
from tests.helpers.examples import example_module

TUTORIAL = example_module("langgraph_sql_tutorial")
GENERATE, CHECK = TUTORIAL.GENERATE_QUERY, TUTORIAL.CHECK_QUERY
APPEND = "Always name the columns you select; never SELECT *."
DEMO = {"user": "How many heads of departments are older than 56?",
        "assistant": "SELECT count(*) FROM head WHERE age > 56"}


def tutorial_patches(**action) -> dict:
    return {"agents": {"generate_query": {"system": GENERATE}, "check_query": {"system": CHECK}},
            "patches": [{"id": "gq-names", "version": "2", "target": {"agent": "generate_query"},
                         "action": action or {"append": APPEND, "demos": [DEMO]}}]}


def chat(system: str | None, question: str = "How many singers do we have?") -> dict:
    messages = [{"role": "system", "content": system}] if system is not None else []
    return {"model": "gpt-4o", "messages": messages + [{"role": "user", "content": question}]}


def write(path: Path, data) -> Path:
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


# ---- matching and applying ------------------------------------------------------------------------------

def test_a_fingerprint_is_the_short_sha256_of_the_text_with_its_whitespace_made_single_spaces():
    assert fingerprint("You are  a\n helpful\tagent. ") == hashlib.sha256(b"You are a helpful agent.").hexdigest()[:16]
    assert fingerprint(GENERATE) != fingerprint(CHECK)


def test_a_patch_by_agent_name_changes_that_agents_calls_and_leaves_the_other_nodes_untouched():
    patches = parse_patches(tutorial_patches())
    body = chat(GENERATE)
    sent = json.loads(json.dumps(body))
    patched, patch = patches.apply(body)
    assert patch.id == "gq-names" and patch.record() == {VERSION_ATTRIBUTE: "2", PATCH_ID_ATTRIBUTE: "gq-names"}
    assert patched["messages"] == [{"role": "system", "content": GENERATE + "\n\n" + APPEND},
                                   {"role": "user", "content": DEMO["user"]},
                                   {"role": "assistant", "content": DEMO["assistant"]},
                                   {"role": "user", "content": "How many singers do we have?"}]
    assert body == sent  # the client's request itself is not changed
    for other in (chat(CHECK), chat(None), chat("You are someone else.")):
        unchanged, none = patches.apply(other)
        assert none is None and unchanged is other


def test_replace_prepend_and_a_target_by_fingerprint_on_parts_and_developer_messages():
    target = {"system_sha256": fingerprint(CHECK)}
    replaced = parse_patches({"patches": [{"id": "r", "version": 1, "target": target,
                                           "action": {"replace": "Check the SQL."}}]})
    parts = {"messages": [{"role": "developer", "content": [{"type": "text", "text": CHECK + "\n"}]},
                          {"role": "user", "content": "SELECT 1"}]}
    body, patch = replaced.apply(parts)
    assert patch.version == "1" and body["messages"][0]["content"] == "Check the SQL."
    prepended = parse_patches({"patches": [{"id": "p", "version": "a", "target": target,
                                            "action": {"prepend": "Be careful."}}]})
    assert prepended.apply(chat(CHECK))[0]["messages"][0]["content"] == "Be careful.\n\n" + CHECK
    # the whole 64-digit sha256 is a fingerprint too
    full = parse_patches({"patches": [{"id": "f", "version": "1", "target": {
        "system_sha256": hashlib.sha256(" ".join(CHECK.split()).encode()).hexdigest()}, "action": {"append": "x"}}]})
    assert full.apply(chat(CHECK))[1].id == "f" and full.apply(chat(GENERATE))[1] is None


def test_demonstrations_go_after_every_opening_system_message_and_leave_the_system_text_alone():
    patches = parse_patches(tutorial_patches(demos=[DEMO, {"user": "u2", "assistant": "a2"}]))
    body = {"messages": [{"role": "system", "content": GENERATE}, {"role": "system", "content": "Dialect: sqlite"},
                         {"role": "user", "content": "q"}]}
    patched, _ = patches.apply(body)
    assert [m["role"] for m in patched["messages"]] == ["system", "system", "user", "assistant", "user",
                                                        "assistant", "user"]
    assert patched["messages"][0]["content"] == GENERATE and patched["messages"][-1]["content"] == "q"
    only_system = patches.apply({"messages": [{"role": "system", "content": GENERATE}]})[0]
    assert [m["content"] for m in only_system["messages"][1:]] == [DEMO["user"], DEMO["assistant"], "u2", "a2"]


def test_an_agent_with_several_system_texts_is_matched_by_each_and_a_toml_file_reads_the_same(tmp_path):
    data = {"agents": {"writer": {"system_sha256": [fingerprint("Write SQL for db one."),
                                                    fingerprint("Write SQL for db two.")]}},
            "patches": [{"id": "w", "version": "3", "target": {"agent": "writer"}, "action": {"append": "Be short."}}]}
    patches = load_patches(write(tmp_path / "p.json", data))
    assert all(patches.apply(chat(f"Write SQL for db {n}."))[1] is not None for n in ("one", "two"))
    assert patches.apply(chat("Write SQL for db three."))[1] is None
    toml = load_patches(write(tmp_path / "p.toml", f"""
[agents.writer]
system_sha256 = {json.dumps(data["agents"]["writer"]["system_sha256"])}

[[patches]]
id = "w"
version = 3
target = {{ agent = "writer" }}
action = {{ append = "Be short." }}
"""))
    assert toml.patches == patches.patches


SCHEMA_AGENT = "You write SQLite queries. Answer with one SQL query.\nThe database has these tables:\n"


def test_a_prefix_target_patches_every_text_that_starts_with_it_and_replace_keeps_each_calls_rest():
    # The plain-SDK SQL agent's system message is its instruction, then the task's schema: one text per database.
    instruction = "You write SQLite queries.  Answer with one SQL query."  # whitespace differs from the agent's
    one, two = SCHEMA_AGENT + "CREATE TABLE singer (id INT)", SCHEMA_AGENT + "CREATE TABLE pets (id INT)"
    patches = parse_patches({"patches": [{"id": "sql", "version": "4", "target": {"system_prefix": instruction},
                                          "action": {"replace": "Write one SQLite query in a sql block.",
                                                     "demos": [DEMO]}}]})
    for text, schema in ((one, "singer"), (two, "pets")):
        body, patch = patches.apply(chat(text))
        assert patch.id == "sql" and patch.record()[VERSION_ATTRIBUTE] == "4"
        assert body["messages"][0]["content"] == ("Write one SQLite query in a sql block.\nThe database has these "
                                                  f"tables:\nCREATE TABLE {schema} (id INT)")
        assert [m["content"] for m in body["messages"][1:3]] == [DEMO["user"], DEMO["assistant"]]
    for other in ("You write SQLite", "You write Postgres queries. Answer with one SQL query.", None):
        assert patches.apply(chat(other))[1] is None
    appended = parse_patches({"patches": [{"id": "a", "version": "1", "target": {"system_prefix": instruction},
                                           "action": {"append": "Never SELECT *."}}]})
    assert appended.apply(chat(one))[0]["messages"][0]["content"] == one + "\n\nNever SELECT *."
    # an exact fingerprint wins over a prefix, whatever their order in the file
    both = parse_patches({"patches": [{"id": "p", "version": "1", "target": {"system_prefix": instruction},
                                       "action": {"append": "x"}},
                                      {"id": "f", "version": "1", "target": {"system_sha256": fingerprint(two)},
                                       "action": {"append": "y"}}]})
    assert both.apply(chat(two))[1].id == "f" and both.apply(chat(one))[1].id == "p"
    # export-prompt writes the instruction a prefix patch makes (the per-task rest is not the agent's to keep)
    assert (prompt_export.patched_prompt(patches.patches[0], patches)["system"]
            == "Write one SQLite query in a sql block.")
    assert prompt_export.patched_prompt(appended.patches[0], appended)["system"] == instruction + "\n\nNever SELECT *."
    assert patches.patches[0].target_label == f"system_prefix {' '.join(instruction.split())[:45] + '...'!r}"


# ---- bad patch files ------------------------------------------------------------------------------------

GOOD = {"id": "a", "version": "1", "target": {"agent": "generate_query"}, "action": {"append": "x"}}
AGENTS = {"generate_query": {"system": GENERATE}}


@pytest.mark.parametrize("data, needle", [
    ({"agents": AGENTS, "patches": [{**GOOD, "colour": "red"}]}, "patch 0 ('a'): unknown key(s) 'colour'"),
    ({"agents": AGENTS, "patches": [{k: v for k, v in GOOD.items() if k != "target"}]}, "missing target"),
    ({"agents": AGENTS, "patches": [{**GOOD, "target": {}}]}, "the target names one of agent"),
    ({"agents": AGENTS, "patches": [{**GOOD, "target": {"agent": "check_query"}}]},
     "targets agent 'check_query', which \"agents\" does not list (generate_query)"),
    ({"agents": AGENTS, "patches": [{**GOOD, "target": {"system_sha256": "xyz"}}]}, "must be 16 to 64 hex digits"),
    ({"agents": AGENTS, "patches": [{**GOOD, "action": {"replace": "a", "append": "b"}}]}, "replace gives the whole"),
    ({"agents": AGENTS, "patches": [{**GOOD, "action": {}}]}, "the action is empty"),
    ({"agents": AGENTS, "patches": [{**GOOD, "action": {"demos": [{"user": "q"}]}}]}, "demos[0] has no assistant"),
    ({"agents": AGENTS, "patches": [{**GOOD, "action": {"append": "  "}}]}, "'append' must be a non-empty text"),
    ({"agents": AGENTS, "patches": [{**GOOD, "version": True}]}, "version must be"),
    ({"agents": AGENTS, "patches": [GOOD, {**GOOD, "id": "b"}]}, "patches 'a' (agent generate_query) and 'b'"),
    ({"agents": AGENTS, "patches": [GOOD, {**GOOD, "target": {"system_sha256": fingerprint(CHECK)}}]},
     "two patches have the id 'a'"),
    ({"agents": {**AGENTS, "twin": {"system": GENERATE + "  "}}, "patches": [GOOD]},
     "agents 'generate_query' and 'twin' send the same system message"),
    ({"agents": {"generate_query": {}}, "patches": [GOOD]}, "agents.generate_query: give the agent's system"),
    ({"agents": AGENTS, "patches": []}, "\"patches\" must be a non-empty list"),
    ({"agents": AGENTS, "patch": [GOOD]}, "unknown key(s) 'patch'; the keys are agents, patches"),
    ([GOOD], "the patch file must be an object, not list"),
    ({"patches": [{**GOOD, "target": {"system_prefix": " \n"}}]}, "'system_prefix' must be a non-empty text"),
    ({"patches": [{**GOOD, "target": {"system_prefix": "You write"}},
                  {**GOOD, "id": "b", "target": {"system_prefix": "You  write SQL"}}]},
     "patches 'a' (system_prefix 'You write') and 'b' (system_prefix 'You write SQL') target the same"),
])
def test_a_bad_patch_file_is_refused_naming_the_file_and_the_mistake(tmp_path, data, needle):
    path = write(tmp_path / "patches.json", data)
    with pytest.raises(UserError) as caught:
        load_patches(path)
    assert str(caught.value).startswith(str(path)) and needle in str(caught.value), str(caught.value)


def test_a_file_that_is_no_json_or_missing_is_refused_with_where(tmp_path):
    path = write(tmp_path / "broken.json", '{"patches": [\n  {"id": "a",}\n]}')
    with pytest.raises(UserError, match=r"broken.json: not valid JSON \(line 2, column 14"):
        load_patches(path)
    with pytest.raises(UserError, match="not valid TOML"):
        load_patches(write(tmp_path / "broken.toml", "[[patches]\n"))
    with pytest.raises(UserError, match="absent.json: no such file"):
        load_patches(tmp_path / "absent.json")


def test_commands_and_configs_refuse_a_bad_patch_file_before_anything_starts(tmp_path, capsys):
    from lightning_otel.cli import build_parser
    from lightning_otel.rollouts.runner import RolloutConfig
    from lightning_otel.train.config import TrainConfig

    bad = write(tmp_path / "bad.json", {"patches": [{"id": "a"}]})
    good = write(tmp_path / "good.json", tutorial_patches())
    tasks = write(tmp_path / "t.jsonl", '{"question": "q"}\n')
    with pytest.raises(UserError, match="missing version, target, action"):
        RolloutConfig(tasks=tasks, agent="a", prompt=bad)
    # an outside endpoint takes a patch too: the gateway forwards to it with the patch applied (test_closed_models)
    assert RolloutConfig(tasks=tasks, agent="a", prompt=good, base_url="http://127.0.0.1:9/v1").prompts is not None
    assert RolloutConfig(tasks=tasks, agent="a", prompt=good).prompts.patches[0].id == "gq-names"
    with pytest.raises(UserError, match="missing version"):
        TrainConfig(prompt=str(bad))
    assert TrainConfig(prompt=str(good)).prompt == str(good)
    parser = build_parser()
    for command in (["rollout", "--tasks", "t", "--agent", "a"], ["serve", "base"],
                    ["eval", "--tasks", "t", "--agent", "a", "--report", "r", "--reward", "x"], ["train"]):
        assert parser.parse_args([*command, "--prompt", str(good)]).prompt == good
    assert main(["rollout", "--tasks", str(tasks), "--agent", "a", "--prompt", str(bad)]) == 2
    assert "bad.json: patch 0 ('a'): missing version" in capsys.readouterr().err
    assert main(["train", "--offline", "--db", str(tmp_path / "t.duckdb"), "--prompt", str(good),
                 f"output_dir={tmp_path / 'run'}"]) == 2
    assert "--offline runs none" in capsys.readouterr().err


# ---- export-prompt ----------------------------------------------------------------------------------------

def test_export_prompt_writes_the_patched_system_text_and_demonstrations(tmp_path, capsys):
    path = write(tmp_path / "p.json", tutorial_patches())
    assert main(["export-prompt", str(path)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# patch gq-names (version 2), agent generate_query\n\n## system\n" + GENERATE)
    assert f"{APPEND}\n\n## demonstration 1: user\n{DEMO['user']}\n" in text
    out = tmp_path / "winner.json"
    assert main(["export-prompt", str(path), "--id", "gq-names", "--format", "json", "--out", str(out)]) == 0
    winner = json.loads(out.read_text())
    assert winner["system"] == GENERATE + "\n\n" + APPEND and winner["demos"] == [DEMO]
    assert winner["messages"][0] == {"role": "system", "content": winner["system"]} and len(winner["messages"]) == 3
    assert main(["export-prompt", str(path), "--id", "nope"]) == 2
    assert "no patch with id 'nope'; its patches are gq-names" in capsys.readouterr().err
    # an extension of a system text the file does not hold needs a store that does
    by_sum = write(tmp_path / "s.json", {"patches": [{"id": "s", "version": "1", "target": {
        "system_sha256": fingerprint(GENERATE)}, "action": {"append": APPEND}}]})
    assert main(["export-prompt", str(by_sum)]) == 2
    assert "is not known here" in capsys.readouterr().err


@pytest.mark.heavy
def test_the_agents_map_comes_from_the_tutorials_stored_traces_and_targets_only_its_node(tmp_path, capsys):
    """The real tutorial graph under the LangChain instrumentation, against a scripted model (no engine): the
    agents its calls are stored under, and the system message each sent, give the patch file's map."""
    from lightning_otel.rollouts.runner import RolloutConfig, run_rollouts
    from test_inprocess import singer_tasks, write_tasks
    from test_langgraph_sql_tutorial import EXAMPLE, StubModel

    stub = StubModel()
    try:
        tasks = write_tasks(tmp_path / "tasks.jsonl", singer_tasks(1))
        db = tmp_path / "traces.duckdb"
        summary = run_rollouts(RolloutConfig(tasks=tasks, agent=f"{EXAMPLE}:run", n=1, concurrency=1, db=db,
                                             base_url=stub.base_url, task_pack="spider", rollout_timeout_s=120))
    finally:
        stub.shutdown()
    assert summary.results[0].status == "ok", summary.results[0]
    rows = {r["agent"]: r for r in prompt_export.agent_prompts(db)}
    # call_get_schema sends no system message (only the conversation): it cannot be targeted, and is not listed
    assert set(rows) == {"generate_query", "check_query"}, rows
    assert (rows["generate_query"]["system"], rows["check_query"]["system"]) == (GENERATE, CHECK)
    assert rows["generate_query"]["system_sha256"] == fingerprint(GENERATE)
    out = tmp_path / "patches.json"
    assert main(["export-prompt", "--db", str(db), "--format", "json", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data == {"agents": {"check_query": {"system": CHECK}, "generate_query": {"system": GENERATE}},
                    "patches": []}
    data["patches"] = tutorial_patches()["patches"]
    patches = load_patches(write(out, data))
    # the requests the tutorial's nodes sent the model: only generate_query's are patched
    for request in stub.requests:
        patched, patch = patches.apply(request)
        system = request["messages"][0]["content"] if request["messages"][0]["role"] == "system" else None
        assert (patch is not None) == (system == GENERATE), request["messages"][0]
        assert patch is not None or patched is request
    assert any(r["messages"][0].get("content") == GENERATE for r in stub.requests)
    assert main(["export-prompt", "--db", str(db)]) == 0
    assert f"# agent check_query: system_sha256 {fingerprint(CHECK)}, " in capsys.readouterr().out


# ---- over the real engine ---------------------------------------------------------------------------------

SQL_RECORDS = """
SELECT g.response_id, g.prompt_ids,
       json_extract_string(s.attributes, '$."lightning.prompt.version"') AS version,
       json_extract_string(s.attributes, '$."lightning.prompt.patch_id"') AS patch_id
FROM generations g JOIN spans s ON s.trace_id = g.trace_id AND s.span_id = g.span_id
"""


def test_the_engine_gets_the_patched_prompt_of_the_targeted_agent_only(engine, collector, db_path, tmp_path):
    import openai

    from lightning_otel.serve.gateway import Gateway, GatewayConfig
    from lightning_otel.span_store import client

    engine.use_base()
    patches = load_patches(write(tmp_path / "p.json", tutorial_patches()))
    gateway = Gateway(engine, GatewayConfig(collector_url=collector.url, prompts=patches))
    gateway.start()
    try:
        sdk = openai.OpenAI(base_url=gateway.base_url("ro-patch"), api_key="k")
        question = "How many singers do we have?"
        ids = {}
        for name, system in (("generate", GENERATE), ("check", CHECK)):
            ids[name] = sdk.chat.completions.create(model="gpt-4o", max_tokens=4,
                                                    messages=chat(system, question)["messages"]).id
        stream = sdk.chat.completions.create(model="gpt-4o", max_tokens=4, stream=True,
                                             messages=chat(GENERATE, question)["messages"])
        ids["streamed"] = {chunk.id for chunk in stream}.pop()
        ids["responses"] = sdk.responses.create(model="gpt-4o", instructions=GENERATE, input=question,
                                                max_output_tokens=16).id
    finally:
        gateway.close()  # flushes the records
    records = {r["response_id"]: r for r in client.query(SQL_RECORDS, db_path).to_dicts()}
    patched_ids = engine.tokenize_chat({"messages": patches.apply(chat(GENERATE, question))[0]["messages"],
                                        "add_generation_prompt": True})["tokens"]
    plain_ids = engine.tokenize_chat({"messages": chat(CHECK, question)["messages"],
                                      "add_generation_prompt": True})["tokens"]
    for name in ("generate", "streamed", "responses"):
        record = records[ids[name]]
        assert (record["version"], record["patch_id"]) == ("2", "gq-names"), name
        assert record["prompt_ids"] == patched_ids, name
    check = records[ids["check"]]
    assert (check["version"], check["patch_id"]) == (None, None) and check["prompt_ids"] == plain_ids
    # what SQL compares: calls per prompt version, unpatched ones as "base"
    versions = client.query("SELECT coalesce(version, 'base') AS version, count(*) AS n FROM (" + SQL_RECORDS
                            + ") GROUP BY 1 ORDER BY 1", db_path).to_dicts()
    assert versions == [{"version": "2", "n": 3}, {"version": "base", "n": 1}]
