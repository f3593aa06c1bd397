"""Re-tokenising calls without a token record, and the drift against the engine's ids: recorded messages
of the real instrumentations, the bundled model's tokenizer, and real rollouts recorded through the
gateway (tests/fixtures/rollouts/, tests/recorder/record_gateway_rollouts.py) loaded into a DuckDB store."""
from __future__ import annotations

import json

import polars as pl
import pytest

from conftest import FIXTURES
from lightning_otel.span_store import client, store
from lightning_otel.train.transitions.compile import CompileConfig, compile_transitions
from lightning_otel.train.transitions.retokenize import (ChatTokenizer, assistant_message, edit_distance, measure_drift,
                                             openai_messages, openai_tools)
from lightning_otel.train.transitions.trajectories import drift
from test_recorded_payloads import replay_protobuf

ROLLOUTS = FIXTURES / "rollouts"


@pytest.fixture(scope="module")
def chat_tokenizer():
    from lightning_otel.serve.model import bundled_model_dir
    return ChatTokenizer.load(bundled_model_dir())


def load_rollouts(db, without_records_of: str | None = None) -> None:
    """The recorded rollouts into a fresh store file, through the same insert as the collector's;
    optionally without the gateway's records of one example agent's rollouts (as if that agent had
    talked to another endpoint)."""
    spans = pl.read_parquet(ROLLOUTS / "spans.parquet")
    runs = pl.read_parquet(ROLLOUTS / "rollout_runs.parquet")
    if without_records_of:
        dropped = runs.filter(pl.col("command").str.contains(f"/{without_records_of}/"))["rollout_id"]
        record = (pl.col("name") == "lightning.generate") & pl.col("rollout_id").is_in(dropped.implode())
        spans = spans.filter(~record)
    con = store.connect(db)
    con.execute("BEGIN TRANSACTION")
    store.insert_batch(con, "traces", spans.to_arrow())
    for table in ("rewards", "rollout_runs", "tasks"):
        con.register("rows", pl.read_parquet(ROLLOUTS / f"{table}.parquet").to_arrow())
        con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM rows")
    con.execute("COMMIT")
    con.close()


def test_messages_from_the_recorded_langgraph_call(collector, db_path):
    replay_protobuf(collector.url, "langgraph")
    second = client.query("SELECT system_instructions, input_messages, output_messages, tool_definitions "
                          "FROM llm_calls ORDER BY turn", db_path).to_dicts()[1]
    system = ("You answer questions about a SQLite database with one table singer(singer_id INTEGER, name TEXT, "
              "country TEXT, age INTEGER). Use the execute_sql tool to run a query, then answer in one sentence.")
    messages = openai_messages(second["system_instructions"], second["input_messages"])
    call_id = messages[2]["tool_calls"][0]["id"]
    assert messages == [
        {"role": "system", "content": system},
        {"role": "user", "content": "How many singers are there?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": call_id, "type": "function", "function": {
            "name": "execute_sql", "arguments": json.dumps({"query": "SELECT COUNT(*) FROM singer"})}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "[[3]]"},
    ]
    assert assistant_message(second["output_messages"]) == (
        {"role": "assistant", "content": "There are 3 singers."}, "stop")
    assert openai_tools(second["tool_definitions"]) is None  # the answering call offers no tools
    first = client.query("SELECT tool_definitions FROM llm_calls WHERE turn = 0", db_path)["tool_definitions"][0]
    assert openai_tools(first)[0]["function"]["name"] == "execute_sql"
    assert openai_tools(first)[0]["type"] == "function"


def test_edit_distance_on_hand_counted_cases():
    assert edit_distance([], []) == 0
    assert edit_distance([1, 2, 3], [1, 2, 3]) == 0
    assert edit_distance([1, 2, 3], []) == 3
    assert edit_distance([1, 2, 3], [1, 9, 3]) == 1        # one substitution
    assert edit_distance([1, 2, 3], [1, 3]) == 1           # one deletion
    assert edit_distance([1, 3], [1, 2, 2, 3]) == 2        # two insertions
    assert edit_distance([5, 1, 2, 3], [1, 2, 3, 5]) == 2  # a moved token: delete + insert
    assert edit_distance([ord(c) for c in "kitten"], [ord(c) for c in "sitting"]) == 3
    assert edit_distance([ord(c) for c in "flaw"], [ord(c) for c in "lawn"]) == 2


def test_a_call_without_messages_or_record_cannot_be_retokenised(chat_tokenizer):
    frame = pl.DataFrame({"trace_id": ["t"], "span_id": ["s"], "system_instructions": [None],
                          "input_messages": [None], "output_messages": [None], "tool_definitions": [None]},
                         schema={"trace_id": pl.String, "span_id": pl.String, "system_instructions": pl.String,
                                 "input_messages": pl.String, "output_messages": pl.String,
                                 "tool_definitions": pl.String})
    out = chat_tokenizer.encode(frame).to_dicts()
    assert out == [{"trace_id": "t", "span_id": "s", "prompt_ids": None, "completion_ids": None,
                    "problem": "no recorded messages"}]


