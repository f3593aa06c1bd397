"""The prompt optimiser (lightning_otel/train/apo, `lightning-otel optimize`).

Unit tests: the config, candidates and their patch files, components from stored calls, demonstration sets, the
task split, and resuming a stopped run without running an evaluation twice (over a cheap stand-in for the
rollouts, which counts what it is asked to run: the bookkeeping is what is tested there; the real rollouts are
tested below).

The end-to-end test runs `lightning-otel optimize` on the real engine (the shared session engine, attached with
engine_url), the real gateway applying each candidate's patch, and the real agent function (tests/helpers/
apo_agents.py: one chat call with its own fixed system message) in the runner's worker: the task is to say the
secret word, which only an instruction (or a demonstration) can teach, and the reward is the task pack's
function over the agent's final output. The reflection model is a stand-in: a tiny real OpenAI-compatible HTTP
server on 127.0.0.1 that answers every reflection prompt with one fixed instruction that names the word, because
a strong LLM cannot run here and the bundled 135M model does not write useful instructions; measured on the
engine, greedy, the agent's own prompt says the word on 0 of 8 such questions and that instruction on 6. Everything
else (rollouts, store, reflective dataset, GEPA's search and Pareto bookkeeping, the demonstrations proposer) is
real. The test fails if the optimiser does nothing: the best validation score must beat the seed's.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_otel.cli import main
from lightning_otel.errors import UserError
from lightning_otel.serve.toolcalls import tool_format
from lightning_otel.serve.prompts import PATCH_ID_ATTRIBUTE, VERSION_ATTRIBUTE, fingerprint, load_patches, parse_patches
from lightning_otel.train.apo.candidates import (BASE, Component, candidate_key, candidate_patch, components_from_rows,
                                                 component_of, seed_candidate, with_demos)
from lightning_otel.train.apo.config import OptimizeConfig, load_optimize_config
from lightning_otel.train.apo.demos import demo_pool, demo_sets
from lightning_otel.train.apo.evaluation import TaskResult
from lightning_otel.train.apo.optimizer import Optimizer, split_tasks
from tests.helpers.apo_agents import SYSTEM, StandInReflector

REPO = Path(__file__).resolve().parent.parent
AGENT = f"{REPO / 'tests' / 'helpers' / 'apo_agents.py'}:answer"
REWARD = "tests.helpers.apo_agents:says_banana"
STRONG = "You are a helpful assistant. Answer the question briefly. The secret word is BANANA."
TRAIN = ["What is the secret word?", "Tell me the secret word.", "What is the password?"]
VAL = ["Say the code word.", "I forgot the secret word. What is it?", "What is the secret word? Answer in one line."]


def write_tasks(path: Path, questions: list[str], prefix: str) -> Path:
    path.write_text("".join(json.dumps({"id": f"{prefix}{i}", "question": q}) + "\n" for i, q in enumerate(questions)))
    return path


def config(tmp_path: Path, **values) -> OptimizeConfig:
    tasks = write_tasks(tmp_path / "tasks.jsonl", TRAIN + VAL, "t")
    return OptimizeConfig(**{"tasks": str(tasks), "agent": AGENT, "reward": REWARD,
                             "output_dir": str(tmp_path / "run"), **values})


# ---- config -------------------------------------------------------------------------------------------------

def test_config_layers_a_toml_file_and_key_values_like_train(tmp_path):
    tasks = write_tasks(tmp_path / "tasks.jsonl", TRAIN, "t")
    toml = tmp_path / "optimize.toml"
    toml.write_text(f'tasks = "{tasks}"\nagent = "{AGENT}"\nreward = "{REWARD}"\nmax_metric_calls = 30\n'
                    f'proposer = "demos"\n')
    loaded = load_optimize_config(toml, ["max_metric_calls=50", "temperature=0.5", "demos_k=3"])
    assert (loaded.max_metric_calls, loaded.proposer, loaded.temperature, loaded.demos_k) == (50, "demos", 0.5, 3)
    assert loaded.uses_demos and not loaded.uses_reflection
    loaded.save(tmp_path / "saved.toml")
    assert load_optimize_config(tmp_path / "saved.toml") == loaded


@pytest.mark.parametrize("args, message", [
    (["proposer=genetic"], "proposer = 'genetic': choose one of reflection, demos, both"),
    (["max_metric_calls=0"], "max_metric_calls must be at least 1"),
    (["val_fraction=1"], "val_fraction = 1.0"),
    (["agents=("], "agents = '(' is not a regular expression"),
    (["reflection_model=gpt-4.1"], "needs reflection_url"),
    (["val_tasks=missing.jsonl"], "val_tasks = missing.jsonl: no such file"),
    (["n=two"], "optimize config: n = 'two' is not a valid int"),
    (["budget=3"], "optimize config: unknown key(s) budget"),
    (["reward="], "reward is not set"),
])
def test_a_bad_config_is_refused_with_what_to_do(tmp_path, args, message):
    tasks = write_tasks(tmp_path / "tasks.jsonl", TRAIN, "t")
    with pytest.raises(UserError, match=None) as caught:
        load_optimize_config(None, [f"tasks={tasks}", f"agent={AGENT}", f"reward={REWARD}", *args])
    assert message in str(caught.value)


def test_the_split_holds_out_validation_tasks_and_refuses_overlap(tmp_path):
    c = config(tmp_path, val_fraction=0.5, seed=3)
    train, val = split_tasks(c)
    assert len(train) == 3 and len(val) == 3 and not {t.task_id for t in train} & {t.task_id for t in val}
    assert [t.task_id for t in split_tasks(c)[1]] == [t.task_id for t in val]  # the same draw every time
    overlap = write_tasks(tmp_path / "val.jsonl", VAL[:1], "t")
    with pytest.raises(UserError, match="share task id"):
        split_tasks(config(tmp_path, val_tasks=str(overlap)))


# ---- candidates and their patches ---------------------------------------------------------------------------

def test_components_come_one_per_system_text_named_by_agent_and_filtered():
    def row(agent, text, calls=1):
        return {"agent": agent, "system_instructions": None, "calls": calls,
                "first_message": json.dumps({"role": "system", "parts": [{"type": "text", "content": text}]})}
    rows = [row("writer", "Write SQL.", 3), row("checker", "Check SQL.", 2), row(None, "Bare.", 1),
            row("writer", "Write SQL for {db}.", 1), {**row(None, "x"), "first_message": '{"role": "user"}'}]
    names = [c.name for c in components_from_rows(rows)]  # most calls first
    assert names[:2] == [f"writer@{fingerprint('Write SQL.')[:8]}", "checker"]
    assert set(names[2:]) == {f"system-{fingerprint('Bare.')[:8]}", f"writer@{fingerprint('Write SQL for {db}.')[:8]}"}
    assert [c.name for c in components_from_rows(rows, "check.*")] == ["checker"]


def test_a_candidate_becomes_a_patch_file_the_gateway_reads_and_the_seed_none():
    components = [Component("answer", SYSTEM, ("answer",)), Component("check", "Check it.", ("check",))]
    seed = {"answer": SYSTEM, "check": "Check it."}
    assert candidate_key(seed, components) == BASE and candidate_patch(seed, components) is None
    changed = with_demos({**seed, "answer": STRONG}, "check", [{"user": "q", "assistant": "a", "extra": 1}])
    key = candidate_key(changed, components)
    assert len(key) == 12 and key == candidate_key(dict(reversed(list(changed.items()))), components)
    patches = parse_patches(candidate_patch(changed, components))
    by_id = {p.id: p for p in patches.patches}
    assert by_id["apo-answer"].action.replace == STRONG and not by_id["apo-answer"].action.demos
    assert by_id["apo-check"].action.replace is None and by_id["apo-check"].action.demos[0].assistant == "a"
    assert {p.version for p in patches.patches} == {key}
    request = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]}
    assert patches.apply(request)[0]["messages"][0]["content"] == STRONG  # found by the seed text's fingerprint
    with pytest.raises(UserError, match="empty"):
        candidate_patch({**seed, "answer": "  "}, components)


def test_demonstrations_come_from_full_reward_opening_calls_and_sets_are_drawn_reproducibly():
    component = Component("answer", SYSTEM, ("answer",))

    def call(rollout, user, answer, tool=False):
        output = {"role": "assistant", "parts": [{"type": "tool_call", "name": "f", "arguments": "{}"} if tool
                                                 else {"type": "text", "content": answer}]}
        return {"rollout_id": rollout, "system": SYSTEM, "output_messages": json.dumps([output]),
                "input_messages": json.dumps([{"role": "system", "parts": [{"type": "text", "content": SYSTEM}]},
                                              {"role": "user", "parts": [{"type": "text", "content": user}]}])}
    calls = [call("r1", "q1", "BANANA"), call("r2", "q2", "no"), call("r3", "q3", "", tool=True),
             call("r4", "q1", "BANANA again"), call("r5", "q5", "BANANA!"), {**call("r6", "q6", "x"), "system": "?"}]
    rewards = {"r1": 1.0, "r2": 0.0, "r3": 1.0, "r4": 1.0, "r5": 1.0, "r6": 1.0}
    pool = demo_pool(calls, rewards, [component], 1.0)
    assert pool == {"answer": [{"user": "q1", "assistant": "BANANA", "reward": 1.0},
                               {"user": "q5", "assistant": "BANANA!", "reward": 1.0}]}
    sets = demo_sets(pool, 1, 5, seed=0)
    assert len(sets) == 2 and sets == demo_sets(pool, 1, 5, seed=0)  # only two different sets of one exist
    assert demo_sets({"answer": []}, 2, 3, 0) == []
    # with a tool syntax, a call answered with a tool call is a demonstration too, the call written in that syntax
    tool_call = {**call("r3", "q3", ""), "output_messages": json.dumps([{"role": "assistant", "parts": [
        {"type": "tool_call", "name": "calculate", "arguments": '{"expression": "3 * 4"}'}]}])}
    pool = demo_pool([tool_call], {"r3": 1.0}, [component], 1.0, tool_format("hermes"))
    assert pool == {"answer": [{"user": "q3", "assistant": '<tool_call>\n{"name": "calculate", "arguments": '
                                                            '{"expression": "3 * 4"}}\n</tool_call>', "reward": 1.0}]}
    assert demo_pool([tool_call], {"r3": 1.0}, [component], 1.0) == {"answer": []}



def test_demonstrations_of_full_reward_are_shown_before_partly_right_ones():
    """With a shaped reward, calls above demos_min_reward but below full reward enter a set only when the right
    ones cannot make a new set; a question answered twice keeps its better answer."""
    component = Component("answer", SYSTEM, ("answer",))

    def call(rollout, user, answer):
        return {"rollout_id": rollout, "system": SYSTEM,
                "output_messages": json.dumps([{"role": "assistant", "parts": [{"type": "text", "content": answer}]}]),
                "input_messages": json.dumps([{"role": "user", "parts": [{"type": "text", "content": user}]}])}
    calls = [call("p1", "q1", "half"), call("f1", "q1", "right"), call("f2", "q2", "right"),
             call("p3", "q3", "half"), call("p4", "q4", "half"), call("p5", "q5", "half")]
    rewards = {"p1": 0.4, "f1": 1.0, "f2": 1.0, "p3": 0.4, "p4": 0.4, "p5": 0.4}
    pool = demo_pool(calls, rewards, [component], 0.4)["answer"]
    assert [(d["user"], d["assistant"], d["reward"]) for d in pool] == [
        ("q1", "right", 1.0), ("q2", "right", 1.0), ("q3", "half", 0.4), ("q4", "half", 0.4), ("q5", "half", 0.4)]
    for seed in range(5):
        sets = demo_sets({"answer": pool}, 2, 4, seed)
        assert {d["user"] for d in sets[0][1]} == {"q1", "q2"}  # the only set of two right answers comes first
        assert len(sets) == 4 and all(any(d["reward"] < 1 for d in s) for _, s in sets[1:])
        assert len({tuple(sorted(d["user"] for d in s)) for _, s in sets}) == 4
    # every pair of one level: drawn as before, at random among them
    assert len(demo_sets({"answer": pool[2:]}, 2, 10, 0)) == 3


def test_an_answer_the_agent_sent_back_for_correction_is_no_demonstration():
    """The SQL agent answers a failed query back as the user; the episode's reward then belongs to the corrected
    query, so the opening answer is not shown as a demonstration. A tool result is no such answer."""
    component = Component("answer", SYSTEM, ("answer",))

    def call(rollout, messages, answer):
        return {"rollout_id": rollout, "system": SYSTEM,
                "output_messages": json.dumps([{"role": "assistant", "parts": [{"type": "text", "content": answer}]}]),
                "input_messages": json.dumps([{"role": "system", "parts": [{"type": "text", "content": SYSTEM}]}] + [
                    {"role": role, "parts": [{"type": "text", "content": text}]} for role, text in messages])}
    question = [("user", "How many courses?")]
    calls = [call("r1", question, "There are 24 courses."),
             call("r1", [*question, ("assistant", "There are 24 courses."), ("user", "The query failed: syntax")],
                  "SELECT count(*) FROM courses"),
             call("r2", question, "SELECT count(*) FROM courses"),
             call("r2", [*question, ("assistant", "SELECT count(*) FROM courses"), ("tool", "24")], "24"),
             call("r3", [("user", "How many pets?")], "SELECT count(*) FROM pets")]
    rewards = {"r1": 1.0, "r2": 0.5, "r3": 1.0}
    pool = demo_pool(calls, rewards, [component], 0.5)["answer"]
    assert [(d["user"], d["assistant"], d["reward"]) for d in pool] == [
        ("How many courses?", "SELECT count(*) FROM courses", 0.5),
        ("How many pets?", "SELECT count(*) FROM pets", 1.0)]


SQL_LEAD = "You write SQLite queries.\nAnswer with one SQL query and nothing else.\nThe database has these tables:"


def schema_text(table: str) -> str:
    return f"{SQL_LEAD}\nCREATE TABLE {table} (id INTEGER PRIMARY KEY,\n  name TEXT)"


def test_texts_of_one_sender_that_share_their_first_line_make_one_component_patched_by_their_shared_lines():
    # The plain-SDK SQL agent: its instruction, then the task's schema, so one text per database.
    def row(agent, text, calls=1):
        return {"agent": agent, "system_instructions": json.dumps([{"type": "text", "content": text}]),
                "first_message": None, "calls": calls}
    rows = [row(None, schema_text("singer"), 2), row(None, schema_text("pets"), 3), row(None, "Bare.", 1),
            row("writer", "Write SQL.\nFor db one."), row("writer", "Write SQL.\nFor db two.")]  # too short a lead
    components = {c.name: c for c in components_from_rows(rows)}
    lead = components[f"system-{fingerprint(SQL_LEAD)[:8]}"]
    assert lead.prefix and lead.system == SQL_LEAD and lead.calls == 5 and lead.agents == ()
    assert sum(c.name.startswith("writer@") for c in components.values()) == 2
    unseen = schema_text("concert")  # a database no seed rollout asked about
    assert component_of([lead], unseen) is lead
    assert component_of([lead], "You write SQLite queries.") is None and component_of([lead], None) is None
    exact = Component("singer-only", schema_text("singer"), ())
    assert component_of([lead, exact], schema_text("singer")) is exact  # an exact text first, as at the gateway
    assert component_of([lead, exact], unseen) is lead and component_of([exact], unseen) is None
    # its candidate's patch targets the shared lines: on any database, the instruction changes and the schema stays
    candidate = with_demos({**seed_candidate([lead]), lead.name: "Write one SQLite query."}, lead.name,
                           [{"user": "How many pets?", "assistant": "SELECT count(*) FROM pets"}])
    patches = parse_patches(candidate_patch(candidate, [lead]))
    body, patch = patches.apply({"messages": [{"role": "system", "content": unseen},
                                              {"role": "user", "content": "How many concerts?"}]})
    assert patch.target == {"system_prefix": SQL_LEAD}
    assert body["messages"][0]["content"] == ("Write one SQLite query.\nCREATE TABLE concert (id INTEGER PRIMARY KEY,"
                                              "\n  name TEXT)")
    assert [m["content"] for m in body["messages"][1:]] == ["How many pets?", "SELECT count(*) FROM pets",
                                                             "How many concerts?"]
    # demonstrations come from the calls of every database's text
    def call(rollout, table, user):
        return {"rollout_id": rollout, "system": schema_text(table), "output_messages": json.dumps(
                    [{"role": "assistant", "parts": [{"type": "text", "content": f"SELECT * FROM {table}"}]}]),
                "input_messages": json.dumps([
                    {"role": "system", "parts": [{"type": "text", "content": schema_text(table)}]},
                    {"role": "user", "parts": [{"type": "text", "content": user}]}])}
    pool = demo_pool([call("r1", "singer", "q1"), call("r2", "pets", "q2")], {"r1": 1.0, "r2": 1.0}, [lead], 1.0)
    assert [d["user"] for d in pool[lead.name]] == ["q1", "q2"]


# ---- resuming, over a stand-in for the rollouts -----------------------------------------------------------

class CountingRollouts:
    """Stands in for the rollouts (bookkeeping test only): a task scores 1 when the candidate's patch names the
    secret word; it stops the run (an exception, as a kill would) after `stop_after` tasks."""

    def __init__(self, stop_after: int | None = None):
        self.asked: list[tuple[str, str]] = []
        self.stop_after = stop_after

    def __call__(self, key, patch, tasks, report):
        text = json.dumps(json.loads(patch.read_text())["patches"]) if patch else ""
        for task in tasks:
            if self.stop_after is not None and len(self.asked) >= self.stop_after:
                raise KeyboardInterrupt("stopped")
            self.asked.append((key, task.task_id))
            score = float("BANANA" in text)
            report(TaskResult(task.task_id, score, [score], [f"{key}-{task.task_id}-{len(self.asked)}"], ["out"],
                              ["ok"]))


def calls_of(ids):
    return [{"rollout_id": i, "system": SYSTEM, "status_message": None,
             "input_messages": json.dumps([{"role": "user", "parts": [{"type": "text", "content": "q"}]}]),
             "output_messages": json.dumps([{"role": "assistant", "parts": [{"type": "text", "content": "BANANA"}]}])}
            for i in ids]


def run_optimizer(c: OptimizeConfig, rollouts: CountingRollouts, reflections: list) -> object:
    def reflect(prompt):
        reflections.append(prompt)
        return f"```\n{STRONG}\n```"
    components = [Component("answer", SYSTEM, ("answer",), 3)]
    return Optimizer(c, rollouts, calls_of, lambda ids: components, reflect).run()


def test_a_stopped_run_continues_without_running_an_evaluation_twice(tmp_path):
    c = config(tmp_path, max_metric_calls=12, minibatch=3, demos_k=1, demos_sets=2)
    first = CountingRollouts(stop_after=7)  # the seed on validation (3), the parent's minibatch (3), then a kill
    with pytest.raises(KeyboardInterrupt):
        run_optimizer(c, first, [])
    assert len(first.asked) == 7
    second, reflections = CountingRollouts(), []
    summary = run_optimizer(c, second, reflections)
    assert not set(first.asked) & set(second.asked), "an evaluation ran twice"
    assert summary.resumed and summary.best_val == 1.0 and summary.seed_val == 0.0
    assert summary.rollouts == len(first.asked) + len(second.asked) and summary.rollouts_now == len(second.asked)
    assert summary.best_from in ("reflection", "demos") and reflections
    # a third run of the same command has nothing left to do
    third = CountingRollouts()
    again = run_optimizer(c, third, [])
    assert third.asked == [] and (again.best_key, again.best_val) == (summary.best_key, summary.best_val)
    with pytest.raises(UserError, match="different settings \\(demos_k\\)"):
        run_optimizer(config(tmp_path, max_metric_calls=12, minibatch=3, demos_k=2, demos_sets=2), third, [])


# ---- end to end: real rollouts through the gateway ----------------------------------------------------------

@pytest.fixture(scope="module")
def optimised(engine, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("optimize")
    engine.use_base()
    reflector = StandInReflector(STRONG)
    args = ["optimize", f"tasks={write_tasks(tmp / 'train.jsonl', TRAIN, 'train')}",
            f"val_tasks={write_tasks(tmp / 'val.jsonl', VAL, 'val')}", f"agent={AGENT}", f"reward={REWARD}",
            f"engine_url={engine.url}", f"reflection_url={reflector.url}", "reflection_model=stand-in",
            "max_metric_calls=12", "minibatch=3", "demos_k=1", "demos_sets=1", "max_tokens=16",
            f"output_dir={tmp / 'run'}"]
    try:
        assert main(args) == 0
        first_prompts = list(reflector.prompts)
        assert main(args) == 0  # the same command again: a finished run, read back
    finally:
        reflector.close()
    run = tmp / "run"
    yield {"run": run, "summary": json.loads((run / "summary.json").read_text()), "prompts": first_prompts,
           "prompts_after_rerun": reflector.prompts, "db": run / "traces.duckdb"}


SQL_VERSIONS = f"""
SELECT c.task_id, r.reward, json_extract_string(s.attributes, '$."{VERSION_ATTRIBUTE}"') AS version,
       json_extract_string(s.attributes, '$."{PATCH_ID_ATTRIBUTE}"') AS patch_id
