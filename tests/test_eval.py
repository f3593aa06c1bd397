"""The evaluator on real parts: the plain-OpenAI example agent (examples/openai_sql) under the rollout
runner, the bundled model on the shared vLLM engine, spider_exec, a DuckDB store. The report's numbers
are recounted here from the store with this file's own SQL; model resolution runs on real folders
(a LoRA adapter saved with peft on the bundled model)."""
from __future__ import annotations

import json
import math
import shutil
import sqlite3
import sys
from pathlib import Path

import duckdb
import pytest

from lightning_otel.cli import main
from lightning_otel.errors import UserError
from lightning_otel.eval import EvalConfig, evaluate
from lightning_otel.eval.metrics import outcomes_by_version, sign_test_p, wilson_interval
from lightning_otel.eval.report import (comparison_rows, paired_comparison, paired_line, read_rounds,
                                        terminal_summary)
from lightning_otel.serve.model import bundled_model_dir
from lightning_otel.serve.policy import resolve_policy
from lightning_otel.span_store import client
from lightning_otel.tasks.spider import PACK as SPIDER
from lightning_otel.tasks.spider.outcomes import SQL_RAN
from lightning_otel.tasks.spider.rewards import bundled_data_dir, database_path

pytestmark = pytest.mark.usefixtures("plain_sdk_agents")  # its agents use the plain OpenAI SDK (conftest.py)

REPO = Path(__file__).resolve().parent.parent
AGENT = f"{sys.executable} {REPO / 'examples' / 'openai_sql' / 'agent.py'} --question {{question}} --db {{db_path}}"
REWARD = "spider_exec"
MAX_TOKENS = 48  # below the agent's own 96, so the cap shows in the token records


def spider_tasks(wanted: list[str], dbs: tuple[str, ...] = ("singer", "poker_player", "network_1")) -> list[dict]:
    """The first bundled dev questions of the wanted hardness levels (in order) over small databases."""
    rows = [json.loads(line) for line in (bundled_data_dir() / "dev.jsonl").read_text().splitlines()]
    picked: list[dict] = []
    for level in wanted:
        picked.append(next(r for r in rows if r["hardness"] == level and r["db_id"] in dbs and r not in picked))
    return picked


def write_tasks(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def base_eval(engine, tmp_path_factory):
    """One evaluation of the bundled model over 5 tasks, shared by the tests that read its report."""
    folder = tmp_path_factory.mktemp("eval-base")
    tasks = write_tasks(folder / "tasks.jsonl", spider_tasks(["easy", "easy", "medium", "hard", "extra"]))
    config = EvalConfig(tasks=tasks, agent=AGENT, report=folder / "report", model="base", n=1, reward=REWARD,
                        max_tokens=MAX_TOKENS, rollout_timeout_s=240, concurrency=5)
    before = (engine.model_name, engine.policy_version)
    result = evaluate(config, engine=engine)
    assert (engine.model_name, engine.policy_version) == before
    return config, result


def own_percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), written out."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


RECOUNT = """
SELECT r.rollout_id, r.status, r.final_output, (r.ended_ns - r.started_ns) / 1e9 AS seconds,
       json_extract_string(t.fields, '$.hardness') AS hardness, json_extract_string(t.fields, '$.db_id') AS db_id,
       (SELECT max(w.value) FROM rewards w WHERE w.rollout_id = r.rollout_id AND w.name = 'spider_exec') AS reward,
       (SELECT count(*) FROM spans s WHERE s.rollout_id = r.rollout_id AND s.name = 'openai.chat') AS chats,
       (SELECT list(json_array_length(json_extract(s.attributes, '$."lightning.completion.token_ids"')))
        FROM spans s WHERE s.rollout_id = r.rollout_id AND s.name = 'lightning.generate') AS completion_lengths,
       (SELECT sum(json_array_length(json_extract(s.attributes, '$."lightning.prompt.token_ids"')))
        FROM spans s WHERE s.rollout_id = r.rollout_id AND s.name = 'lightning.generate') AS prompt_tokens
FROM rollout_runs r JOIN tasks t ON t.task_id = r.task_id
"""


