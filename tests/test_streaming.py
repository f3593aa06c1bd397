"""Real streaming on the rollout gateway (lightning_otel/serve/streaming.py), without the engine: the real
gateway server in front of a stand-in engine whose stream is held at a gate before its last piece, so a test
sees what reached the client before generation ended. Chat and Responses, read by the real OpenAI SDK; text
held back where a tool call may begin; n > 1; the record written whole at the end, also when the client leaves
or stops reading mid-stream; and VLLMEngine.stream reading a canned event stream over HTTP. The same over the
real engine is in test_gateway.py."""
from __future__ import annotations

import json
import select
import socket
import threading
import time

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from lightning_otel.serve.engine import EngineError
from lightning_otel.serve.gateway import FINISH_ATTRIBUTE, GENERATE_SPAN, Gateway, GatewayConfig
from lightning_otel.serve.streaming import HeldText, held_back
from test_slow_clients import connect
from tests.helpers.streams import PROMPT_IDS, TOKEN_BASE, ChunkList, engine_chunks

openai = pytest.importorskip("openai")

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}
HI = [{"role": "user", "content": "hi"}]
BOUND_S = 20.0  # far above what any wait here takes: a busy machine must not fail the tests


class GatedEngine:
    """Streams each request's answer (`texts`, one per choice, repeated to n) held at a gate before the last
    piece; the gate is the test's to open. Whole answers (forced calls) come from the same texts."""
    name, policy_version, model_name = "stand-in", 0, "policy"

    def __init__(self, texts: list[str], piece: int = 3, **stream_options):
        self.texts, self.piece, self.stream_options = texts, piece, stream_options
        self.gate = threading.Event()
        self.streams: list[ChunkList] = []
        self.requests: list[dict] = []

    def stream(self, path: str, body: dict, timeout: float = 600) -> ChunkList:
        self.requests.append(body)
        texts = self.texts * body.get("n", 1) if len(self.texts) == 1 else self.texts
        self.streams.append(ChunkList(engine_chunks(texts, self.piece), gate=self.gate, **self.stream_options))
        return self.streams[-1]

    def generate(self, path: str, body: dict, timeout: float = 600) -> dict:
        self.requests.append(body)
        text = self.texts[0]
        if body.get("continue_final_message"):
            text = text[len(body["messages"][-1]["content"]):]
        return {"id": "chatcmpl-whole", "prompt_token_ids": PROMPT_IDS,
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
                "choices": [{"index": 0, "message": {"content": text}, "finish_reason": "stop", "token_ids": [9],
                             "logprobs": {"content": [{"token": text, "logprob": -0.1}]}}]}


@pytest.fixture
def serve():
    started: list[Gateway] = []

    def start(engine: GatedEngine, **config) -> tuple[Gateway, InMemorySpanExporter]:
        gateway = Gateway(engine, GatewayConfig(**config))
        spans = InMemorySpanExporter()
        gateway.provider.add_span_processor(SimpleSpanProcessor(spans))
        gateway.start()
        started.append(gateway)
        return gateway, spans

    yield start
    for gateway in started:
        gateway.close()


def records(gateway: Gateway, spans: InMemorySpanExporter) -> list:
    gateway.flush()
    return sorted((s for s in spans.get_finished_spans() if s.name == GENERATE_SPAN),
                  key=lambda s: s.attributes["lightning.choice.index"])


# ---- what is held back -------------------------------------------------------------------------------

def test_only_an_end_that_could_begin_a_call_is_held_back():
    ends = ("ab<", "ab<tool", "<tool_cal", "a<b", "", "x<tool_call", "<<")
    assert [held_back(text, "<tool_call>") for text in ends] == [1, 5, 9, 0, 0, 10, 1]