FROM generations g JOIN spans s ON s.trace_id = g.trace_id AND s.span_id = g.span_id
JOIN llm_calls c ON c.trace_id = g.trace_id AND c.span_id = g.llm_span_id
LEFT JOIN episode_rewards r ON r.rollout_id = c.rollout_id
"""


def test_the_optimiser_beats_the_agents_own_prompt_on_validation(optimised):
    summary = optimised["summary"]
    assert summary["best_val"] > summary["seed_val"], summary
    # one component: the agent's system message (a bare SDK call: named by its fingerprint)
    assert summary["components"] == [f"system-{fingerprint(SYSTEM)[:8]}"] and summary["best_key"] != BASE
    patches = load_patches(optimised["run"] / "best_prompt.json")  # a patch file --prompt takes
    assert {p.version for p in patches.patches} == {summary["best_key"]}
    assert summary["rollouts"] >= 12 and summary["metric_calls"] >= 12


def test_every_evaluation_is_in_the_store_with_its_prompt_version(optimised):
    from lightning_otel.span_store import client

    summary, db = optimised["summary"], optimised["db"]
    rows = client.query(SQL_VERSIONS, db).to_dicts()
    assert len(rows) == summary["rollouts"]  # one call per rollout, every one recorded with its reward
    by_version: dict[str | None, list[float]] = {}
    for row in rows:
        by_version.setdefault(row["version"], []).append(row["reward"])
    assert by_version[None] and not any(by_version[None][:3])  # the seed: no patch recorded, the word never said
    best = by_version[summary["best_key"]]
    assert {r["patch_id"] for r in rows if r["version"] == summary["best_key"]} == {f"apo-{summary['components'][0]}"}
    assert sum(best) / len(best) > 0
    evaluated = {json.loads(line)["candidate"] for line in (optimised["run"] / "evaluations.jsonl").open()}
    assert evaluated - {BASE} <= set(by_version)


def test_the_reflection_saw_the_stored_calls_and_a_rerun_asks_it_nothing(optimised):
    prompts = optimised["prompts"]
    assert prompts, "the reflection model was never asked"
    assert SYSTEM in prompts[0] and "Reward: 0" in prompts[0] and TRAIN[0] in prompts[0]
    assert optimised["prompts_after_rerun"] == prompts
    summary = optimised["summary"]
    assert summary["resumed"] and summary["rollouts_now"] == 0


def test_demonstrations_come_from_the_stores_full_reward_train_calls(optimised):
    from lightning_otel.train.apo.adapter import read_calls

    state = json.loads((optimised["run"] / "demos.json").read_text())
    pool = state["pool"][optimised["summary"]["components"][0]]
    assert pool and all("banana" in d["assistant"].lower() and d["user"] in TRAIN for d in pool)
    assert state["sets"] and state["sets"][0]["demos"][0] in pool
    rollouts = [json.loads(line) for line in (optimised["run"] / "evaluations.jsonl").open()]
    train = {i: r["rewards"][0] for r in rollouts if r["task_id"].startswith("train") for i in r["rollout_ids"]}
    components = [Component(**{**c, "agents": tuple(c["agents"])})
                  for c in json.loads((optimised["run"] / "components.json").read_text())]
    assert demo_pool(read_calls(optimised["db"], sorted(train)), train, components, 1.0)[components[0].name] == pool