def test_report_numbers_match_a_recount_from_the_store(base_eval):
    config, result = base_eval
    summary = result.summary
    with duckdb.connect(str(config.db), read_only=True) as con:
        cursor = con.execute(RECOUNT)
        names = [d[0] for d in cursor.description]
        rows = [dict(zip(names, row)) for row in cursor.fetchall()]
    assert len(rows) == 5 == summary["rollouts"]
    assert sorted(r["rollout_id"] for r in rows) == sorted(result.rollout_ids)
    assert all(r["reward"] in (0.0, 1.0) for r in rows)  # every task has a gold query: all scored

    correct = sum(r["reward"] == 1.0 for r in rows)
    overall = summary["accuracy"]["overall"]
    assert (overall["rollouts"], overall["scored"], overall["correct"]) == (5, 5, correct)
    assert overall["accuracy"] == pytest.approx(correct / 5)
    assert overall["ci95"] == pytest.approx(list(wilson_interval(correct, 5)))
    for level in ("easy", "medium", "hard", "extra"):
        mine = [r for r in rows if r["hardness"] == level]
        entry = summary["accuracy"]["by_group"][level]
        assert entry["rollouts"] == len(mine)
        assert entry["correct"] == sum(r["reward"] == 1.0 for r in mine)
    assert list(summary["accuracy"]["by_group"]) == ["easy", "medium", "hard", "extra"]

    assert all(1 <= r["chats"] <= 3 for r in rows)  # the agent makes at most three calls
    tpe = summary["transitions_per_episode"]
    assert tpe["mean"] == pytest.approx(sum(r["chats"] for r in rows) / 5)
    assert tpe["histogram"] == {str(k): sum(r["chats"] == k for r in rows) for k in {r["chats"] for r in rows}}
    assert all(len(r["completion_lengths"]) == r["chats"] for r in rows)  # one token record per call
    assert all(0 < n <= MAX_TOKENS for r in rows for n in r["completion_lengths"])  # the cap held
    completion = [sum(r["completion_lengths"]) for r in rows]
    assert summary["tokens_per_episode"]["completion"] == pytest.approx(sum(completion) / 5)
    assert summary["tokens_per_episode"]["prompt"] == pytest.approx(sum(r["prompt_tokens"] for r in rows) / 5)
    seconds = [r["seconds"] for r in rows]
    assert summary["latency"]["rollout_s"]["p50"] == pytest.approx(own_percentile(seconds, 0.5))
    assert summary["latency"]["rollout_s"]["p90"] == pytest.approx(own_percentile(seconds, 0.9))
    assert summary["latency"]["llm_call_ms"]["calls"] == sum(r["chats"] for r in rows)

    classes = summary["failure_classes"]
    assert sum(classes.values()) == 5 and classes["correct"] == correct
    assert classes["agent_error"] == sum(r["status"] in ("failed", "error") and r["reward"] == 0.0 for r in rows)
    by_id = {e["rollout_id"]: e["failure_class"] for e in summary["episodes"]}
    for row in rows:
        if by_id[row["rollout_id"]] in ("sql_error", "wrong_result"):  # re-run the final SQL here
            con = sqlite3.connect(database_path(bundled_data_dir(), row["db_id"]))
            try:
                con.execute(row["final_output"]).fetchall()
                ran = True
            except sqlite3.Error:
                ran = False
            finally:
                con.close()
            assert ran == (by_id[row["rollout_id"]] == "wrong_result"), row["final_output"]


