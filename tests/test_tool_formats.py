"""The tool-call formats other than Hermes's (Llama 3.x JSON, Mistral's list and v11 syntaxes) and how the format is
chosen: for every format, a rendered past call parses back to the same call, a forced opening continued by the
model parses to a call of that tool, and what is not a call of an offered tool with object arguments stays text;
each family's own forms (";"-separated Llama calls, <|python_tag|>, Mistral's list and [ARGS] runs, its ids);
detection from templates written in each family's style (tests/fixtures/*_tools.jinja); the same openings as
those templates render past calls with, through the bundled model's tokenizer. No engine."""
from __future__ import annotations

import json
import re

import pytest

from conftest import FIXTURES
from lightning_otel.errors import UserError
from lightning_otel.serve.chat_tools import template_tools
from lightning_otel.serve.toolcalls import FORMATS, detect_tool_format, tool_format

OFFERED = {"get_weather", "add"}
TOOLS = [{"type": "function", "function": {"name": n, "description": f"The {n} tool.",
                                           "parameters": {"type": "object", "properties": {}}}} for n in OFFERED]
TEMPLATES = {"hermes": "chatml_tools.jinja", "llama3_json": "llama3_tools.jinja", "mistral": "mistral_tools.jinja",
             "mistral_v11": "mistral_v11_tools.jinja"}
# What a model of each family writes after its forced opening for get_weather: the arguments and the call's end.
CONTINUATIONS = {"hermes": '{"city": "Paris"}}\n</tool_call>', "llama3_json": '{"city": "Paris"}}',
                 "mistral": '{"city": "Paris"}}]', "mistral_v11": '{"city": "Paris"}'}


def past_call(*calls: tuple[str, str | dict], content: str | None = None) -> dict:
    return {"role": "assistant", "content": content, "tool_calls": [
        {"id": f"abcdefgh{i}", "type": "function", "function": {"name": name, "arguments": arguments}}
        for i, (name, arguments) in enumerate(calls)]}


def named(parsed) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls]


@pytest.mark.parametrize("name", FORMATS)
def test_a_rendered_past_call_parses_back_to_the_same_calls(name):
    fmt = FORMATS[name]
    several = (("get_weather", '{"city": "Paris"}'), ("add", {"a": 1, "b": "é"}))
    for calls in (several[:1], several):
        text = fmt.render_messages([past_call(*calls)], None)[0]["content"]
        parsed = fmt.parse(text, OFFERED)
        assert parsed.content is None and named(parsed) == [("get_weather", {"city": "Paris"}),
                                                             ("add", {"a": 1, "b": "é"})][:len(calls)]
        assert all(isinstance(c["function"]["arguments"], str) and c["type"] == "function" for c in parsed.tool_calls)
    with_text = fmt.render_messages([past_call(*several[:1], content="Let me look.")], None)[0]["content"]
    assert fmt.parse(with_text, OFFERED).content == "Let me look." and fmt.call_start in with_text
    assert with_text.index(fmt.call_start) >= len("Let me look.")  # text before call_start is content


@pytest.mark.parametrize("name", FORMATS)
def test_a_forced_opening_is_how_a_past_call_starts_and_parses_when_continued(name):
    fmt = FORMATS[name]
    past = fmt.render_messages([past_call(("get_weather", '{"city": "Paris"}'))], None)[0]["content"]
    opening, any_tool = fmt.forced_prefix("get_weather"), fmt.forced_prefix(None)
    assert past.startswith(opening) and past[len(opening):].lstrip().startswith('{"city"')  # cut before the arguments
    assert opening == opening.rstrip()  # never after a space: a BPE vocabulary joins it to the word after it
    assert opening.startswith(any_tool + "get_weather")  # a name chosen after forced_prefix(None) continues it
    assert any_tool.startswith(fmt.call_start) or fmt.call_start in any_tool
    parsed = fmt.parse(opening + CONTINUATIONS[name], OFFERED)
    assert (parsed.content, named(parsed)) == (None, [("get_weather", {"city": "Paris"})])
    assert named(fmt.parse(any_tool + "add" + opening[len(any_tool) + len("get_weather"):] + CONTINUATIONS[name],
                           OFFERED)) == [("add", {"city": "Paris"})]


BAD_ARGUMENTS = ["1", "[1, 2]", '"Paris"', '"[1]"', "null", "true", '"{not json"']


