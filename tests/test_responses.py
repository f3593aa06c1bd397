"""The Responses API on the rollout gateway (lightning_otel/serve/responses.py), without the engine: the
translation to the chat path and back, previous_response_id, bad requests (400 naming the parameter, 413),
and the real OpenAI and Agents SDKs (default model provider, tools, streamed and not) against the real
gateway server in front of a stand-in engine that answers given texts. The same over the real engine and the
instrumentations is in test_openai_agents.py."""
from __future__ import annotations

import asyncio
import json

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conftest import post
from lightning_otel.serve import responses
from lightning_otel.serve.gateway import GENERATE_SPAN, Gateway, GatewayConfig
from lightning_otel.serve.request_checks import BadRequest
from tests.helpers.streams import ChunkList, engine_chunks

CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "12 * 4 + 7"}}\n</tool_call>'
TOOL = {"type": "function", "name": "calculate", "description": "Evaluate arithmetic.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}


class ScriptedEngine:
    """Answers each generation with the next of `texts` (the part after a forced prefix, when the gateway
    opened the answer), in pieces of three characters, whole or streamed; keeps the requests it got."""
    name, policy_version, model_name = "stand-in", 0, "policy"

    def __init__(self, texts: list[str], finish: str = "stop"):
        self.texts, self.finish, self.requests = list(texts), finish, []

    def stream(self, path: str, body: dict, timeout: float = 600) -> ChunkList:
        self.requests.append(body)
        return ChunkList(engine_chunks([self.texts.pop(0)] * body.get("n", 1), finish=self.finish))

    def generate(self, path: str, body: dict, timeout: float = 600) -> dict:
        self.requests.append(body)
        text = self.texts.pop(0)
        if body.get("continue_final_message"):
            prefix = body["messages"][-1]["content"]
            assert text.startswith(prefix), (text, prefix)
            text = text[len(prefix):]
        pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
        return {"id": "chatcmpl-engine", "prompt_token_ids": [1, 2, 3],
                "usage": {"prompt_tokens": 3, "completion_tokens": len(pieces), "total_tokens": 3 + len(pieces)},
                "choices": [{"index": 0, "message": {"content": text}, "finish_reason": self.finish,
                             "token_ids": list(range(10, 10 + len(pieces))),
                             "logprobs": {"content": [{"token": p, "logprob": -0.5, "bytes": list(p.encode()),
                                                       "top_logprobs": []} for p in pieces]}}]}


@pytest.fixture
def serve():
    started: list[Gateway] = []

    def start(texts: list[str], finish: str = "stop", **config) -> tuple[Gateway, ScriptedEngine, list]:
        engine = ScriptedEngine(texts, finish)
        gateway = Gateway(engine, GatewayConfig(**config))
        spans = InMemorySpanExporter()
        gateway.provider.add_span_processor(SimpleSpanProcessor(spans))
        gateway.start()
        started.append(gateway)
        return gateway, engine, spans

    yield start
    for gateway in started:
        gateway.close()


@pytest.fixture(scope="module")
def refusing():
    """One gateway for the bad requests (none reaches its engine, which has nothing to answer)."""
    gateway = Gateway(ScriptedEngine([]), GatewayConfig())
    gateway.start()
    yield gateway
    gateway.close()


def respond(gateway: Gateway, body: dict, path: str = "/v1/responses") -> tuple[int, dict]:
    status, _, raw = post(gateway.url + path, json.dumps(body).encode(), "application/json")
    return status, json.loads(raw)


# ---- translation ----------------------------------------------------------------------------------------

def test_input_items_become_chat_messages_with_tool_calls_joined_to_their_turn():
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "12 * 4 + 7?"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me compute.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_a", "name": "calculate",
         "arguments": '{"expression": "12 * 4"}', "status": "completed"},
        {"type": "function_call", "call_id": "call_b", "name": "calculate", "arguments": '{"expression": "7"}'},
        {"type": "function_call_output", "call_id": "call_a", "output": "48"},
        {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "7"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "call_c", "name": "calculate", "arguments": "{}"},
    ]
    assert responses.input_messages(items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "12 * 4 + 7?"},
        {"role": "assistant", "content": "Let me compute.", "tool_calls": [
            {"id": "call_a", "type": "function",
             "function": {"name": "calculate", "arguments": '{"expression": "12 * 4"}'}},
            {"id": "call_b", "type": "function",
             "function": {"name": "calculate", "arguments": '{"expression": "7"}'}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "48"},
        {"role": "tool", "tool_call_id": "call_b", "content": "7"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_c", "type": "function", "function": {"name": "calculate", "arguments": "{}"}}]},
    ]
    assert responses.input_messages("hi") == [{"role": "user", "content": "hi"}]


def test_a_request_becomes_a_chat_request():
    body = {"model": "gpt-4o", "instructions": "You compute.", "input": "12 * 4 + 7?", "tools": [TOOL],
            "tool_choice": {"type": "function", "name": "calculate"}, "max_output_tokens": 64, "temperature": 0.3,
            "top_p": 0.9, "parallel_tool_calls": False, "store": True, "metadata": {"k": "v"},
            "reasoning": {"effort": "low"}, "truncation": "auto", "include": ["message.output_text.logprobs"],
            "text": {"format": {"type": "json_schema", "name": "answer", "schema": {"type": "object"}}},
            "extra": "ignored"}
    responses.check_responses(body)
    chat, history = responses.to_chat(body, responses.ResponseStore(4))
    assert chat == {
        "model": "gpt-4o", "messages": [{"role": "system", "content": "You compute."},
                                        {"role": "user", "content": "12 * 4 + 7?"}],
        "tools": [{"type": "function", "function": {"name": "calculate", "description": "Evaluate arithmetic.",
                                                    "parameters": TOOL["parameters"]}}],
        "tool_choice": {"type": "function", "function": {"name": "calculate"}}, "max_tokens": 64,
        "temperature": 0.3, "top_p": 0.9, "logprobs": True, "top_logprobs": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}}}}
    assert history == [{"role": "user", "content": "12 * 4 + 7?"}]  # instructions are not carried over


