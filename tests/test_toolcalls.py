"""Hermes-style tool calls: rendering OpenAI tool messages into text and parsing calls out of text."""
from __future__ import annotations

import json

import pytest

from lightning_otel.errors import UserError
from lightning_otel.serve.toolcalls import HermesToolFormat, tool_format

QUERY = {"type": "object", "properties": {"query": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "execute_sql", "description": "Run SQL", "parameters": QUERY}}]
hermes = HermesToolFormat()
OFFERED = {"execute_sql", "a", "b"}


def test_parse_one_and_several_calls():
    text = 'Let me check.\n<tool_call>\n{"name": "execute_sql", "arguments": {"query": "SELECT 1"}}\n</tool_call>'
    parsed = hermes.parse(text, offered=OFFERED)
    assert parsed.content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls] == \
        [("execute_sql", {"query": "SELECT 1"})]
    assert parsed.tool_calls[0]["id"].startswith("call_") and parsed.tool_calls[0]["type"] == "function"
    two = ('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": "{\\"x\\": 1}"}'
           '</tool_call>')
    calls = hermes.parse(two, offered=OFFERED).tool_calls
    assert [c["function"]["name"] for c in calls] == ["a", "b"]
    assert calls[1]["function"]["arguments"] == '{"x": 1}'
    assert hermes.parse(two, offered=OFFERED).content is None


@pytest.mark.parametrize("text", [
    "plain answer",
    "<tool_call>not json</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',
    '<tool_call>["execute_sql"]</tool_call>',
])
def test_text_that_is_not_a_call_stays_content(text):
    parsed = hermes.parse(text, offered=OFFERED)
    assert parsed.tool_calls == [] and parsed.content == text


def test_no_parsing_without_tools_and_unterminated_calls():
    text = '<tool_call>{"name": "execute_sql", "arguments": {}}</tool_call>'
    assert hermes.parse(text, offered=()).tool_calls == []
    cut = '<tool_call>\n{"name": "execute_sql", "arguments": {"query": "SELECT 2"}}'  # stopped at max_tokens
    assert hermes.parse(cut, offered=OFFERED).tool_calls[0]["function"]["name"] == "execute_sql"


def test_render_puts_tools_in_the_system_prompt_and_tool_turns_in_text():
    messages = [
        {"role": "system", "content": "You write SQL."},
        {"role": "user", "content": [{"type": "text", "text": "How many?"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "execute_sql", "arguments": '{"query": "SELECT 1"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "[[3]]"},
    ]
    out = hermes.render_messages(messages, TOOLS)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("You write SQL.") and '"name": "execute_sql"' in out[0]["content"]
    assert out[1]["content"] == "How many?"
    assert json.loads(out[2]["content"].split("<tool_call>\n")[1].split("\n</tool_call>")[0]) == \
        {"name": "execute_sql", "arguments": {"query": "SELECT 1"}}
    assert out[3]["content"] == "<tool_response>\n[[3]]\n</tool_response>"
    assert all(isinstance(m["content"], str) for m in out)
    # A rendered call parses back to the same call.
    again = hermes.parse(out[2]["content"], offered=OFFERED).tool_calls[0]["function"]
    assert again["name"] == "execute_sql" and json.loads(again["arguments"]) == {"query": "SELECT 1"}


def test_unknown_format():
    with pytest.raises(UserError, match="tool format .nope. is unknown: choose one of hermes, llama3_json, mistral"):
        tool_format("nope")


def test_a_forced_call_starts_as_a_past_call_is_rendered_and_parses_when_continued():
    past = hermes.render_messages([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "execute_sql", "arguments": '{"query": "SELECT 1"}'}}]}],
        TOOLS)[-1]["content"]
    named, any_tool = hermes.forced_prefix("execute_sql"), hermes.forced_prefix(None)
    assert past.startswith(named) and named.startswith(any_tool) and named != any_tool
    assert named.endswith('"arguments":') and any_tool.endswith('{"name": "')
    continued = hermes.parse(named + '{"query": "SELECT 2"}}\n</tool_call>', offered=OFFERED)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in continued.tool_calls] == \
        [("execute_sql", {"query": "SELECT 2"})]
    assert hermes.parse(any_tool + 'execute_sql", "arguments": {}}', offered=OFFERED).tool_calls


@pytest.mark.parametrize("arguments", ["1", "[1, 2]", '"SELECT 1"', '"[1]"', "null", "true", '"{not json"'])
def test_arguments_that_are_not_a_json_object_make_the_answer_text(arguments):
    text = f'<tool_call>\n{{"name": "execute_sql", "arguments": {arguments}}}\n</tool_call>'
    parsed = hermes.parse(text, offered=OFFERED)
    assert parsed.tool_calls == [] and parsed.content == text


@pytest.mark.parametrize("call,expected", [
    ('{"name": "execute_sql", "arguments": {"query": "SELECT 1"}}', {"query": "SELECT 1"}),
    ('{"name": "execute_sql", "arguments": "{\\"query\\": \\"SELECT 1\\"}"}', {"query": "SELECT 1"}),
    ('{"name": "execute_sql"}', {}),  # a tool without parameters
])
def test_arguments_are_always_a_string_encoded_object(call, expected):
    function = hermes.parse(f"<tool_call>{call}</tool_call>", offered=OFFERED).tool_calls[0]["function"]
    assert isinstance(function["arguments"], str) and json.loads(function["arguments"]) == expected


def test_a_call_of_a_tool_not_offered_or_one_bad_block_makes_the_whole_answer_text():
    unknown = '<tool_call>{"name": "drop_table", "arguments": {}}</tool_call>'
    assert hermes.parse(unknown, offered={"execute_sql"}).tool_calls == []
    assert hermes.parse(unknown, offered={"execute_sql"}).content == unknown
    assert hermes.parse(unknown, offered={"drop_table"}).tool_calls  # offered: a call
    mixed = 'Two.\n<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": 3}'
    parsed = hermes.parse(mixed, offered=OFFERED)
    assert parsed.tool_calls == [] and parsed.content == mixed  # nothing the model wrote is dropped
    assert hermes.parse('<tool_call>{"name": ["a"], "arguments": {}}</tool_call>', offered=OFFERED).tool_calls == []
