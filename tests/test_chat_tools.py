"""How the gateway puts tools before the engine and keeps tool_choice (no engine): which tool a forced call
names, what reaches vLLM for a template that renders tools and for one that does not, the request that
chooses a tool among several, and (over a scripted stand-in engine) how a call forced among several tools is
generated, answered and recorded, and when a refusal is named a template error; the same forcing in every tool
format (Llama 3.x JSON, Mistral's two), detected from a template in its family's style or named."""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import FIXTURES
from lightning_otel.errors import UserError
from lightning_otel.serve.chat_tools import (chat_upstream, name_choice, plan_tools, read_chat_template,
                                             template_tools, with_opening)
from lightning_otel.serve.gateway import GatewayConfig
from lightning_otel.serve.request_checks import BadRequest, check_chat
from lightning_otel.serve.toolcalls import HermesToolFormat

hermes = HermesToolFormat()
TEMPLATE = (FIXTURES / "chatml_tools.jinja").read_text()


def tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}


ASK = [{"role": "user", "content": "Weather in Paris?"}]
HISTORY = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]


@pytest.mark.parametrize("choice,tools,must_call,name", [
    (None, ["weather"], False, None),
    ("auto", ["weather", "add"], False, None),
    ("required", ["weather"], True, "weather"),        # one tool offered: its name is forced
    ("required", ["weather", "add"], True, None),      # several: the engine chooses among them
    ("any", ["weather", "add"], True, None),           # LangChain's word for "required"
    ({"type": "function", "function": {"name": "add"}}, ["weather", "add"], True, "add"),
])
def test_which_call_tool_choice_forces(choice, tools, must_call, name):
    body = {"messages": ASK, "tools": [tool(t) for t in tools], **({"tool_choice": choice} if choice else {})}
    check_chat(body, 4)
    plan = plan_tools(body)
    assert (plan.must_call, plan.name, plan.names, plan.offered) == (must_call, name, tuple(tools), frozenset(tools))


def test_tool_choice_none_offers_no_tools_and_parses_no_calls():
    plan = plan_tools({"messages": ASK, "tools": [tool("weather")], "tool_choice": "none"})
    assert (plan.tools, plan.offered, plan.must_call) == (None, frozenset(), False)


def test_a_template_that_renders_tools_gets_openai_messages_tools_and_tool_choice_none():
    body = {"messages": HISTORY, "tools": [tool("weather"), tool("add")], "tool_choice": "required", "stream": True,
            "parallel_tool_calls": False, "max_tokens": 8}
    upstream = chat_upstream(body, plan_tools(body), hermes, native=True, chat_template=TEMPLATE)
    assert upstream == {"messages": HISTORY, "tools": body["tools"], "tool_choice": "none", "max_tokens": 8,
                        "chat_template": TEMPLATE}
    plain = chat_upstream({"messages": HISTORY}, plan_tools({"messages": HISTORY}), hermes, True, None)
    assert plain == {"messages": HISTORY}  # past calls and results go to the template as they are


def test_a_template_without_tools_gets_them_rendered_into_the_messages():
    body = {"messages": HISTORY, "tools": [tool("weather")], "tool_choice": "auto"}
    upstream = chat_upstream(body, plan_tools(body), hermes, native=False, chat_template=None)
    assert set(upstream) == {"messages"}
    assert "<tools>" in upstream["messages"][0]["content"] and "<tool_response>" in upstream["messages"][-1]["content"]
    assert all(isinstance(m["content"], str) and "tool_calls" not in m for m in upstream["messages"])


def test_a_forced_opening_and_the_name_choice_continue_the_answer():
    upstream = {"messages": ASK, "max_tokens": 64, "stop": ["\n"], "temperature": 1.0, "n": 3,
                "response_format": {"type": "text"}}
    opened = with_opening(upstream, hermes.forced_prefix("add"), n=2)
    assert opened["messages"][-1] == {"role": "assistant", "content": '<tool_call>\n{"name": "add", "arguments":'}
    assert (opened["continue_final_message"], opened["add_generation_prompt"], opened["n"]) == (True, False, 2)
    assert with_opening(upstream, "") is upstream
    choice = name_choice(upstream, hermes.forced_prefix(None), ("weather", "add"))
    assert choice["messages"][-1]["content"] == '<tool_call>\n{"name": "'
    assert choice["structured_outputs"] == {"choice": ["weather", "add"]} and choice["max_tokens"] == 8
    assert "stop" not in choice and "response_format" not in choice
    assert (choice["n"], choice["temperature"]) == (3, 1.0)  # one name per choice, sampled by the policy