def test_held_text_goes_out_once_it_cannot_begin_a_call_and_whitespace_waits_for_what_follows():
    held = HeldText("<tool_call>")
    assert [held.feed(d) for d in ("Use", " <to", "ol> tags", ".\n", "\n<tool_", "call>", '{"x"')] == \
        ["Use", "", " <tool> tags", ".", "", "", ""]
    assert held.in_call and held.rest("Use <tool> tags.") == ""
    assert held.rest(held.text) == "\n\n<tool_call>{\"x\""  # not a call after all: the rest is content
    plain = HeldText(None)
    assert [plain.feed(d) for d in ("a <", "tool_call> ", "\n")] == ["a <", "tool_call> ", "\n"]


# ---- chat ----------------------------------------------------------------------------------------------

def test_content_reaches_the_client_before_the_engine_has_finished_and_is_recorded_whole(serve):
    text = "The answer is fifty-five."
    engine = GatedEngine([text])
    gateway, spans = serve(engine)
    received, first_content_at = [], None
    with openai.OpenAI(base_url=gateway.base_url("ro-stream"), api_key="k") as client:
        stream = client.chat.completions.create(model="gpt-4o", messages=HI, stream=True, logprobs=True,
                                                stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if first_content_at is None:
                    first_content_at = engine.streams[0].produced
                    engine.gate.set()  # the engine produces its last piece only now
                received.append(chunk)
            elif not chunk.choices:
                usage = chunk.usage
    assert engine.streams[0].gate_opened, "the first chunk reached the client only after the engine finished"
    assert first_content_at < len(engine.streams[0].chunks) - 1
    assert "".join(c.choices[0].delta.content for c in received) == text and len(received) > 1
    assert all(c.id == received[0].id and c.model == "gpt-4o" for c in received)
    assert received[0].choices[0].logprobs.content[0].logprob == -0.5
    assert (usage.prompt_tokens, usage.completion_tokens) == (3, len(received))
    (record,) = records(gateway, spans)
    pieces = len(range(0, len(text), 3))
    assert list(record.attributes["lightning.prompt.token_ids"]) == PROMPT_IDS
    assert list(record.attributes["lightning.completion.token_ids"]) == list(range(TOKEN_BASE, TOKEN_BASE + pieces))
    assert list(record.attributes["lightning.completion.logprobs"]) == [-0.5] * pieces
    assert list(record.attributes[FINISH_ATTRIBUTE]) == ["stop"]
    assert record.attributes["gen_ai.response.id"] == received[0].id
    assert record.attributes["lightning.rollout.id"] == "ro-stream"
    assert engine.requests[0]["messages"] == HI and "stream" not in engine.requests[0]


def test_a_call_is_held_back_and_sent_parsed_while_the_text_before_it_streams(serve):
    engine = GatedEngine(["Let me add.\n" + CALL])
    gateway, spans = serve(engine)
    content, calls, finish = [], [], None
    with openai.OpenAI(base_url=gateway.base_url(), api_key="k") as client:
        for chunk in client.chat.completions.create(model="m", messages=HI, tools=[TOOL], stream=True):
            delta = chunk.choices[0].delta
            if delta.content:
                content.append(delta.content)
                engine.gate.set()
            calls += delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
    assert engine.streams[0].gate_opened
    assert "".join(content) == "Let me add." and finish == "tool_calls"
    (call,) = calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 1, "b": 2})
    assert list(records(gateway, spans)[0].attributes[FINISH_ATTRIBUTE]) == ["stop"]  # what the engine did


def test_held_text_that_is_no_call_goes_out_as_content(serve):
    text = "Write <tool_call>{not json}</tool_call> to call."
    engine = GatedEngine([text])
    gateway, _ = serve(engine)
    engine.gate.set()
    with openai.OpenAI(base_url=gateway.base_url(), api_key="k") as client:
        chunks = list(client.chat.completions.create(model="m", messages=HI, tools=[TOOL], stream=True))
    parts = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert "".join(parts) == text and parts[-1] == " <tool_call>{not json}</tool_call> to call."  # held to the end
    assert chunks[-1].choices[0].finish_reason == "stop" and not any(c.choices[0].delta.tool_calls for c in chunks)