def test_drift_is_zero_when_the_ids_are_the_same_and_counted_when_not():
    engine = pl.DataFrame({"trace_id": ["a", "b"], "span_id": ["1", "2"], "prompt_ids": [[1, 2, 3], [4, 5]],
                           "completion_ids": [[7, 2], [8, 2]]})
    same = measure_drift(engine, engine)
    assert (same.calls, same.prompt_differs, same.completion_edits) == (2, 0.0, 0.0)
    other = engine.with_columns(pl.Series("completion_ids", [[7, 2], [9, 9, 2]]))
    moved = measure_drift(engine, other)
    # Call b's completion [8, 2] -> [9, 9, 2]: one substitution and one insertion; 4 engine tokens in all.
    assert (moved.completion_differs, moved.completion_edits, moved.completion_mismatch) == (0.5, 1.0, 0.5)
    assert moved.prompt_differs == 0.0


def test_calls_without_records_are_retokenised_to_the_engines_ids(tmp_path):
    full, stripped = tmp_path / "full.duckdb", tmp_path / "stripped.duckdb"
    load_rollouts(full)
    load_rollouts(stripped, without_records_of="openai_sql")  # the plain-SDK agent "talked to another endpoint"
    engine, _ = compile_transitions(CompileConfig(db=full, reward="sql_form"))
    again, account = compile_transitions(CompileConfig(db=stripped, reward="sql_form", model="bundled"))
    assert account.retokenized_calls == 36 and again.height == engine.height == 120
    keys = ["rollout_id", "turn"]
    both = engine.join(again, on=keys, suffix="_re")
    retokenized = both.filter(pl.col("token_source_re") == "retokenized")
    assert retokenized.height == 36 and set(retokenized["token_source"]) == {"engine"}
    assert retokenized["completion_logprobs_re"].list.len().to_list() == [0] * 36  # no sampling logprobs
    assert (retokenized["prompt_ids"] == retokenized["prompt_ids_re"]).all()  # same chat template, same ids
    # Completions: sampled token sequences are not always the canonical tokenisation of their text; here
    # only answers cut at the length limit (their text ends mid-word) came back different.
    finish = client.query("SELECT t.rollout_id, t.turn, c.finish_reasons FROM trajectory_calls t "
                          "JOIN llm_calls c USING (trace_id, span_id)", full)
    differ = retokenized.filter(pl.col("completion_ids") != pl.col("completion_ids_re")).join(finish, on=keys)
    assert differ.height <= 6 and set(differ["finish_reasons"]) <= {'["length"]'}
    assert (both["reward"] == both["reward_re"]).all()
    assert both["advantage"].to_list() == pytest.approx(both["advantage_re"].to_list())  # summation order aside
    _, without = compile_transitions(CompileConfig(db=stripped, reward="sql_form"))
    reason = "LLM call without a token record (no tokenizer to re-tokenise it with: give --tokenizer)"
    assert without.excluded[reason] == 12


def test_drift_of_the_recorded_rollouts(tmp_path, capsys):
    db = tmp_path / "full.duckdb"
    load_rollouts(db)
    with client.reading(db) as read:
        measured = drift(read, "bundled")
    assert measured.calls == 120 and measured.unreadable == 0
    # Prompts: CrewAI's and AutoGen's tool definitions carry "strict", which the instrumentation does not
    # record (24 calls); the plain SDK's and LangGraph's prompts come back exactly.
    assert measured.prompt_differs == pytest.approx(24 / 120)
    assert 0 < measured.completion_differs < 0.1 and measured.completion_mismatch < 0.01
    from lightning_otel.cli import main
    assert main(["compile", "--db", str(db), "--out", str(tmp_path / "t.parquet"), "--reward", "sql_form",
                 "--drift"]) == 0
    printed = capsys.readouterr().out
    assert "drift over 120 calls" in printed and "prompt:     20.0% of calls differ" in printed