def test_the_chat_template_decides_native_tools(tmp_path):
    assert GatewayConfig(chat_template=TEMPLATE).native_tools is True
    assert GatewayConfig(chat_template="{{ messages[0].content }}").native_tools is False
    assert GatewayConfig().native_tools is False
    assert GatewayConfig(native_tools=True).native_tools is True
    with pytest.raises(UserError, match="chat_template"):
        GatewayConfig(chat_template="  ")
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    assert not template_tools(model).native and template_tools(model, TEMPLATE).native
    assert read_chat_template(FIXTURES / "chatml_tools.jinja") == TEMPLATE
    with pytest.raises(UserError, match="cannot read"):
        read_chat_template(Path(tmp_path / "missing.jinja"))


@pytest.mark.parametrize("extra", [{"chat_template": "{{ 7 }}"}, {"chat_template_kwargs": {"chat_template": "x"}}])
def test_a_request_may_not_bring_its_own_template(extra):
    with pytest.raises(BadRequest, match="takes none from requests") as caught:
        check_chat({"messages": ASK, **extra}, 4)
    assert caught.value.param == "chat_template"
    check_chat({"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}, 4)


class ScriptedEngine:
    """Answers the name choice with `names` (one per choice) and every other generation with "{}}" per choice;
    `refuse` makes generation answer 400, and rendering too when `template_broken`."""
    name, policy_version, model_name = "scripted", 0, "policy"

    def __init__(self, names=(), refuse=False, template_broken=False):
        self.names, self.refuse, self.template_broken, self.requests = list(names), refuse, template_broken, []

    def generate(self, path: str, body: dict, timeout: float = 600) -> dict:
        from lightning_otel.serve.engine import EngineError
        self.requests.append(body)
        if self.refuse:
            raise EngineError(400, {"error": {"message": "no tools here", "type": "BadRequestError"}})
        n = body.get("n", 1)
        texts = self.names[:n] if "structured_outputs" in body else ["{}}"] * n
        prompt = [len(self.requests)] * 3
        return {"id": f"chatcmpl-{len(self.requests)}", "prompt_token_ids": prompt,
                "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n},
                "choices": [{"index": i, "message": {"content": t}, "finish_reason": "stop", "token_ids": [9],
                             "logprobs": {"content": [{"token": t, "logprob": -0.1}]}} for i, t in enumerate(texts)]}

    def tokenize_chat(self, body: dict, timeout: float = 60) -> dict:
        from lightning_otel.serve.engine import EngineError
        if self.template_broken:
            raise EngineError(400, {"error": {"message": "no tools here", "type": "BadRequestError"}})
        return {"tokens": [1, 2]}


def recording_gateway(engine, **config):
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from lightning_otel.serve.gateway import Gateway
    gateway, spans = Gateway(engine, GatewayConfig(**config)), InMemorySpanExporter()
    gateway.provider.add_span_processor(SimpleSpanProcessor(spans))
    return gateway, spans


def test_a_call_forced_among_several_tools_is_generated_once_per_chosen_name():
    engine = ScriptedEngine(names=["add", "weather", "add"])
    gateway, spans = recording_gateway(engine, chat_template=TEMPLATE)
    try:
        body = {"messages": ASK, "tools": [tool("weather"), tool("add")], "tool_choice": "required", "n": 3,
                "temperature": 1.0, "max_tokens": 8}
        response = gateway.chat(body, {}, "ro-x")
    finally:
        gateway.close()
    choice, add, weather = engine.requests
    assert choice["structured_outputs"] == {"choice": ["weather", "add"]} and choice["n"] == 3
    assert (add["n"], add["messages"][-1]["content"]) == (2, hermes.forced_prefix("add"))
    assert (weather["n"], weather["messages"][-1]["content"]) == (1, hermes.forced_prefix("weather"))
    assert all(r["tool_choice"] == "none" and r["chat_template"] == TEMPLATE for r in engine.requests)
    calls = [(c["index"], c["message"]["tool_calls"][0]["function"]["name"], c["finish_reason"])
             for c in response["choices"]]
    assert calls == [(0, "add", "tool_calls"), (1, "add", "tool_calls"), (2, "weather", "tool_calls")]
    assert response["id"] == "chatcmpl-2" and response["usage"]["completion_tokens"] == 3
    records = sorted(spans.get_finished_spans(), key=lambda s: s.attributes["lightning.choice.index"])
    assert [(r.attributes["lightning.prompt.forced_prefix"], r.attributes["gen_ai.response.id"],
             list(r.attributes["lightning.prompt.token_ids"])) for r in records] == [
        (hermes.forced_prefix("add"), "chatcmpl-2", [2, 2, 2]), (hermes.forced_prefix("add"), "chatcmpl-2", [2, 2, 2]),
        (hermes.forced_prefix("weather"), "chatcmpl-2", [3, 3, 3])]
    assert response["_token_pieces"][0] == [hermes.forced_prefix("add"), "{}}"]  # streamed: opening, then tokens


def test_an_unforced_answer_has_no_opening_in_its_record():
    engine = ScriptedEngine()
    gateway, spans = recording_gateway(engine)
    try:
        gateway.chat({"messages": ASK, "tools": [tool("weather")], "max_tokens": 4}, {}, None)
    finally:
        gateway.close()
    assert "lightning.prompt.forced_prefix" not in spans.get_finished_spans()[0].attributes
    assert "tools" not in engine.requests[0] and "<tools>" in engine.requests[0]["messages"][0]["content"]


def test_a_refusal_is_named_a_template_error_only_when_the_template_cannot_render():
    from lightning_otel.serve.engine import EngineError
    gateway, _ = recording_gateway(ScriptedEngine(refuse=True, template_broken=True), chat_template=TEMPLATE)
    with pytest.raises(BadRequest, match="the gateway's chat_template could not render this request: no tools here"):
        gateway.chat({"messages": ASK}, {}, None)
    gateway.close()
    gateway, _ = recording_gateway(ScriptedEngine(refuse=True))
    with pytest.raises(EngineError, match="no tools here"):  # rendering works: the engine's own refusal
        gateway.chat({"messages": ASK}, {}, None)
    gateway.close()


class FormatEngine(ScriptedEngine):
    """ScriptedEngine whose forced generations end a call in a given format's syntax (`rest`, after the opening)."""

    def __init__(self, rest: str, names=()):
        super().__init__(names)
        self.rest = rest

    def generate(self, path: str, body: dict, timeout: float = 600) -> dict:
        result = super().generate(path, body, timeout)
        if "structured_outputs" not in body:
            for choice in result["choices"]:
                choice["message"]["content"] = self.rest
        return result


# Per format: the template in its family's style, and what a model writes after a forced opening.
FAMILIES = {"hermes": ("chatml_tools.jinja", "{}}\n</tool_call>"), "llama3_json": ("llama3_tools.jinja", "{}}"),
            "mistral": ("mistral_tools.jinja", "{}}]"), "mistral_v11": ("mistral_v11_tools.jinja", "{}")}


@pytest.mark.parametrize("name", FAMILIES)
def test_each_format_forces_a_call_and_records_its_opening(name):
    from lightning_otel.serve.toolcalls import FORMATS
    file, rest = FAMILIES[name]
    fmt, template = FORMATS[name], (FIXTURES / file).read_text()
    engine = FormatEngine(rest, names=["add", "weather"])
    gateway, spans = recording_gateway(engine, chat_template=template)  # the format is detected from the template
    assert (gateway.config.tool_format, gateway.config.native_tools, gateway.format) == (name, True, fmt)
    try:
        named = gateway.chat({"messages": ASK, "tools": [tool("weather"), tool("add")], "max_tokens": 8,
                              "tool_choice": {"type": "function", "function": {"name": "add"}}}, {}, None)
        several = gateway.chat({"messages": ASK, "tools": [tool("weather"), tool("add")], "tool_choice": "required",
                                "n": 2, "max_tokens": 8}, {}, None)
        auto = gateway.chat({"messages": ASK, "tools": [tool("weather")], "max_tokens": 8}, {}, None)
    finally:
        gateway.close()
    forced, choice, add, weather, free = engine.requests
    assert forced["messages"][-1] == {"role": "assistant", "content": fmt.forced_prefix("add")}
    assert choice["messages"][-1]["content"] == fmt.forced_prefix(None)  # the name choice continues here
    assert choice["structured_outputs"] == {"choice": ["weather", "add"]} and choice["n"] == 2
    assert [r["messages"][-1]["content"] for r in (add, weather)] == [fmt.forced_prefix("add"),
                                                                      fmt.forced_prefix("weather")]
    assert all(r["tools"] and r["tool_choice"] == "none" for r in engine.requests)
    # Mistral's markers are special tokens: the engine keeps them in the text whenever tools are offered.
    assert {r.get("skip_special_tokens", True) for r in engine.requests} == {not fmt.keep_special_tokens}
    assert "continue_final_message" not in free
    calls = [(c["message"]["tool_calls"][0]["function"]["name"], c["message"]["tool_calls"][0]["function"]["arguments"],
              c["finish_reason"]) for response in (named, several) for c in response["choices"]]
    assert calls == [("add", "{}", "tool_calls"), ("add", "{}", "tool_calls"), ("weather", "{}", "tool_calls")]
    assert auto["choices"][0]["message"] == {"role": "assistant", "content": rest}  # unforced "{}" is text
    records = [s.attributes.get("lightning.prompt.forced_prefix") for s in spans.get_finished_spans()]
    assert records == [fmt.forced_prefix("add"), fmt.forced_prefix("add"), fmt.forced_prefix("weather"), None]


def test_mistral_calls_get_ids_its_templates_accept_and_a_named_format_overrides_detection():
    engine = FormatEngine("{}}]")
    gateway, _ = recording_gateway(engine, chat_template=(FIXTURES / "mistral_tools.jinja").read_text())
    try:
        body = {"messages": ASK, "tools": [tool("add")], "tool_choice": "required", "max_tokens": 8}
        call = gateway.chat(body, {}, None)["choices"][0]["message"]["tool_calls"][0]
    finally:
        gateway.close()
    assert call["id"].isalnum() and len(call["id"]) == 9
    assert GatewayConfig(chat_template=TEMPLATE, tool_format="llama3_json").tool_format == "llama3_json"
    assert GatewayConfig(tool_format="mistral_v11").native_tools is False  # no template given: rendered
    with pytest.raises(UserError, match="tool format 'qwen' is unknown: choose one of hermes, llama3_json"):
        GatewayConfig(tool_format="qwen")


@pytest.mark.parametrize("name", ["llama3_json", "mistral", "mistral_v11"])
def test_a_template_without_tools_gets_them_rendered_in_the_named_format(name):
    from lightning_otel.serve.toolcalls import FORMATS
    fmt = FORMATS[name]
    engine = FormatEngine(FAMILIES[name][1])
    gateway, _ = recording_gateway(engine, tool_format=name)
    try:
        body = {"messages": HISTORY, "tools": [tool("weather")], "tool_choice": "required", "max_tokens": 8}
        message = gateway.chat(body, {}, None)["choices"][0]["message"]
    finally:
        gateway.close()
    sent = engine.requests[0]["messages"]
    assert "tools" not in engine.requests[0] and all(isinstance(m["content"], str) for m in sent)
    assert sent[-3]["content"].startswith(fmt.forced_prefix("weather"))  # the past call, in the format's syntax
    assert "sunny" in sent[-2]["content"] and sent[-2]["role"] in ("user", "ipython")
    assert sent[-1] == {"role": "assistant", "content": fmt.forced_prefix("weather")}
    assert message["tool_calls"][0]["function"] == {"name": "weather", "arguments": "{}"}