def test_report_files(base_eval):
    config, result = base_eval
    report = config.report
    saved = json.loads((report / "summary.json").read_text())
    assert saved["config"]["tasks"] == str(config.tasks) and saved["config"]["max_tokens"] == MAX_TOKENS
    assert saved["policy"]["label"] == "base" and saved["policy"]["adapter"] is None
    assert saved["accuracy"] == result.summary["accuracy"]
    text = (report / "report.md").read_text()
    overall = result.summary["accuracy"]["overall"]
    assert f"{100 * overall['accuracy']:.1f}%" in text and "| extra |" in text
    for name in ("accuracy.png", "transitions_per_episode.png"):
        assert (report / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({name})" in text
    assert not (report / "reward_by_round.png").exists()  # not a run folder: no rounds to plot
    assert saved["rounds"] == []


MAKE_PEFT_ADAPTER = """
import sys, torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                              init_lora_weights=False, task_type="CAUSAL_LM"))
peft_model.save_pretrained(sys.argv[2])
"""


@pytest.fixture(scope="module")
def peft_adapter(tmp_path_factory) -> Path:
    """A real PEFT LoRA adapter (random, non-zero B) on the bundled model, saved by peft itself."""
    import subprocess
    out = tmp_path_factory.mktemp("peft") / "adapter"
    made = subprocess.run([sys.executable, "-c", MAKE_PEFT_ADAPTER, str(bundled_model_dir()), str(out)],
                          capture_output=True, text=True, timeout=600)
    assert made.returncode == 0, made.stderr[-2000:]
    assert (out / "adapter_config.json").is_file()
    return out


def make_run(root: Path, adapter: Path, run: dict, rounds: list[dict] | None = None) -> Path:
    """A training run folder as the trainer writes it: run.json, checkpoints/round-NNNN/adapter, metrics."""
    for name in ("round-0002", "round-0007"):
        shutil.copytree(adapter, root / "checkpoints" / name / "adapter")
    (root / "run.json").write_text(json.dumps(run))
    if rounds is not None:
        (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    return root


def test_eval_of_a_run_serves_its_best_checkpoint_and_compares_with_a_baseline(engine, base_eval, peft_adapter,
                                                                                 tmp_path):
    base_config, base_result = base_eval
    rounds = [{"round": i, "reward_mean": 0.1 * i, "reward_std": 0.05} for i in range(1, 4)]
    run = make_run(tmp_path / "run", peft_adapter, {"model": "base", "best": "checkpoints/round-0007",
                                                    "last": "checkpoints/round-0002"}, rounds)
    tasks = write_tasks(tmp_path / "tasks.jsonl", spider_tasks(["easy", "medium"]))
    before = (engine.model_name, engine.policy_version)
    config = EvalConfig(tasks=tasks, agent=AGENT, report=tmp_path / "report", model=str(run), n=1, reward=REWARD,
                        max_tokens=24, baseline=base_config.report, rollout_timeout_s=240)
    summary = evaluate(config, engine=engine).summary
    assert (engine.model_name, engine.policy_version) == before  # the shared engine is left as found

    assert summary["policy"]["adapter"] == str(run / "checkpoints" / "round-0007" / "adapter")
    assert summary["policy"]["version"] == 7 and summary["policy"]["label"] == "run/checkpoints/round-0007"
    with duckdb.connect(str(config.db), read_only=True) as con:
        versions = con.execute("SELECT policy_version, rollout_id, request_model, count(*) FROM generations "
                               "GROUP BY ALL ORDER BY ALL").fetchall()
        runs = con.execute("SELECT policy_version, rollout_id, status FROM rollout_runs ORDER BY ALL").fetchall()
    assert runs and all(r[0] == 7 for r in runs), runs
    assert {v[1] for v in versions} == {r[1] for r in runs}, (versions, runs)
    assert all(v[0] == 7 for v in versions), versions  # every generation came from the adapter

    assert summary["rounds"] == rounds
    assert (config.report / "reward_by_round.png").read_bytes()[:4] == b"\x89PNG"
    baseline = json.loads((base_config.report / "summary.json").read_text())
    rows = {r["metric"]: r for r in summary["baseline"]["comparison"]}
    ours, theirs = summary["accuracy"]["overall"]["accuracy"], baseline["accuracy"]["overall"]["accuracy"]
    assert rows["accuracy (all)"] == {"metric": "accuracy (all)", "value": ours, "baseline": theirs,
                                      "delta": pytest.approx(ours - theirs)}
    assert rows["accuracy (extra)"]["value"] is None and rows["accuracy (extra)"]["delta"] is None
    assert rows["transitions per episode (mean)"]["delta"] == pytest.approx(
        summary["transitions_per_episode"]["mean"] - baseline["transitions_per_episode"]["mean"])
    text = (config.report / "report.md").read_text()
    assert "## Against the baseline: base" in text and "| accuracy (all) |" in text
    # Task by task: a recount from the two evaluations' own stores (the baseline's tasks are a superset).
    rates = []
    for store, ids in ((config.db, summary), (base_config.db, baseline)):
        with duckdb.connect(str(store), read_only=True) as con:
            rows = con.execute("SELECT r.task_id, avg(CASE WHEN w.value = 1.0 THEN 1.0 ELSE 0.0 END) FROM rollouts r "
                               "JOIN rewards w ON w.rollout_id = r.rollout_id AND w.name = 'spider_exec' "
                               "AND w.span_id IS NULL WHERE r.rollout_id IN (SELECT unnest(?)) GROUP BY r.task_id",
                               [[e["rollout_id"] for e in ids["episodes"]]]).fetchall()
        rates.append(dict(rows))
    common = set(rates[0]) & set(rates[1])
    paired = summary["baseline"]["paired"]
    assert paired["tasks"] == len(common) == len(rates[0]) > 0
    assert paired["better"] == sum(rates[0][t] > rates[1][t] for t in common)
    assert paired["worse"] == sum(rates[0][t] < rates[1][t] for t in common)
    assert paired["only_baseline"] == len(set(rates[1]) - common) and paired["only_here"] == 0
    assert f"Paired on the {len(common)} tasks both scored" in text


# ---- model resolution on real folders ---------------------------------------------------------------

def test_base_is_the_bundled_model():
    policy = resolve_policy("base")
    assert policy.base_model == bundled_model_dir() and policy.adapter is None and policy.version == 0


@pytest.mark.heavy
def test_run_folder_means_its_best_checkpoint_else_its_last(peft_adapter, tmp_path):
    run = make_run(tmp_path / "a", peft_adapter, {"model": "base", "best": "checkpoints/round-0007",
                                                  "last": "checkpoints/round-0002"})
    policy = resolve_policy(str(run))
    assert policy.adapter == run / "checkpoints" / "round-0007" / "adapter"
    assert policy.base_model == bundled_model_dir() and policy.version == 7 and policy.run_dir == run
    run = make_run(tmp_path / "b", peft_adapter, {"model": "base", "best": None, "last": "checkpoints/round-0002"})
    policy = resolve_policy(run)
    assert policy.adapter == run / "checkpoints" / "round-0002" / "adapter" and policy.version == 2


def test_checkpoint_and_adapter_folders(peft_adapter, tmp_path):
    own_base = tmp_path / "my-base"
    own_base.mkdir()
    shutil.copy(bundled_model_dir() / "config.json", own_base / "config.json")
    run = make_run(tmp_path / "run", peft_adapter, {"model": str(own_base), "best": "checkpoints/round-0007"})
    checkpoint = run / "checkpoints" / "round-0002"
    by_checkpoint = resolve_policy(checkpoint)
    assert by_checkpoint.adapter == checkpoint / "adapter" and by_checkpoint.base_model == own_base
    by_adapter = resolve_policy(checkpoint / "adapter")  # run.json three levels up names the base
    assert by_adapter.adapter == checkpoint / "adapter" and by_adapter.base_model == own_base
    assert by_adapter.version == 2

    # A lone adapter: its config's base when that is a local model folder, else the bundled model.
    alone = tmp_path / "alone"
    shutil.copytree(peft_adapter, alone)
    config = json.loads((alone / "adapter_config.json").read_text())
    (alone / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(own_base)}))
    assert resolve_policy(alone).base_model == own_base
    (alone / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path":
                                                           "HuggingFaceTB/SmolLM2-135M-Instruct"}))
    lone = resolve_policy(alone)
    assert lone.base_model == bundled_model_dir() and lone.adapter == alone and lone.version == 1