TOOL_PARTS = json.dumps([{"type": "function", "name": "execute_sql", "description": "Run SQL",
                          "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}])
ASKED = json.dumps([{"role": "user", "parts": [{"type": "text", "content": "How many singers?"}]}])
CALLED = json.dumps([{"role": "assistant", "finish_reason": "tool_call", "parts": [
    {"type": "tool_call", "id": "c1", "name": "execute_sql", "arguments": {"query": "SELECT 1"}}]}])


def forced_call_rows(forced_prefix: str | None) -> pl.DataFrame:
    return pl.DataFrame({"trace_id": ["t"], "span_id": ["s"], "system_instructions": [None],
                         "input_messages": [ASKED], "output_messages": [CALLED], "tool_definitions": [TOOL_PARTS],
                         "forced_prefix": [forced_prefix]},
                        schema_overrides={"system_instructions": pl.String, "forced_prefix": pl.String})


def test_a_forced_opening_is_retokenised_as_prompt_and_counted_apart_from_drift(chat_tokenizer):
    """tool_choice "required" or a named function: the gateway wrote the call's opening at the end of the prompt;
    the recorded messages hold it as the start of the answer. Re-tokenised with the opening in the prompt, the
    ids are the engine's; without it, the opening would show up as drift on both sides."""
    from lightning_otel.serve.toolcalls import HermesToolFormat
    opening = HermesToolFormat().forced_prefix("execute_sql")
    messages = openai_messages(None, ASKED)
    tools = openai_tools(TOOL_PARTS)
    assert chat_tokenizer.prompt_text(messages, tools, opening) == chat_tokenizer.prompt_text(messages, tools) + opening
    answer = assistant_message(CALLED)[0]
    # the opening stops before the space of `"arguments": {`: the policy writes ` {` itself, as one token
    assert chat_tokenizer.completion_text(answer, opening) == ' {"query": "SELECT 1"}}\n</tool_call>'
    assert chat_tokenizer.completion_text(answer).startswith(opening)
    # The engine's ids for such a call: prompt up to and with the opening, completion what the policy wrote.
    ids = lambda text: chat_tokenizer.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    engine = pl.DataFrame({
        "trace_id": ["t"], "span_id": ["s"], "forced_prefix": [opening],
        "prompt_ids": [ids(chat_tokenizer.prompt_text(messages, tools, opening))],
        "completion_ids": [ids(' {"query": "SELECT 1"}}\n</tool_call>') + [chat_tokenizer.tokenizer.eos_token_id]]})
    measured = measure_drift(engine, chat_tokenizer.encode(forced_call_rows(opening)))
    assert (measured.calls, measured.prompt_differs, measured.completion_differs) == (1, 0.0, 0.0)
    assert (measured.forced, measured.forced_differ) == (1, 0)
    assert "1 call(s) had a tool-call opening forced into the prompt" in "\n".join(measured.lines())
    unaccounted = measure_drift(engine.drop("forced_prefix"), chat_tokenizer.encode(forced_call_rows(None)))
    assert (unaccounted.prompt_differs, unaccounted.completion_differs, unaccounted.forced) == (1.0, 1.0, 0)
    assert "forced" not in "\n".join(unaccounted.lines())


@pytest.mark.parametrize("file,name", [("llama3_tools.jinja", "llama3_json"),
                                       ("mistral_v11_tools.jinja", "mistral_v11")])
def test_a_forced_call_in_another_format_is_retokenised_with_the_gateways_opening(file, name):
    """The re-tokeniser takes the gateway's format, detected from the same template (or named), so a forced call
    of a Llama or Mistral template counts no drift. The opening ends before the space of `"parameters": {` (Llama's
    template trims a turn's trailing space anyway), so the completion starts with it, as the engine's did."""
    from lightning_otel.serve.model import bundled_model_dir
    from lightning_otel.serve.toolcalls import FORMATS
    template, fmt = (FIXTURES / file).read_text(), FORMATS[name]
    tokenizer = ChatTokenizer.load(bundled_model_dir(), chat_template=template)
    assert (tokenizer.format, tokenizer.native_tools) == (fmt, True)
    assert ChatTokenizer.load(bundled_model_dir(), "hermes", template).format is FORMATS["hermes"]
    opening = fmt.forced_prefix("execute_sql")
    messages, tools = openai_messages(None, ASKED), openai_tools(TOOL_PARTS)
    prompt = tokenizer.prompt_text(messages, tools, opening)
    written = ' {"query": "SELECT 1"}}' if name == "llama3_json" else '{"query": "SELECT 1"}'
    assert prompt.endswith(opening)
    answer = assistant_message(CALLED)[0]
    assert tokenizer.completion_text(answer, opening, prompt) == written
    ids = lambda text: tokenizer.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    engine = pl.DataFrame({"trace_id": ["t"], "span_id": ["s"], "forced_prefix": [opening],
                           "prompt_ids": [ids(prompt)],
                           "completion_ids": [ids(written) + [tokenizer.tokenizer.eos_token_id]]})
    measured = measure_drift(engine, tokenizer.encode(forced_call_rows(opening)))
    assert (measured.calls, measured.prompt_differs, measured.completion_differs, measured.forced) == (1, 0, 0, 1)


def test_a_template_that_renders_tools_is_given_them_as_vllm_gives_them():
    from lightning_otel.serve.model import bundled_model_dir
    native = ChatTokenizer.load(bundled_model_dir(), chat_template=(FIXTURES / "chatml_tools.jinja").read_text())
    assert native.native_tools
    messages = [{"role": "user", "content": "How many?"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "execute_sql", "arguments": '{"query": "SELECT 1"}'}},
        {"id": "c2", "type": "function", "function": {"name": "execute_sql", "arguments": "[1]"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "[[3]]"}]
    prompt = native.prompt_text(messages, [{"type": "function", "function": {"name": "execute_sql"}}])
    # vLLM parses string arguments into objects (a non-object becomes {}) and dumps tools with its own fields.
    assert '{"name": "execute_sql", "arguments": {"query": "SELECT 1"}}' in prompt
    assert '{"name": "execute_sql", "arguments": {}}' in prompt
    assert '{"name": "execute_sql", "description": null, "parameters": null}' in prompt
    assert prompt.endswith("<tool_response>\n[[3]]\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