def test_the_store_keeps_the_most_recently_used():
    store = responses.ResponseStore(2)
    for key in ("a", "b"):
        store.put(key, [{"role": "user", "content": key}])
    assert store.get("a") is not None  # now b is the least recently used
    store.put("c", [])
    assert store.get("b") is None and store.get("a") is not None and store.get("c") == [] and len(store) == 2


@pytest.mark.parametrize("body,param", [
    ([], None),
    ({"model": "m"}, "input"),
    ({"input": 5}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": {}, "call_id": "c"}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": "{}"}]}, "tools[0].parameters"),
    ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice"),
    ({"input": "x", "tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": "64"}, "max_output_tokens"),
    ({"input": "x", "temperature": "hot"}, "temperature"),
    ({"input": "x", "stream": "yes"}, "stream"),
    ({"input": "x", "parallel_tool_calls": 1}, "parallel_tool_calls"),
    ({"input": "x", "store": "no"}, "store"),
    ({"input": "x", "instructions": ["a"]}, "instructions"),
    ({"input": "x", "metadata": {"k": 1}}, "metadata"),
    ({"input": "x", "include": "all"}, "include"),
    ({"input": "x", "truncation": "middle"}, "truncation"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
])
def test_bad_requests_get_a_400_that_names_the_parameter(refusing, body, param):
    status, payload = respond(refusing, body)
    assert status == 400 and payload["error"]["param"] == param, payload
    assert refusing.engine.requests == []


def test_malformed_and_oversized_bodies_over_raw_http(serve):
    gateway, _, _ = serve([], max_body_bytes=4096)
    status, _, raw = post(gateway.url + "/r/ro-1/v1/responses", b'{"input": ', "application/json")
    assert status == 400 and "not valid JSON" in json.loads(raw)["error"]["message"]
    status, _, raw = post(gateway.url + "/v1/responses", json.dumps({"input": "x" * 5000}).encode(), "application/json")
    assert status == 413 and "4096-byte limit" in json.loads(raw)["error"]["message"]


# ---- answers --------------------------------------------------------------------------------------------

