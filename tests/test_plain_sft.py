"""benchmarks/peers/plain_sft.py: the reviewer's demonstrations, and the saved model the agent run starts from."""
from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "benchmarks" / "peers"), str(REPO / "benchmarks"), str(REPO / "examples" / "sql_agent")]
# Imported here, at collection, while examples/sql_agent leads sys.path: plain_sft takes the LangGraph example's
# prompts from the module named `agent`, and tests that run other examples' agents put their folders first later.
import plain_sft  # noqa: E402


def bundled_dir() -> Path:
    from lightning_otel.serve.engine import default_engine_python
    from lightning_otel.serve.model import bundled_model_dir

    return bundled_model_dir(python=default_engine_python(REPO))


def test_the_review_prompt_is_the_agents_reviewer_call_on_the_gold_query():
    from transformers import AutoTokenizer

    from lightning_otel.tasks.spider.rewards import bundled_data_dir, database_path

    CHECK, Prompts, read_schema = plain_sft.CHECK, plain_sft.Prompts, plain_sft.read_schema

    data = bundled_data_dir()
    row = {"db_id": "singer", "question": "How many singers are there?", "query": "SELECT  count(*)\nFROM singer"}
    text = Prompts(AutoTokenizer.from_pretrained(bundled_dir()), data).text(row, review=True)
    schema = read_schema(str(database_path(data, "singer")))
    assert CHECK.format(schema=schema).split("\n")[0] in text
    # the query on one line as the agent passes it on, and what SQLite returned for it on the real database
    with sqlite3.connect(database_path(data, "singer")) as conn:
        count = conn.execute("SELECT count(*) FROM singer").fetchone()[0]
    assert f"Question: How many singers are there?\nQuery: SELECT count(*) FROM singer\nResult: [({count},)]" in text
    first = Prompts(AutoTokenizer.from_pretrained(bundled_dir()), data).text(row)
    assert "Result:" not in first and "You write SQLite queries" in first


@pytest.mark.heavy
def test_save_writes_a_fine_tuned_model_folder_with_its_chat_template(tmp_path):
    from safetensors.torch import load_file

    from lightning_otel.serve.model import is_model_dir

    out, saved = tmp_path / "out", tmp_path / "model"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "peers" / "plain_sft.py"), "--out", str(out),
                           "--sft-tasks", "6", "--review", "2", "--batch", "8", "--micro-batch", "4",
                           "--epochs", "1", "--eval-tasks", "3", "--no-answers", "--save", str(saved)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "8 examples" in proc.stdout  # 6 queries and 2 reviews
    report = json.loads((out / "plain_sft.json").read_text())
    assert len(report["losses"]) == 1 and "held_out" not in report  # one step of 8; answers skipped
    assert is_model_dir(saved)
    assert json.loads((saved / "tokenizer_config.json").read_text()).get("chat_template") or \
        (saved / "chat_template.jinja").is_file()
    before, after = load_file(bundled_dir() / "model.safetensors"), load_file(saved / "model.safetensors")
    assert before.keys() == after.keys()
    assert any(not before[k].float().equal(after[k].float()) for k in before)  # trained, not a copy


def test_learning_from_sft_needs_the_fine_tuned_model_folder(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "learning.py"), "--out", str(tmp_path),
                           "--from-sft"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--from-sft starts from the fine-tuned --model folder" in proc.stderr


def test_learning_refuses_a_negative_round_count(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "learning.py"), "--out", str(tmp_path),
                           "--rounds", "-1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--rounds -1: give 0 (evaluate the SFT policy only)" in proc.stderr
