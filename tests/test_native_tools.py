"""Tools on a model whose chat template renders them, over the real engine: the bundled SmolLM2 given a
ChatML template with a tools block (tests/fixtures/chatml_tools.jinja) through the gateway's chat_template
option, so the shared engine serves it. An unchanged OpenAI SDK tools loop under opentelemetry-instrument,
tool_choice "required" among several tools, a template that cannot render, and a named call under a Llama-style
template (tests/fixtures/llama3_tools.jinja), whose format is detected from it."""
from __future__ import annotations

import json
import textwrap

import pytest

from conftest import FIXTURES, post
from lightning_otel.serve.toolcalls import HermesToolFormat
from lightning_otel.span_store import client
from test_gateway import run_agent

TEMPLATE = (FIXTURES / "chatml_tools.jinja").read_text()
hermes = HermesToolFormat()
# The loop: a past call in the history shows the 135M model what a call of get_weather looks like, the named
# tool_choice opens the call, and it writes the arguments; the tool's result goes back, and it answers (streamed).
AGENT = textwrap.dedent("""
    import json, openai
    client = openai.OpenAI()
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    messages = [{"role": "system", "content": "You answer with tool calls."},
                {"role": "user", "content": "Weather in London?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c0", "type": "function",
                 "function": {"name": "get_weather", "arguments": json.dumps({"city": "London"})}}]},
                {"role": "tool", "tool_call_id": "c0", "content": "rain"},
                {"role": "assistant", "content": "It rains in London."},
                {"role": "user", "content": "Weather in Paris?"}]
    first = client.chat.completions.create(model="gpt-4o", messages=messages, tools=tools, max_tokens=16,
                                           temperature=0, tool_choice={"type": "function",
                                                                       "function": {"name": "get_weather"}})
    message = first.choices[0].message
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    messages.append(message.model_dump(exclude_none=True))
    messages += [{"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in message.tool_calls or []]
    stream = client.chat.completions.create(model="gpt-4o", messages=messages, tools=tools, max_tokens=12,
                                            temperature=0, stream=True)
    answer = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    print(json.dumps({"finish": first.choices[0].finish_reason, "calls": calls, "answer": answer}))
""")


@pytest.fixture
def native_gateway(engine, collector):
    from lightning_otel.serve.gateway import Gateway, GatewayConfig
    engine.use_base()
    gw = Gateway(engine, GatewayConfig(collector_url=collector.url, chat_template=TEMPLATE))
    assert gw.config.native_tools
    gw.start()
    yield gw
    gw.close()


def test_an_sdk_tools_loop_on_a_template_that_renders_tools(native_gateway, collector, db_path, tokenizer, tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    received = run_agent(script, native_gateway, collector, "ro-native")
    assert received["finish"] == "tool_calls" and [name for name, _ in received["calls"]] == ["get_weather"]
    assert isinstance(json.loads(received["calls"][0][1]), dict)  # a string-encoded JSON object
    native_gateway.flush()
    rows = client.query("""
        SELECT c.turn, c.streaming, count(g.span_id) AS records, any_value(g.prompt_ids) AS prompt_ids,
               any_value(g.completion_ids) AS completion_ids,
               any_value(json_extract_string(s.attributes, '$."lightning.prompt.forced_prefix"')) AS forced
        FROM llm_calls c LEFT JOIN generations g ON g.trace_id = c.trace_id AND g.llm_span_id = c.span_id
        LEFT JOIN spans s ON s.trace_id = g.trace_id AND s.span_id = g.span_id
        GROUP BY ALL ORDER BY c.turn""", db_path).to_dicts()
    assert [(r["turn"], r["streaming"], r["records"]) for r in rows] == [(0, False, 1), (1, True, 1)]
    first, second = ([tokenizer.decode(r["prompt_ids"], skip_special_tokens=False) for r in rows])
    opening = hermes.forced_prefix("get_weather")
    # The template rendered the tools and the past call (its string arguments as an object), and the prompt ends
    # with the call's opening: prompt ids, not the policy's; the completion is only what the policy wrote.
    assert '{"name": "get_weather", "description": "The weather in a city."' in first
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "London"}}\n</tool_call>' in first
    assert first.endswith("<|im_start|>assistant\n" + opening) and rows[0]["forced"] == opening
    name, arguments = received["calls"][0]
    again = hermes.parse(opening + tokenizer.decode(rows[0]["completion_ids"]), {"get_weather"}).tool_calls
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in again] == [(name, arguments)]
    # The second turn carries the call and its result, in the template's own syntax; nothing was forced.
    assert f'{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call><|im_end|>' in second
    assert "<tool_response>\nsunny\n</tool_response>" in second and rows[1]["forced"] is None
    assert second.endswith("<|im_start|>assistant\n")
    # Re-tokenised from the recorded messages with the same template, the forced call counts apart from drift.
    from lightning_otel.train.transitions.trajectories import drift
    with client.reading(db_path) as read:
        measured = drift(read, "bundled", TEMPLATE)
    assert (measured.calls, measured.forced) == (2, 1), measured
    assert measured.prompt_differs == 0.0, measured