def test_choices_stream_interleaved_by_index_and_are_recorded_each(serve):
    engine = GatedEngine(["first answer", "second one here"])
    gateway, spans = serve(engine)
    order, texts = [], {0: "", 1: ""}
    with openai.OpenAI(base_url=gateway.base_url(), api_key="k") as client:
        for chunk in client.chat.completions.create(model="m", messages=HI, n=2, stream=True):
            (choice,) = chunk.choices
            if choice.delta.content:
                order.append(choice.index)
                texts[choice.index] += choice.delta.content
                engine.gate.set()
    assert engine.streams[0].gate_opened
    assert texts == {0: "first answer", 1: "second one here"} and order[:4] == [0, 1, 0, 1]
    assert [len(r.attributes["lightning.completion.token_ids"]) for r in records(gateway, spans)] == [4, 5]


def test_a_forced_call_streams_nothing_until_it_is_parsed(serve):
    engine = GatedEngine([CALL])
    gateway, spans = serve(engine)
    with openai.OpenAI(base_url=gateway.base_url(), api_key="k") as client:
        chunks = list(client.chat.completions.create(model="m", messages=HI, tools=[TOOL], tool_choice="required",
                                                     stream=True))
    assert not engine.streams and engine.requests[0]["continue_final_message"]  # made whole
    assert not any(c.choices[0].delta.content for c in chunks)
    (call,) = [call for c in chunks for call in c.choices[0].delta.tool_calls or []]
    assert call.function.name == "add" and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert records(gateway, spans)[0].attributes["lightning.prompt.forced_prefix"]


def test_an_engine_that_fails_mid_stream_gives_the_client_an_error_and_records_what_it_made(serve):
    failure = EngineError(500, {"error": {"message": "the engine fell over", "type": "InternalServerError"}})
    engine = GatedEngine(["abcdefghijkl"], error=failure, error_at=3)
    gateway, spans = serve(engine)
    engine.gate.set()
    with openai.OpenAI(base_url=gateway.base_url(), api_key="k", max_retries=0) as client:
        with pytest.raises(openai.APIError, match="fell over"):
            list(client.chat.completions.create(model="m", messages=HI, stream=True))
    (record,) = records(gateway, spans)
    assert list(record.attributes["lightning.completion.token_ids"]) == [TOKEN_BASE, TOKEN_BASE + 1]
    assert list(record.attributes[FINISH_ATTRIBUTE]) == ["error"]


# ---- clients that leave or stop reading -----------------------------------------------------------------

def raw_stream(url: str, path: str, body: dict, rcvbuf: int | None = None) -> socket.socket:
    sock = connect(url, rcvbuf)
    raw = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
    return sock


def test_a_client_that_leaves_mid_stream_stops_the_generation_and_its_part_is_recorded(serve):
    engine = GatedEngine(["x" * 3000], delay_s=0.005)
    gateway, spans = serve(engine)
    sock = raw_stream(gateway.url, "/r/ro-left/v1/chat/completions", {"messages": HI, "stream": True})
    received = b""
    while b'"content": "xxx"' not in received:
        received += sock.recv(4096)
    sock.close()
    assert engine.streams[0].closed.wait(BOUND_S), "the engine's stream was not closed"
    deadline = time.monotonic() + BOUND_S
    while not records(gateway, spans) and time.monotonic() < deadline:
        time.sleep(0.05)
    (record,) = records(gateway, spans)
    made = len(record.attributes["lightning.completion.token_ids"])
    assert 1 <= made < 1000 and engine.streams[0].produced < len(engine.streams[0].chunks)
    assert list(record.attributes[FINISH_ATTRIBUTE]) == ["client_disconnected"]
    assert len(record.attributes["lightning.completion.logprobs"]) == made