def written(name: str, tool: str, arguments: str) -> str:
    """A call as each family writes it, with `arguments` as raw JSON text."""
    return {"hermes": f'<tool_call>\n{{"name": "{tool}", "arguments": {arguments}}}\n</tool_call>',
            "llama3_json": f'{{"name": "{tool}", "parameters": {arguments}}}',
            "mistral": f'[TOOL_CALLS] [{{"name": "{tool}", "arguments": {arguments}}}]',
            "mistral_v11": f"[TOOL_CALLS]{tool}[ARGS]{arguments}"}[name]


@pytest.mark.parametrize("name", FORMATS)
def test_a_tool_not_offered_or_arguments_that_are_not_an_object_make_the_whole_answer_text(name):
    fmt = FORMATS[name]
    assert named(fmt.parse(written(name, "add", '{"a": 1}'), OFFERED)) == [("add", {"a": 1})]
    assert named(fmt.parse(written(name, "add", '"{\\"a\\": 1}"'), OFFERED)) == [("add", {"a": 1})]  # a string of one
    for text in [written(name, "drop_table", "{}"), *(written(name, "add", a) for a in BAD_ARGUMENTS),
                 written(name, "add", '{"a": 1}') + "\n" + written(name, "drop_table", "{}")]:
        parsed = fmt.parse(text, OFFERED)
        assert (parsed.content, parsed.tool_calls) == (text, []), text
    call = written(name, "add", "{}")
    assert fmt.parse(call, ()).tool_calls == [] and fmt.parse("Plain text.", OFFERED).content == "Plain text."


def test_llama_calls_separated_by_semicolons_after_the_python_tag():
    llama = FORMATS["llama3_json"]
    text = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            '{"name": "add", "arguments": {"a": 1}};')
    assert named(llama.parse(text, OFFERED)) == [("get_weather", {"city": "Paris"}), ("add", {"a": 1})]
    assert llama.parse(text, OFFERED).content is None
    spaced = '{"name": "add", "parameters": {}}\n{"name": "get_weather"}'  # a tool without parameters: {}
    assert named(llama.parse(spaced, OFFERED)) == [("add", {}), ("get_weather", {})]
    said = 'Checking. {"name": "add", "parameters": {"a": 2}} and that is all'
    assert (llama.parse(said, OFFERED).content, named(llama.parse(said, OFFERED))) == ("Checking.", [("add", {"a": 2})])
    for text in ['The set {1, 2} has two.', '{"answer": 42}', '{"name": "add", "parameters": {"a": 1}}; {"x": 1}',
                 '{"name": "add", "parameters": {"a": 1}', 'Use {braces}: {"name": "add", "parameters": {}}']:
        assert llama.parse(text, OFFERED).tool_calls == [], text


def test_llama_renders_tools_in_the_system_turn_and_results_as_ipython_turns():
    llama = FORMATS["llama3_json"]
    out = llama.render_messages([{"role": "developer", "content": "Be brief."},
                                 {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
                                 past_call(("get_weather", '{"city": "Paris"}'), ("add", "{}")),
                                 {"role": "tool", "tool_call_id": "abcdefgh0", "content": "sunny"},
                                 {"role": "tool", "tool_call_id": "abcdefgh1", "content": "3"}], TOOLS)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "ipython", "ipython"]
    assert out[0]["content"].startswith("Be brief.\n\n") and '"parameters": <arguments' in out[0]["content"]
    assert '"name": "get_weather", "description": "The get_weather tool."' in out[0]["content"]
    assert out[2]["content"] == '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "add", ' \
                                '"parameters": {}}'
    assert [m["content"] for m in out[3:]] == ["sunny", "3"]


def test_mistral_lists_v11_runs_and_ids_mistral_templates_accept():
    old, new = FORMATS["mistral"], FORMATS["mistral_v11"]
    listed = 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcdefghi"}, ' \
             '{"name": "add", "arguments": {}}]'
    runs = 'Sure.[TOOL_CALLS]get_weather[CALL_ID]abcdefghi[ARGS]{"city": "Paris"}[TOOL_CALLS]add[ARGS]{}'
    for fmt in (old, new):  # either format reads both syntaxes
        for text in (listed, runs, runs.replace("[ARGS]", "")):
            parsed = fmt.parse(text, OFFERED)
            assert (parsed.content, named(parsed)) == ("Sure.", [("get_weather", {"city": "Paris"}), ("add", {})])
            assert all(re.fullmatch(r"[0-9a-zA-Z]{9}", c["id"]) for c in parsed.tool_calls)
        assert named(fmt.parse('[TOOL_CALLS]{"name": "add", "arguments": {}}', OFFERED)) == [("add", {})]
        for text in ["[TOOL_CALLS] []", "[TOOL_CALLS]", "[TOOL_CALLS] not json", "[TOOL_CALLS]add",
                     '[TOOL_CALLS] [{"name": "add", "arguments": {}}, 3]']:
            assert fmt.parse(text, OFFERED).tool_calls == [], text
    assert old.keep_special_tokens and new.keep_special_tokens and not FORMATS["llama3_json"].keep_special_tokens