def sse_choices(raw: bytes) -> dict[int, dict]:
    """Per choice index: the streamed content and tool-call names, accumulated from the SSE chunks."""
    out: dict[int, dict] = {}
    for line in raw.decode().splitlines():
        if not line.startswith("data: {"):
            continue
        for choice in json.loads(line[len("data: "):])["choices"]:
            seen = out.setdefault(choice["index"], {"content": "", "names": []})
            seen["content"] += choice["delta"].get("content") or ""
            seen["names"] += [c["function"]["name"] for c in choice["delta"].get("tool_calls") or []]
    return out


def test_required_with_several_tools_always_names_an_offered_tool(native_gateway, db_path, tokenizer):
    names = ["get_weather", "add_numbers", "lookup_city"]
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {}}}}
             for n in names]
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools, "tool_choice": "required",
            "n": 4, "max_tokens": 6, "temperature": 1.0, "stream": True}
    status, _, raw = post(native_gateway.url + "/r/ro-required/v1/chat/completions", json.dumps(body).encode(),
                          "application/json")
    assert status == 200, raw
    streamed = sse_choices(raw)
    assert sorted(streamed) == [0, 1, 2, 3]
    for seen in streamed.values():  # a call of an offered tool, or text that opens one (arguments cut at 6 tokens)
        assert seen["names"] and set(seen["names"]) <= set(names) or \
            any(seen["content"].startswith(hermes.forced_prefix(n)) for n in names), seen
    native_gateway.flush()
    records = client.query("""
        SELECT g.prompt_ids, g.completion_ids,
               json_extract_string(s.attributes, '$."lightning.prompt.forced_prefix"') AS forced
        FROM generations g JOIN spans s USING (trace_id, span_id) WHERE g.rollout_id = 'ro-required'""",
                           db_path).to_dicts()
    assert len(records) == 4
    for record in records:
        # The name was chosen among the offered ones and is part of the forced opening, in the prompt.
        assert record["forced"] in {hermes.forced_prefix(n) for n in names}
        assert tokenizer.decode(record["prompt_ids"], skip_special_tokens=False).endswith(record["forced"])
        assert 0 < len(record["completion_ids"]) <= 6


def test_a_template_that_cannot_render_is_named_in_the_answer(engine):
    from lightning_otel.serve.gateway import Gateway, GatewayConfig
    gw = Gateway(engine, GatewayConfig(chat_template="{{ raise_exception('this template takes no tools') }}"))
    gw.start()
    try:
        status, _, raw = post(gw.url + "/v1/chat/completions", json.dumps(
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode(), "application/json")
    finally:
        gw.close()
    assert status == 400
    assert json.loads(raw)["error"]["message"] == \
        "the gateway's chat_template could not render this request: this template takes no tools"


def test_a_llama_style_template_gets_a_forced_call_in_llama_syntax(engine):
    """The bundled model given a Llama-3-style tool template (tests/fixtures/llama3_tools.jinja): the format is
    detected from it, the named call opens as Llama writes one ({"name": ..., "parameters": ), the template trims
    the opening's trailing space off the prompt, and the answer parses into an OpenAI call."""
    from lightning_otel.serve.gateway import Gateway, GatewayConfig
    from lightning_otel.serve.toolcalls import FORMATS
    engine.use_base()
    gw = Gateway(engine, GatewayConfig(chat_template=(FIXTURES / "llama3_tools.jinja").read_text()))
    assert (gw.config.tool_format, gw.config.native_tools) == ("llama3_json", True)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    messages = [{"role": "user", "content": "Weather in London?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c0", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "London"}'}}]},
                {"role": "tool", "tool_call_id": "c0", "content": "rain"},
                {"role": "assistant", "content": "It rains in London."},
                {"role": "user", "content": "Weather in Paris?"}]
    try:
        answer = gw.chat({"messages": messages, "tools": tools, "max_tokens": 12, "temperature": 0,
                          "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, {}, None)
    finally:
        gw.close()
    choice = answer["choices"][0]
    opening = FORMATS["llama3_json"].forced_prefix("get_weather")
    assert choice["finish_reason"] == "tool_calls", choice
    call = choice["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and isinstance(json.loads(call["arguments"]), dict)
    assert answer["_token_pieces"][0][0] == opening  # the opening, then what the policy wrote