def test_full_model_folders(tmp_path):
    full = tmp_path / "run" / "checkpoints" / "round-0003" / "model"
    full.mkdir(parents=True)
    shutil.copy(bundled_model_dir() / "config.json", full / "config.json")
    policy = resolve_policy(full.parent)
    assert (policy.base_model, policy.adapter, policy.version) == (full, None, 3)
    assert resolve_policy(bundled_model_dir()).base_model == bundled_model_dir()


@pytest.mark.parametrize("setup,needle", [
    (lambda p: p / "missing", "no such folder"),
    (lambda p: (p / "file.txt").write_text("x") and p / "file.txt", "is a file"),
    (lambda p: p, "found no run.json, adapter/, model/"),
    (lambda p: (p / "run.json").write_text('{"model": "base"}') and p, "names no checkpoint"),
    (lambda p: (p / "run.json").write_text('{"model": "base", "rounds_without_step": 2}') and p,
     "its 2 round\\(s\\) took no optimizer step, so it trained nothing"),
    (lambda p: (p / "run.json").write_text('{"best": "checkpoints/round-0009"}') and p, "is not a folder"),
    (lambda p: (p / "run.json").write_text("{oops") and p, "is not JSON"),
    (lambda p: (p / "adapter_config.json").write_text('{"peft_type": "PREFIX_TUNING"}') and p, "only LoRA"),
])
def test_unusable_model_specs_say_what_was_expected(tmp_path, setup, needle):
    with pytest.raises(UserError, match=needle):
        resolve_policy(setup(tmp_path))