@pytest.mark.parametrize("name", ["mistral", "mistral_v11"])
def test_mistral_renders_a_run_of_tool_results_as_one_user_turn(name):
    fmt = FORMATS[name]
    out = fmt.render_messages([{"role": "user", "content": "Weather?"},
                               past_call(("get_weather", '{"city": "Paris"}'), ("add", "{}")),
                               {"role": "tool", "tool_call_id": "abcdefgh0", "content": "sunny"},
                               {"role": "tool", "tool_call_id": "abcdefgh1", "content": "3"},
                               {"role": "assistant", "content": "Sunny."}], TOOLS)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user", "assistant"]
    assert out[3]["content"].count("[TOOL_RESULTS]") == 2 and out[3]["content"].endswith("[/TOOL_RESULTS]")
    assert "sunny" in out[3]["content"] and "[TOOL_CALLS]" in out[0]["content"]
    assert all(isinstance(m["content"], str) for m in out)


@pytest.mark.parametrize("name,file", TEMPLATES.items())
def test_the_format_is_detected_from_the_template(name, file):
    template = (FIXTURES / file).read_text()
    assert detect_tool_format(template) == name
    assert template_tools(None, template) == template_tools(None, template, None)
    assert template_tools(None, template).format == name and template_tools(None, template).native


@pytest.mark.parametrize("template,expected", [
    ("{{ messages[0].content }}", "hermes"),                        # renders no tools: the default
    ("{{ '<|python_tag|>' + tools | tojson }}", "llama3_json"),
    ("{{- \"{\\\"name\\\": function name, \\\"parameters\\\": ...}\" }}", "llama3_json"),  # quotes escaped in Jinja
    ('{{ "<tool_call>" }} {"name": x, "parameters": y}', "hermes"),  # Hermes's marker decides first
    ("{{ '[TOOL_CALLS]' + name + '[ARGS]' }}", "mistral_v11"),
    ('{"name": "x"}\n"parameters": {}', "hermes"),                  # not one call's shape
])
def test_detection_reads_the_markers(template, expected):
    assert detect_tool_format(template) == expected


def test_the_model_folder_template_or_a_named_format_decides(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": (FIXTURES / TEMPLATES["mistral"])
                                                             .read_text()}))
    assert template_tools(model) == template_tools(model, None, None)
    assert (template_tools(model).native, template_tools(model).format) == (True, "mistral")
    llama = (FIXTURES / TEMPLATES["llama3_json"]).read_text()
    assert template_tools(model, llama).format == "llama3_json"  # the template given wins over the model's
    assert template_tools(model, llama, "hermes").format == "hermes"  # a named format wins over detection
    assert (template_tools(None).native, template_tools(None).format) == (False, "hermes")
    with pytest.raises(UserError, match="'llama3' is unknown: choose one of hermes, llama3_json, mistral, "
                                        "mistral_v11"):
        template_tools(model, None, "llama3")
    with pytest.raises(UserError, match="unknown"):
        tool_format("Hermes")


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    from lightning_otel.serve.model import bundled_model_dir
    return AutoTokenizer.from_pretrained(str(bundled_model_dir()))


@pytest.mark.parametrize("name,file", TEMPLATES.items())
def test_each_family_template_renders_a_past_call_as_the_format_opens_one(name, file, hf_tokenizer):
    """The opening a forced call continues is what the family's template renders before a past call's arguments,
    and continuing an assistant turn that holds it ends the prompt there, trimming template (Llama's) or not."""
    tokenizer = hf_tokenizer
    template, fmt = (FIXTURES / file).read_text(), FORMATS[name]
    ask = [{"role": "user", "content": "Weather in London?"}]
    history = [*ask, past_call(("get_weather", {"city": "London"})),
               {"role": "tool", "tool_call_id": "abcdefgh0", "content": "rain"}, {"role": "user", "content": "Paris?"}]
    rendered = tokenizer.apply_chat_template(history, tools=TOOLS, chat_template=template, tokenize=False)
    assert re.search(re.escape(fmt.forced_prefix("get_weather")) + r" ?" + re.escape('{"city": "London"}'), rendered)
    opened = tokenizer.apply_chat_template([*ask, {"role": "assistant", "content": fmt.forced_prefix("get_weather")}],
                                           tools=TOOLS, chat_template=template, tokenize=False,
                                           continue_final_message=True)
    assert opened.endswith(fmt.forced_prefix("get_weather"))