def test_a_client_that_stops_reading_a_stream_is_cut_after_the_send_timeout(serve):
    engine = GatedEngine(["y" * 8_000_000], piece=8000)  # more than the socket buffers hold
    gateway, spans = serve(engine, send_timeout_s=1.0)
    engine.gate.set()
    sock = raw_stream(gateway.url, "/r/ro-stuck/v1/chat/completions", {"messages": HI, "stream": True}, rcvbuf=4096)
    assert select.select([sock], [], [], BOUND_S)[0], "the stream never started"
    assert engine.streams[0].closed.wait(BOUND_S), "a client that reads nothing held its stream open"
    sock.close()
    deadline = time.monotonic() + BOUND_S
    while not records(gateway, spans) and time.monotonic() < deadline:
        time.sleep(0.05)
    (record,) = records(gateway, spans)
    assert list(record.attributes[FINISH_ATTRIBUTE]) == ["client_disconnected"]
    assert 0 < len(record.attributes["lightning.completion.token_ids"]) < 1000


# ---- Responses -----------------------------------------------------------------------------------------

def test_a_responses_stream_sends_its_text_as_it_is_sampled_and_the_rest_at_the_end(serve):
    engine = GatedEngine(["Adding now. " + CALL])
    gateway, spans = serve(engine)
    tool = {"type": "function", "name": "add", "parameters": {"type": "object", "properties": {}}}
    kinds, deltas = [], []
    with openai.OpenAI(base_url=gateway.base_url("ro-resp"), api_key="k") as client:
        for event in client.responses.create(model="gpt-4o", input="1 + 2?", tools=[tool], stream=True):
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
                engine.gate.set()
            final = event
    assert engine.streams[0].gate_opened
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert "".join(deltas) == "Adding now." and final.type == "response.completed"
    message, call = final.response.output
    assert message.content[0].text == "Adding now." and (call.name, call.arguments) == ("add", '{"a": 1, "b": 2}')
    (record,) = records(gateway, spans)
    assert record.attributes["gen_ai.response.id"] == final.response.id
    # stored: the next response continues it
    with openai.OpenAI(base_url=gateway.base_url("ro-resp"), api_key="k") as client:
        engine.texts = ["3."]
        answer = client.responses.create(model="gpt-4o", previous_response_id=final.response.id, input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": "3"}], stream=True)
        assert [e for e in answer][-1].response.output_text == "3."
    assert [m["role"] for m in engine.requests[-1]["messages"]][-3:] == ["user", "assistant", "user"]


# ---- the engine's stream, read from HTTP ---------------------------------------------------------------

@pytest.fixture
def sse_server():
    """A server that answers every POST with the given bytes as an event stream (status 200), and keeps
    the bodies it got."""
    from tests.helpers.loopback import LoopbackServer, QuietHandler

    answer, bodies = [b""], []

    class Handler(QuietHandler):
        def do_POST(self):  # noqa: N802
            bodies.append(self.json_body())
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(answer[0])

    def serve(raw: bytes):
        answer[0] = raw
        return server.url, bodies

    with LoopbackServer(Handler) as server:
        yield serve


def test_the_engine_stream_asks_for_ids_and_usage_and_raises_on_errors_and_cut_streams(sse_server, tmp_path):
    from lightning_otel.serve.engine import EngineConfig, VLLMEngine
    (tmp_path / "config.json").write_text("{}")
    engine = VLLMEngine(EngineConfig(model_dir=tmp_path))
    chunks = engine_chunks(["abc"])
    sse = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
    engine.url, bodies = sse_server(b": a comment\n\n" + sse + b"data: [DONE]\n\n")
    assert list(engine.stream("/v1/chat/completions", {"messages": HI, "stream": False})) == chunks
    assert {k: bodies[0][k] for k in ("stream", "stream_options", "return_token_ids", "logprobs", "model")} == \
        {"stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True, "logprobs": True,
         "model": "policy"}
    error = {"error": {"message": "boom", "type": "InternalServerError", "param": None, "code": 500}}
    for raw, status, needle in ((sse[:40] + b"\n\n", 502, "not JSON"), (sse, 502, "before its [DONE]"),
                                (b"data: " + json.dumps(error).encode() + b"\n\n", 500, "boom")):
        engine.url, _ = sse_server(raw)
        with pytest.raises(EngineError, match=needle.replace("[", r"\[")) as caught:
            list(engine.stream("/v1/chat/completions", {"messages": HI}))
        assert caught.value.status == status
