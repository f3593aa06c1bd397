"""The benchmark scripts' own logic, what they do beyond the package (tests/ tests the package and imports no
benchmark): plain_sft's prompts are the LangGraph agent's calls and it saves a model folder the agent run starts
from; spider_agent refuses what it cannot run; the Spider task-file writers run; math_difficulty's probe changes
only the agent's instructions; the AVX2 emulation (benchmarks/avx2/emulate.sh) hides what it says it hides.
pytest collects this file with tests/ (testpaths in pyproject.toml)."""
from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.wheel import venv_seeing_these_packages

REPO = Path(__file__).resolve().parent.parent


def run_module(module: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m <module> args` from the repository root, as the scripts are run."""
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)


def bundled_dir() -> Path:
    from lightning_otel.serve.engine import default_engine_python
    from lightning_otel.serve.model import bundled_model_dir

    return bundled_model_dir(python=default_engine_python(REPO))


def test_plain_sfts_review_prompt_is_the_agents_reviewer_call_on_the_gold_query():
    from transformers import AutoTokenizer

    from benchmarks.peers import plain_sft
    from lightning_otel.tasks.spider.rewards import bundled_data_dir, database_path

    data = bundled_data_dir()
    row = {"db_id": "singer", "question": "How many singers are there?", "query": "SELECT  count(*)\nFROM singer"}
    text = plain_sft.Prompts(AutoTokenizer.from_pretrained(bundled_dir()), data).text(row, review=True)
    schema = plain_sft.read_schema(str(database_path(data, "singer")))
    assert plain_sft.CHECK.format(schema=schema).split("\n")[0] in text
    # the query on one line as the agent passes it on, and what SQLite returned for it on the real database
    with sqlite3.connect(database_path(data, "singer")) as conn:
        count = conn.execute("SELECT count(*) FROM singer").fetchone()[0]
    assert f"Question: How many singers are there?\nQuery: SELECT count(*) FROM singer\nResult: [({count},)]" in text
    first = plain_sft.Prompts(AutoTokenizer.from_pretrained(bundled_dir()), data).text(row)
    assert "Result:" not in first and "You write SQLite queries" in first
    # the prompts are the example's own: its file, loaded under a name of its own
    assert Path(plain_sft.SQL_AGENT.__file__) == REPO / "examples" / "sql_agent" / "agent.py"


@pytest.mark.heavy
def test_plain_sft_save_writes_a_fine_tuned_model_folder_with_its_chat_template(tmp_path):
    from safetensors.torch import load_file

    from lightning_otel.serve.model import is_model_dir

    out, saved = tmp_path / "out", tmp_path / "model"
    proc = run_module("benchmarks.peers.plain_sft", "--out", str(out), "--sft-tasks", "3", "--review", "1",
                      "--batch", "4", "--micro-batch", "4", "--epochs", "1", "--eval-tasks", "3", "--no-answers",
                      "--save", str(saved), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "4 examples" in proc.stdout  # 3 queries and 1 review
    report = json.loads((out / "plain_sft.json").read_text())
    assert len(report["losses"]) == 1 and "held_out" not in report  # one step of 4; answers skipped
    assert is_model_dir(saved)
    assert json.loads((saved / "tokenizer_config.json").read_text()).get("chat_template") or \
        (saved / "chat_template.jinja").is_file()
    before, after = load_file(bundled_dir() / "model.safetensors"), load_file(saved / "model.safetensors")
    assert before.keys() == after.keys()
    assert any(not before[k].float().equal(after[k].float()) for k in before)  # trained, not a copy


def test_spider_agent_from_sft_needs_the_fine_tuned_model_folder(tmp_path):
    proc = run_module("benchmarks.learning.spider_agent", "--out", str(tmp_path), "--from-sft")
    assert proc.returncode == 2 and "--from-sft starts from the fine-tuned --model folder" in proc.stderr


def test_spider_agent_refuses_a_negative_round_count(tmp_path):
    proc = run_module("benchmarks.learning.spider_agent", "--out", str(tmp_path), "--rounds", "-1")
    assert proc.returncode == 2 and "--rounds -1: give 0 (evaluate the SFT policy only)" in proc.stderr


def test_the_spider_task_file_writers_chain_synthesis_repair_and_renaming(tmp_path):
    from lightning_otel.tasks.spider.rewards import spider_exec
    from lightning_otel.tasks.spider.splits import read_rows

    synth, repair, renamed = tmp_path / "synth.jsonl", tmp_path / "repair.jsonl", tmp_path / "renamed"
    for module, args in [("spider_synth", ["--out", str(synth), "--per-db", "6", "--db", "world_1", "network_1"]),
                         ("spider_repair", ["--tasks", str(synth), "--out", str(repair), "--count", "4"]),
                         ("spider_rename", ["--tasks", str(synth), "--out", str(renamed), "--count", "4"])]:
        proc = run_module(f"benchmarks.learning.{module}", *args)
        assert proc.returncode == 0, proc.stderr[-2000:]
    rows = read_rows(synth)
    assert len(rows) == 12 and {r["db_id"] for r in rows} == {"world_1", "network_1"}
    assert [r["id"].removesuffix("-repair") for r in read_rows(repair)] == [rows[i]["id"] for i in (0, 6, 1, 7)]
    moved = read_rows(renamed / "renamed.jsonl")
    assert len(moved) == 4 and all(r["db_id"].endswith("_renamed") for r in moved)
    assert all(spider_exec(r, {"final_output": r["query"], "data_dir": str(renamed)}) == 1.0 for r in moved)


def test_the_difficulty_probe_changes_only_the_agents_instructions(tmp_path):
    """math_difficulty's three-example cell: a module the worker imports as the agent function, the example
    agent with other instructions and nothing else changed."""
    from benchmarks import math_difficulty

    example = REPO / "examples" / "openai_agents_math" / "agent.py"
    assert math_difficulty.agent_spec(tmp_path, None) == f"{example}:run"
    instructions = math_difficulty.three_examples()
    assert instructions.count("<tool_call>") == 3 and '"expression": "30 - 8 + 5"' in instructions
    spec = math_difficulty.agent_spec(tmp_path, instructions)
    path, function = spec.rsplit(":", 1)
    # Loaded as the agent worker loads a file (lightning_otel.capture.agent_fn), in a process of its own; `run` is
    # the example's own function, so its globals are the example module the wrapper changed.
    probe = subprocess.run([sys.executable, "-c", f"""import importlib.util
from lightning_otel.capture.agent_fn import load_agent_function, parse_agent_function
changed = load_agent_function(parse_agent_function({spec!r})).__globals__
spec = importlib.util.spec_from_file_location("unchanged", {str(example)!r})
unchanged = importlib.util.module_from_spec(spec)
spec.loader.exec_module(unchanged)
constants = lambda names: {{n: v for n, v in names.items() if isinstance(v, (str, int, float)) and n != "__name__"}}
print(changed["__file__"] == {str(example)!r}, changed["INSTRUCTIONS"] == {instructions!r}, changed["TOOL_CHOICE"],
      constants(changed) == {{**constants(vars(unchanged)), "INSTRUCTIONS": {instructions!r}}},
      set(changed) == set(vars(unchanged)))"""], capture_output=True, text=True, cwd=tmp_path)
    assert probe.stdout.split() == ["True", "True", "required", "True", "True"], probe.stderr[-2000:]
    assert Path(path).parent == tmp_path and function == "run"


@pytest.mark.parametrize("name", ["math", "spider"])
def test_each_apo_vs_grpo_task_writes_the_train_and_test_files_the_report_reads(tmp_path, name):
    from benchmarks.learning.arm_tasks import TASKS, task_ids

    pool, test = TASKS[name].write_tasks(tmp_path / "tasks", 8, 6, 0)
    assert (pool, test) == (tmp_path / "tasks" / "train.jsonl", tmp_path / "tasks" / "test.jsonl")
    assert len(task_ids(pool)) == 8 and len(task_ids(test)) == 6 and not set(task_ids(pool)) & set(task_ids(test))


def test_apo_splits_of_the_spider_pool_span_its_databases(tmp_path):
    """The Spider pool is sorted easiest first, so its leading questions share a database; APO's train and
    validation splits take the databases in turn instead (math: the pool's own order)."""
    from benchmarks.learning.apo_vs_grpo import apo_config, parse
    from benchmarks.learning.arm_tasks import TASKS, interleave, task_ids
    from lightning_otel.tasks.spider.splits import read_rows

    assert interleave([{"g": "a", "i": 1}, {"g": "a", "i": 2}, {"g": "b", "i": 3}, {"g": "c", "i": 4}], "g") == [
        {"g": "a", "i": 1}, {"g": "b", "i": 3}, {"g": "c", "i": 4}, {"g": "a", "i": 2}]
    args = parse(["--task", "spider", "--out", str(tmp_path), "--apo-train", "6", "--apo-val", "6"])
    for name in ("spider", "math"):
        pool, _ = TASKS[name].write_tasks(tmp_path / name / "tasks", 32, 4, 0)
        config = apo_config(args, TASKS[name], pool, tmp_path / name)
        train, val = read_rows(Path(config.tasks)), read_rows(Path(config.val_tasks))
        assert len(train) == len(val) == 6 and not {r["id"] for r in train} & {r["id"] for r in val}
        if name == "math":
            assert [r["id"] for r in train + val] == task_ids(pool)[:12]
            continue
        pooled = read_rows(pool)
        assert len({r["db_id"] for r in pooled[:6]}) < len({r["db_id"] for r in train})
        assert len({r["db_id"] for r in val}) > 1 and {r["db_id"] for r in train} & {r["db_id"] for r in val}


def test_apo_vs_grpo_report_pairs_each_arm_with_base_and_judges_the_goal_from_the_arm_folders(tmp_path):
    from benchmarks.learning.arm_report import goal, paired, report

    ids = [f"t{i}" for i in range(10)]
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "test.jsonl").write_text("".join(json.dumps({"id": i, "question": "?"}) + "\n" for i in ids))
    arms = {"base": ({i: float(i == "t0") for i in ids}, 0),                    # 1/10
            "apo": ({i: float(i in ("t0", "t1", "t2")) for i in ids}, 40),      # 3/10: +2 / -0
            "grpo": ({i: float(i in ("t1", "t2", "t3", "t4", "t5")) for i in ids}, 512)}  # 5/10: +5 / -1
    for name, (outcomes, rollouts) in arms.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "arm.json").write_text(json.dumps({"outcomes": outcomes, "rollouts": rollouts,
                                                              "wall_seconds": 60.0, "cpu_seconds": 120.0}))
    done = run_module("benchmarks.learning.apo_vs_grpo", "--out", str(tmp_path), "--report-only", "--seed", "1")
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "report.json").read_text())
    assert result["arms"]["apo"]["vs_base"] == {"tasks": 10, "gained": 2, "lost": 0, "p": 0.5}
    assert result["arms"]["grpo"]["vs_base"] == {"tasks": 10, "gained": 5, "lost": 1, "p": 0.21875}
    assert result["apo_vs_grpo"] == {"tasks": 10, "gained": 1, "lost": 3, "p": 0.625}
    # APO gains 2 points of GRPO's 4 (half) with 40 of 512 rollouts (under a tenth): the goal holds
    assert result["goal"]["holds"] and result["goal"]["apo_share_of_gain"] == 0.5
    assert "| apo | 3/10 | 30.0% | +20.0 pts (+2 / -0, p = 0.5) | 40 | 2.0 | 1.0 |" in \
        (tmp_path / "report.md").read_text()
    assert not goal(0.2, 0.4, 52, 512)["holds"] and not goal(0.1, 0.4, 40, 512)["holds"]
    assert paired({"a": 1.0}, {"b": 0.0})["tasks"] == 0
    # a recorded arm without per-task outcomes: its own base, no paired test, and held-out tasks must be complete
    recorded = report({"base": {"outcomes": {i: 0.0 for i in ids}, "rollouts": 0},
                       "grpo": {"right": 3, "base_right": 1, "rollouts": 512}}, ids)
    assert recorded["arms"]["grpo"]["gain"] == 0.2 and "vs_base" not in recorded["arms"]["grpo"]
    with pytest.raises(ValueError, match="no held-out outcome"):
        report({"base": {"outcomes": {"t0": 1.0}, "rollouts": 0}}, ids)


def _private_mounts() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "--mount", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _private_mounts(), reason="needs a private mount namespace (root and unshare --mount)")
def test_the_avx2_emulation_hides_avx512_and_bf16_from_torch_vllms_kernel_choice_and_the_engine(tmp_path):
    # A venv of its own that sees this one's packages, so that emulate.sh's .pth file lands in no venv the rest
    # of the suite is using.
    venv, site = venv_seeing_these_packages(tmp_path / "venv", "--without-pip")
    python = venv / "bin" / "python"

    def emulated(code: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(REPO / "benchmarks" / "avx2" / "emulate.sh"), str(python), "-c", code],
                              capture_output=True, text=True, timeout=300, cwd=REPO,
                              env={**os.environ, "EMULATE_VENVS": str(venv)})

    check = ("import json, torch, torch.cpu; from lightning_otel.serve.engine import auto_dtype, native_bf16; "
             "print(json.dumps({'capability': torch.backends.cpu.get_cpu_capability(), "
             "'avx512': torch.cpu._is_avx512_supported(), 'avx512_bf16': torch.cpu._is_avx512_bf16_supported(), "
             "'native_bf16': native_bf16(), 'engine dtype': auto_dtype(), "
             "'cpuinfo avx512': 'avx512' in open('/proc/cpuinfo').read()}))")
    result = emulated(check)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert json.loads(result.stdout.splitlines()[-1]) == {
        "capability": "AVX2", "avx512": False, "avx512_bf16": False, "native_bf16": False,
        "engine dtype": "float32", "cpuinfo avx512": False}
    # patched when torch is imported, not at start: a process that never imports torch starts as it would
    light = emulated("import sys, lightning_otel; print('torch' in sys.modules)")
    assert light.stdout.strip() == "False", light.stdout[-2000:] + light.stderr[-2000:]
    assert not list(site.glob("avx2_only*"))  # removed when the command ended
    assert "avx2_only" not in subprocess.run([str(python), "-c", "import sys; print(sys.modules)"],
                                             capture_output=True, text=True, check=True).stdout