def test_an_answer_with_a_tool_call_is_a_function_call_item_and_the_record_carries_the_response_id(serve):
    gateway, engine, spans = serve(["I will compute. " + CALL])
    status, response = respond(gateway, {"model": "gpt-4o", "input": "12 * 4 + 7?", "tools": [TOOL],
                                         "metadata": {"task": "t1"}}, "/r/ro-1/v1/responses")
    assert status == 200, response
    assert response["id"].startswith("resp_") and response["object"] == "response"
    assert (response["status"], response["model"], response["metadata"]) == ("completed", "gpt-4o", {"task": "t1"})
    message, call = response["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == "I will compute."
    assert call["type"] == "function_call" and call["name"] == "calculate" and call["call_id"].startswith("call_")
    assert json.loads(call["arguments"]) == {"expression": "12 * 4 + 7"}
    usage = response["usage"]
    assert usage["input_tokens"] == 3 and usage["total_tokens"] == 3 + usage["output_tokens"] > 3
    assert "<tools>" in engine.requests[0]["messages"][0]["content"]  # rendered for a model without native tools
    gateway.flush()
    (record,) = [s for s in spans.get_finished_spans() if s.name == GENERATE_SPAN]
    assert record.attributes["gen_ai.response.id"] == response["id"]
    assert record.attributes["lightning.rollout.id"] == "ro-1"


def test_required_and_cut_answers(serve):
    gateway, engine, _ = serve([CALL, "12 * 4 is"], finish="length")
    status, response = respond(gateway, {"input": "12 * 4 + 7?", "tools": [TOOL], "tool_choice": "required"})
    assert status == 200 and [o["type"] for o in response["output"]] == ["function_call"]
    assert response["status"] == "completed"  # the call was parsed: a length stop inside it does not matter
    # One tool offered: "required" is a call of it, its name forced in the opening.
    assert engine.requests[0]["messages"][-1] == {"role": "assistant",
                                                  "content": '<tool_call>\n{"name": "calculate", "arguments":'}
    status, response = respond(gateway, {"input": "12 * 4?", "max_output_tokens": 3})
    assert (response["status"], response["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert response["output"][0]["status"] == "incomplete" and engine.requests[1]["max_tokens"] == 3


def test_parallel_tool_calls_false_keeps_the_first_call(serve):
    two = CALL + "\n" + CALL.replace("12 * 4 + 7", "1 + 1")
    gateway, _, _ = serve([two, two])
    _, response = respond(gateway, {"input": "x", "tools": [TOOL]})
    assert [o["type"] for o in response["output"]] == ["function_call", "function_call"]
    _, response = respond(gateway, {"input": "x", "tools": [TOOL], "parallel_tool_calls": False})
    assert [o["type"] for o in response["output"]] == ["function_call"]


def test_previous_response_id_continues_the_stored_conversation(serve):
    gateway, engine, _ = serve([CALL, "55", "It was 55.", "never"])
    _, first = respond(gateway, {"instructions": "Compute.", "input": "12 * 4 + 7?", "tools": [TOOL]})
    call = first["output"][0]
    _, second = respond(gateway, {"instructions": "Compute again.", "previous_response_id": first["id"],
                                  "input": [{"type": "function_call_output", "call_id": call["call_id"],
                                             "output": "55"}], "store": False})
    assert second["previous_response_id"] == first["id"] and second["output"][0]["content"][0]["text"] == "55"
    seen = engine.requests[1]["messages"]  # rendered in the Hermes syntax: tool results are user turns
    assert seen[0]["role"] == "system" and seen[0]["content"].startswith("Compute again.")
    assert "Compute." not in seen[0]["content"].replace("Compute again.", "")
    assert [m["role"] for m in seen] == ["system", "user", "assistant", "user"]
    assert seen[2]["content"].startswith("<tool_call>")
    assert seen[3]["content"] == "<tool_response>\n55\n</tool_response>"
    # the first response is still there (a branch), the second was not stored
    status, third = respond(gateway, {"previous_response_id": first["id"], "input": "Say it."})
    assert status == 200 and [m["role"] for m in engine.requests[2]["messages"]][-1] == "user"
    status, refused = respond(gateway, {"previous_response_id": second["id"], "input": "Again."})
    assert status == 400 and refused["error"]["param"] == "previous_response_id"
    assert "store: false" in refused["error"]["message"]


def test_the_stream_has_openai_s_events_in_order(serve):
    gateway, _, _ = serve(["Sure. " + CALL])
    status, _, raw = post(gateway.url + "/v1/responses", json.dumps(
        {"input": "x", "tools": [TOOL], "stream": True}).encode(), "application/json")
    assert status == 200
    events = [json.loads(block.split("data: ", 1)[1]) for block in raw.decode().strip().split("\n\n")]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(deltas) == "Sure." and len(deltas) == 2  # as the engine sampled it: "Sur", "e."
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", *["response.output_text.delta"] * 2,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert events[0]["response"]["status"] == "in_progress" and events[-1]["response"]["status"] == "completed"
    assert "_token_pieces" not in events[-1]["response"]


# ---- the SDKs -------------------------------------------------------------------------------------------

def test_the_openai_sdk_parses_answers_streamed_and_not(serve):
    openai = pytest.importorskip("openai")
    text = "The answer is fifty-five."
    gateway, _, _ = serve([CALL, text, text, text])
    with openai.OpenAI(base_url=gateway.base_url("ro-sdk"), api_key="k") as client:  # closed: no idle connection
        check_answers(client, text)


def check_answers(client, text: str) -> None:
    first = client.responses.create(model="gpt-4o", input="12 * 4 + 7?", tools=[TOOL], tool_choice="required")
    (call,) = first.output
    assert call.type == "function_call" and call.name == "calculate" and first.usage.total_tokens > 0
    second = client.responses.create(model="gpt-4o", previous_response_id=first.id, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "55"}],
        include=["message.output_text.logprobs"])
    assert second.output_text == text and second.output[0].content[0].logprobs[0].logprob == -0.5
    deltas = []
    for event in client.responses.create(model="gpt-4o", input="Again?", stream=True):
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        final = event
    assert final.type == "response.completed" and "".join(deltas) == text and len(deltas) > 1
    with client.responses.stream(model="gpt-4o", input="Once more?") as stream:
        assert stream.get_final_response().output_text == text


def run_agent(base_url: str, streamed: bool) -> str:
    """The Agents SDK's default provider (MultiProvider: the Responses API) on the calculator tool, with a
    client of its own (the provider's default client shares one connection pool across the process)."""
    agents = pytest.importorskip("agents")
    import openai

    @agents.function_tool
    def calculate(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        return "55" if expression == "12 * 4 + 7" else "?"

    agent = agents.Agent(name="calculator", instructions="Use the tool.", tools=[calculate], model="gpt-4o",
                         model_settings=agents.ModelSettings(max_tokens=64, tool_choice="required"))

    async def go() -> str:
        async with openai.AsyncOpenAI(base_url=base_url, api_key="k") as client:
            config = agents.RunConfig(model_provider=agents.MultiProvider(openai_client=client), tracing_disabled=True)
            return await steps(config)

    async def steps(config) -> str:
        if not streamed:
            return (await agents.Runner.run(agent, "12 * 4 + 7?", run_config=config, max_turns=3)).final_output
        result = agents.Runner.run_streamed(agent, "12 * 4 + 7?", run_config=config, max_turns=3)
        async for _ in result.stream_events():
            pass
        return result.final_output
    return asyncio.run(go())


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_the_agents_sdk_default_provider_runs_a_tool_turn(serve, streamed):
    gateway, engine, spans = serve([CALL, "It is 55."])
    assert run_agent(gateway.base_url("ro-agent"), streamed) == "It is 55."
    second = engine.requests[1]["messages"]
    assert second[-1] == {"role": "user", "content": "<tool_response>\n55\n</tool_response>"}
    assert json.loads(second[-2]["content"].split("\n")[1]) == {"name": "calculate",
                                                                "arguments": {"expression": "12 * 4 + 7"}}
    gateway.flush()
    assert len([s for s in spans.get_finished_spans() if s.name == GENERATE_SPAN]) == 2


def test_a_refused_chat_request_still_names_a_responses_parameter():
    with pytest.raises(BadRequest) as info:
        responses.check_responses({"input": "x", "top_logprobs": 99})
    assert info.value.param == "top_logprobs"


def test_a_responses_request_names_the_llm_span_around_it_in_a_traceparent(serve):
    """The distro's hook (capture/responses_context.py): the record's parent is the LLM span current while the
    request was sent (the Agents SDK's openai.response); another current span is not named."""
    openai = pytest.importorskip("openai")
    from opentelemetry.sdk.trace import TracerProvider

    from lightning_otel.capture import responses_context

    responses_context.install()  # openai is imported: its Responses methods are wrapped now
    gateway, _, spans = serve(["a", "b", "c"])
    tracer = TracerProvider().get_tracer("agent")
    with openai.OpenAI(base_url=gateway.base_url("ro-tp"), api_key="k") as client:
        with tracer.start_as_current_span("openai.response", attributes={"gen_ai.operation.name": "chat"}) as llm:
            client.responses.create(model="m", input="x")
            client.responses.create(model="m", input="x", extra_headers={"traceparent": "00-" + "1" * 32 + "-"
                                                                         + "2" * 16 + "-01"})
        with tracer.start_as_current_span("calculator.agent", attributes={"gen_ai.operation.name": "invoke_agent"}):
            client.responses.create(model="m", input="x")
    gateway.flush()
    mine, theirs, none = [s for s in spans.get_finished_spans() if s.name == GENERATE_SPAN]
    context = llm.get_span_context()
    assert (mine.parent.trace_id, mine.parent.span_id) == (context.trace_id, context.span_id)
    assert (theirs.parent.trace_id, theirs.parent.span_id) == (int("1" * 32, 16), int("2" * 16, 16))
    assert none.parent is None