def test_unknown_model_name_fails_before_an_engine_starts(tmp_path):
    tasks = write_tasks(tmp_path / "t.jsonl", spider_tasks(["easy"]))
    with pytest.raises(UserError, match="expected 'base' \\(the bundled model\\), a training run folder"):
        evaluate(EvalConfig(tasks=tasks, agent=AGENT, report=tmp_path / "r", reward=REWARD, model="gpt-4o"))
    assert not (tmp_path / "r" / "traces.duckdb").exists()


# ---- bad inputs ---------------------------------------------------------------------------------------

def test_bad_inputs_give_clear_errors(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(UserError, match="has no tasks"):
        evaluate(EvalConfig(tasks=empty, agent=AGENT, report=tmp_path / "r", reward=REWARD))
    with pytest.raises(UserError, match="tasks = .*nope.jsonl: no such file"):
        EvalConfig(tasks=tmp_path / "nope.jsonl", agent=AGENT, report=tmp_path / "r", reward=REWARD)
    tasks = write_tasks(tmp_path / "t.jsonl", spider_tasks(["easy"]))
    with pytest.raises(UserError, match="no summary.json"):
        EvalConfig(tasks=tasks, agent=AGENT, report=tmp_path / "r", reward=REWARD, baseline=tmp_path)
    with pytest.raises(UserError, match="at least 1"):
        EvalConfig(tasks=tasks, agent=AGENT, report=tmp_path / "r", reward=REWARD, n=0)
    with pytest.raises(UserError, match="agent command not found"):
        evaluate(EvalConfig(tasks=tasks, agent="no-such-agent {question}", report=tmp_path / "r", reward=REWARD))


def test_cli_reports_bad_inputs_without_traceback(tmp_path, capsys):
    code = main(["eval", "--tasks", str(tmp_path / "nope.jsonl"), "--agent", AGENT, "--report", str(tmp_path),
                 "--reward", REWARD])
    assert code == 2
    err = capsys.readouterr().err
    assert "no such file" in err and "Traceback" not in err


def test_eval_needs_a_reward_and_names_the_option(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--tasks", str(tmp_path / "t.jsonl"), "--agent", AGENT, "--report", str(tmp_path)])
    assert exit_info.value.code == 2 and "--reward" in capsys.readouterr().err


def test_running_engine_must_serve_the_policy_base(engine, tmp_path):
    other = tmp_path / "other-model"
    other.mkdir()
    shutil.copy(bundled_model_dir() / "config.json", other / "config.json")
    tasks = write_tasks(tmp_path / "t.jsonl", spider_tasks(["easy"]))
    with pytest.raises(UserError, match="the running engine serves"):
        evaluate(EvalConfig(tasks=tasks, agent=AGENT, report=tmp_path / "r", reward=REWARD, model=str(other)),
                 engine=engine)


# ---- pure parts ----------------------------------------------------------------------------------------

def test_wilson_interval_on_hand_computed_values():
    # p = 0.5, n = 10, z = 1.96: centre 0.5, half-width 1.96 * sqrt(0.025 + 0.0096) / 1.384 = 0.2634
    assert wilson_interval(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    # p = 0, n = 10: upper bound z^2/n / (1 + z^2/n) = 0.38416 / 1.38416 = 0.2775
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson_interval(0, 0) is None
    # the ends are exact for every n (rounding once left 0 of 3 at 5.6e-17 and broke the plot's error bars)
    assert all(wilson_interval(0, n)[0] == 0.0 and wilson_interval(n, n)[1] == 1.0 for n in range(1, 500))


def test_the_accuracy_plot_draws_none_and_all_correct_levels(tmp_path):
    from lightning_otel.eval.metrics import accuracy_entry
    from lightning_otel.eval.plots import plot_accuracy

    accuracy = {"overall": accuracy_entry(13, 13, 3), "by_group": {"easy": accuracy_entry(3, 3, 0),
                                                                  "hard": accuracy_entry(10, 10, 3)}}
    assert accuracy["by_group"]["easy"]["accuracy"] == 0.0
    summary = {"policy": {"label": "base"}, "accuracy": accuracy}
    path = plot_accuracy(summary, {"policy": {"label": "other"}, "accuracy": {
        "overall": accuracy_entry(7, 7, 7), "by_hardness": {"easy": accuracy_entry(7, 7, 7)}}}, tmp_path / "a.png")
    assert path.stat().st_size > 1000


def test_failure_classes_from_status_output_and_re_execution():
    data = bundled_data_dir()

    def row(**kw) -> dict:
        return {"reward": 0.0, "status": "ok", "final_output": "SELECT Name FROM singer", "db_id": "singer", **kw}

    classify = SPIDER.outcome
    assert classify(row(reward=None), data) == "unscored"
    assert classify(row(reward=1.0, status="failed"), data) == "correct"
    assert classify(row(status="timeout"), data) == "timeout"
    assert classify(row(status="failed"), data) == "agent_error"
    assert classify(row(final_output=None), data) == "no_sql"
    assert classify(row(final_output="There are 6 singers in the table."), data) == "no_sql"
    assert classify(row(final_output="```sql SELECT nope FROM singer```"), data) == "sql_error"
    assert classify(row(final_output="SELECT Name FROM singer"), data) == "wrong_result"
    assert list(SPIDER.report_classes()) == ["correct", "wrong_result", "sql_error", "no_sql", "agent_error",
                                             "timeout", "unscored"]


def test_comparison_rows_are_value_minus_baseline():
    def summary(acc: float, easy: float | None, calls: float) -> dict:
        by_group = {} if easy is None else {"easy": {"accuracy": easy}}
        return {"accuracy": {"overall": {"accuracy": acc}, "by_group": by_group}, "rollouts": 4,
                "transitions_per_episode": {"mean": calls, "p50": 1.0},
                "tokens_per_episode": {"prompt": 100.0, "completion": 20.0, "total": 120.0},
                "latency": {"rollout_s": {"p50": 1.0, "p90": 2.0}, "llm_call_ms": {"p50": 5.0, "p90": 9.0}},
                "failure_classes": {"correct": 2, "wrong_result": 2}}

    rows = {r["metric"]: r for r in comparison_rows(summary(0.5, 0.75, 2.0), summary(0.25, None, 1.5))}
    assert rows["accuracy (all)"]["delta"] == pytest.approx(0.25)
    assert rows["accuracy (easy)"] == {"metric": "accuracy (easy)", "value": 0.75, "baseline": None, "delta": None}
    assert rows["transitions per episode (mean)"]["delta"] == pytest.approx(0.5)
    assert rows["share correct"]["value"] == 0.5 and rows["share correct"]["delta"] == 0.0


def test_the_sign_test_is_mcnemars_exact_test_on_discordant_pairs():
    # Values as scipy.stats.binomtest(k, n, 0.5).pvalue gives them (two-sided).
    assert sign_test_p(4, 1) == pytest.approx(0.375)
    assert sign_test_p(13, 3) == pytest.approx(0.0212708, abs=1e-6)
    assert sign_test_p(9, 21) == sign_test_p(21, 9) == pytest.approx(0.0427739, abs=1e-6)
    assert sign_test_p(0, 6) == pytest.approx(2 / 64)
    assert sign_test_p(3, 3) == sign_test_p(0, 0) == 1.0
    assert sign_test_p(19, 0) == pytest.approx(2 / 2 ** 19)
    assert sign_test_p(3, 5) == sign_test_p(5, 3) == pytest.approx(2 * (1 + 8 + 28 + 56) / 256)


def test_outcomes_by_version_read_each_tasks_best_episode_reward_per_policy_version(make_collector, db_path):
    make_collector().close()  # the store's file, written without a collector
    runs = [("ro-1", "t1", 0, 0.0), ("ro-2", "t1", 0, 1.0), ("ro-3", "t2", 0, 0.6), ("ro-4", "t1", 4, 0.0),
            ("ro-5", "t2", 4, 1.0), ("ro-6", "t3", 4, 1.0), ("ro-7", "t2", 8, None)]
    client.write_records(db_path, "rollout_runs", [
        {"rollout_id": r, "task_id": t, "attempt": 0, "policy_version": v, "status": "ok"} for r, t, v, _ in runs])
    client.write_records(db_path, "rewards", [{"rollout_id": r, "name": "number_match", "value": w,
                                               "source": "function"} for r, _, _, w in runs if w is not None])
    # t1 right at version 0 (one of its two samples), t3 not asked for, version 8 never rewarded
    assert outcomes_by_version(db_path, {"t1", "t2"}) == {0: {"t1": 1.0, "t2": 0.0}, 4: {"t1": 0.0, "t2": 1.0}}
    assert outcomes_by_version(db_path, set()) == {}


def test_paired_comparison_goes_task_by_task():
    def summary(*episodes: tuple[str, float | None]) -> dict:
        return {"episodes": [{"task_id": task, "reward": reward} for task, reward in episodes]}

    # With -n 2 a task's share of right samples is compared; unscored episodes do not count; tasks in one
    # evaluation only are left out and counted.
    ours = summary(("a", 1.0), ("a", 0.0), ("b", 1.0), ("b", 1.0), ("c", 0.0), ("c", None), ("d", 0.0), ("e", 1.0))
    theirs = summary(("a", 0.0), ("a", 0.0), ("b", 1.0), ("b", 1.0), ("c", 1.0), ("d", 0.0), ("f", 1.0))
    paired = paired_comparison(ours, theirs)
    assert paired == {"tasks": 4, "better": 1, "worse": 1, "same": 2, "p_value": 1.0, "only_here": 1,
                      "only_baseline": 1}
    line = paired_line(paired)
    assert line.startswith("Paired on the 4 tasks both scored: better on 1, worse on 1, the same on 2; exact sign "
                           "test p = 1") and "1 tasks only here and 1 only in the baseline left out" in line
    apart = paired_comparison(summary(("x", 1.0)), summary(("y", 0.0)))
    assert apart["tasks"] == 0 and apart["p_value"] is None
    assert "evaluate both on the same task file" in paired_line(apart)


def test_paired_comparison_can_count_outcome_classes_instead_of_right_answers():
    def summary(*episodes: tuple[str, float | None, str]) -> dict:
        return {"episodes": [{"task_id": task, "reward": reward, "failure_class": outcome}
                             for task, reward, outcome in episodes]}

    # Counting "the SQL runs" (correct or wrong_result): a fix from an error to other rows is a win there and
    # no change in accuracy; an unscored episode still does not count.
    ours = summary(("a", 0.0, "wrong_result"), ("b", 1.0, "correct"), ("c", 0.0, "sql_error"),
                   ("d", None, "unscored"))
    theirs = summary(("a", 0.0, "sql_error"), ("b", 0.0, "wrong_result"), ("c", 0.0, "wrong_result"),
                     ("d", None, "unscored"))
    runs = paired_comparison(ours, theirs, SQL_RAN)
    assert set(SQL_RAN) == {"correct", "wrong_result"}
    assert (runs["tasks"], runs["better"], runs["worse"], runs["same"]) == (3, 1, 1, 1)
    right = paired_comparison(ours, theirs)
    assert (right["tasks"], right["better"], right["worse"], right["same"]) == (3, 1, 0, 2)


def test_the_terminal_summary_gives_accuracy_with_its_interval_and_the_paired_comparison():
    def summary(label: str, rewards: list[float]) -> dict:
        correct = int(sum(rewards))
        entry = {"rollouts": len(rewards), "scored": len(rewards), "correct": correct,
                 "accuracy": correct / len(rewards), "ci95": list(wilson_interval(correct, len(rewards)))}
        return {"policy": {"label": label}, "rollouts": len(rewards), "reward": "spider_exec",
                "accuracy": {"overall": entry, "by_group": {"easy": entry}},
                "transitions_per_episode": {"mean": 2.0, "p50": 2.0},
                "tokens_per_episode": {"prompt": 90.0, "completion": 10.0, "total": 100.0},
                "latency": {"rollout_s": {}, "llm_call_ms": {}},
                "failure_classes": {"correct": correct, "sql_error": len(rewards) - correct, "timeout": 0},
                "episodes": [{"task_id": f"t{i}", "reward": r} for i, r in enumerate(rewards)]}

    ours, theirs = summary("run/checkpoints/round-0002", [1.0] * 6 + [0.0] * 4), summary("base", [0.0] * 10)
    ours["baseline"] = {"label": "base", "comparison": comparison_rows(ours, theirs),
                        "paired": paired_comparison(ours, theirs)}
    lines = terminal_summary(ours).splitlines()
    assert lines[0] == "policy run/checkpoints/round-0002: accuracy 60.0% [31.3, 83.2] (6/10) (spider_exec = 1)"
    assert lines[1].split() == ["easy", "60.0%", "[31.3,", "83.2]", "(6/10)"]
    assert lines[2] == "transitions per episode 2.00, tokens per episode 100; outcomes: correct=6, sql_error=4"
    assert lines[3] == "against baseline base: accuracy +60.0 points"
    assert lines[4].strip() == ("Paired on the 10 tasks both scored: better on 6, worse on 0, the same on 4; "
                                "exact sign test p = 0.0312.")
    assert "against baseline" not in terminal_summary(theirs)


def test_rounds_come_from_grpo_lines_of_metrics_jsonl(tmp_path):
    lines = [{"phase": "sft", "round": 0, "reward_mean": 0.9}, {"phase": "grpo", "round": 2, "reward_mean": 0.5},
             {"phase": "grpo", "round": 1, "reward_mean": 0.25, "reward_std": 0.1}, {"round": 3}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + "{not json\n")
    assert read_rounds(tmp_path) == [{"round": 1, "reward_mean": 0.25, "reward_std": 0.1},
                                     {"round": 2, "reward_mean": 0.5, "reward_std": None}]
    assert read_rounds(tmp_path / "elsewhere") == [] and read_rounds(None) == []
