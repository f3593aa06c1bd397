"""The OpenAI Responses API (`POST /v1/responses`) on the rollout gateway, as a translation over its chat path.

A request becomes one chat completion request (`to_chat`): `instructions` the system message, `input` (a string,
or items: messages with input_text/output_text parts, `function_call` and `function_call_output` items) the
messages, flat function tools `{"type": "function", "name", "parameters"}` chat tools, `max_output_tokens`
max_tokens. The gateway's chat path then samples and records it exactly as a chat call (token ids, logprobs,
policy version, the traceparent join, forced tool choices, training overrides), under the response's own id
("resp_..."), which is the id the client's LLM spans carry. Its answer becomes a Response (`to_response`): a
`message` item with one output_text part and a `function_call` item per tool call. Streamed (`ResponseStream`,
over the gateway's chat stream), created and in_progress go out first, the message item opens with the first
text and each `response.output_text.delta` follows the text as it is sampled, and the rest (the text's done
events, the function calls, completed) goes out when the answer is whole.

`previous_response_id` continues a stored conversation: each response's messages (less its instructions, which
OpenAI does not carry over either) and answer are kept in a bounded in-memory store (`ResponseStore`, least
recently used first out), unless the request says `store: false`; an unknown or evicted id is a 400 naming it.
Accepted and ignored: `reasoning`, `include` (but "message.output_text.logprobs", which returns logprobs),
`truncation`, `user`, `service_tier`, prompt cache options. Refused with a 400 naming them: hosted tools,
non-text input (images, files), `background`, `conversation` and stored `prompt` templates.

A generation cut by its token limit is `status: "incomplete"` with `incomplete_details.reason`
"max_output_tokens" (the stream ends with `response.incomplete`), as OpenAI answers; the Agents SDK raises
ModelBehaviorError on it. `parallel_tool_calls: false` and `max_tool_calls` keep the first call(s) of the
answer; the token record still holds everything the policy generated.
"""
from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any, Callable, Iterator

from lightning_otel.serve.request_checks import OFF_POLICY_NEUTRAL, BadRequest, check_common
from lightning_otel.serve.streaming import AnswerStream

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# Sampling parameters a Responses request may carry (extra_body included) that mean the same on the chat path,
# where the off-policy checks and the training overrides apply to them.
SAMPLING = (*OFF_POLICY_NEUTRAL, "temperature", "top_p", "seed", "stop")
UNSUPPORTED = {
    "background": "background responses are not served: run the request in the foreground",
    "conversation": "conversation objects are not kept: send the whole input, or chain with previous_response_id",
    "prompt": "stored prompt templates are not served: send instructions and input",
}


class ResponseStore:
    """The conversations of recent responses, for `previous_response_id`: at most `capacity`, least recently
    used first out. Thread-safe (the gateway answers on many threads)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: OrderedDict[str, list[dict]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, messages: list[dict]) -> None:
        with self._lock:
            self._items[response_id] = messages
            self._items.move_to_end(response_id)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> list[dict] | None:
        with self._lock:
            messages = self._items.get(response_id)
            if messages is not None:
                self._items.move_to_end(response_id)
            return messages

    def __len__(self) -> int:
        return len(self._items)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- request ------------------------------------------------------------------------------------------

def check_responses(body: Any) -> None:
    """The fields a Responses request carries besides its input and tools: each a 400 naming it when wrong."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    for key, why in UNSUPPORTED.items():
        if body.get(key) not in (None, False):
            raise BadRequest(f"'{key}': {why}", key)
    check_common({k: v for k, v in body.items() if k not in ("n", "max_tokens", "max_completion_tokens")}, 1)
    for key in ("max_output_tokens", "max_tool_calls"):
        value = body.get(key)
        if value is not None and (not _is_int(value) or value < 1):
            raise BadRequest(f"'{key}' must be a positive integer", key)
    for key in ("parallel_tool_calls", "store"):
        if not isinstance(body.get(key), (bool, type(None))):
            raise BadRequest(f"'{key}' must be true or false", key)
    for key in ("instructions", "previous_response_id", "user", "safety_identifier", "prompt_cache_key",
                "service_tier"):
        if not isinstance(body.get(key), (str, type(None))):
            raise BadRequest(f"'{key}' must be a string", key)
    for key in ("reasoning", "text", "stream_options"):
        if not isinstance(body.get(key), (dict, type(None))):
            raise BadRequest(f"'{key}' must be an object", key)
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise BadRequest("'metadata' must be an object of string values", "metadata")
    include = body.get("include")
    if include is not None and not (isinstance(include, list) and all(isinstance(x, str) for x in include)):
        raise BadRequest("'include' must be a list of strings", "include")
    if body.get("truncation") not in (None, "auto", "disabled"):
        raise BadRequest("'truncation' must be \"auto\" or \"disabled\"", "truncation")
    if body.get("input") is None and body.get("previous_response_id") is None:
        raise BadRequest("'input' is required: a string, or a list of input items", "input")


def to_chat(body: dict, store: ResponseStore) -> tuple[dict, list[dict]]:
    """The chat completion request for a checked Responses request, and the conversation to store with its
    answer (the messages less the instructions)."""
    history: list[dict] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        stored = store.get(previous)
        if stored is None:
            raise BadRequest(f"previous response {previous[:80]!r} is not here: this gateway keeps the last "
                             f"{store.capacity} stored responses in memory (not those sent with store: false, "
                             "nor those of an earlier gateway); send the whole conversation as input instead",
                             "previous_response_id")
        history = list(stored)
    history += input_messages(body.get("input"))
    tools = chat_tools(body.get("tools"))
    messages = ([{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []) + history
    if not messages:
        raise BadRequest("the request has no input: give 'input' (or 'instructions')", "input")
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    if tools:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = chat_tool_choice(body["tool_choice"], tools)
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    chat.update({k: body[k] for k in SAMPLING if body.get(k) is not None})
    response_format = chat_response_format((body.get("text") or {}).get("format"))
    if response_format is not None:
        chat["response_format"] = response_format
    if LOGPROBS_INCLUDE in (body.get("include") or []) or body.get("top_logprobs"):
        chat["logprobs"] = True
        chat["top_logprobs"] = body.get("top_logprobs") or 0
    return chat, history


def input_messages(items: Any) -> list[dict]:
    """Chat messages for the `input` field: a string is one user message; items are messages (roles user,
    assistant, system, developer), `function_call` items (joined to the assistant message before them) and
    `function_call_output` items (tool messages). Reasoning items are dropped (the gateway never writes any)."""
    if items is None:
        return []
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise BadRequest("'input' must be a string or a list of input items", "input")
    messages: list[dict] = []
    calls_open = False  # whether a function_call may join the last message (an assistant turn being built)
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise BadRequest(f"{where} must be an object (a message, function_call or function_call_output)", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str) or role not in ROLES:
                raise BadRequest(f"{where}.role must be one of {', '.join(ROLES)}, not {json.dumps(role)[:40]}",
                                 f"{where}.role")
            messages.append({"role": ROLES[role], "content": _content_text(item.get("content"), f"{where}.content")})
            calls_open = role == "assistant"
        elif kind == "function_call":
            for key in ("name", "arguments", "call_id"):
                if not isinstance(item.get(key), str):
                    raise BadRequest(f"{where}.{key} must be a string", f"{where}.{key}")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if not calls_open:
                messages.append({"role": "assistant", "content": None})
                calls_open = True
            messages[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise BadRequest(f"{where}.call_id must be a string", f"{where}.call_id")
            output = item.get("output")
            text = output if isinstance(output, str) else _content_text(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
            calls_open = False
        elif kind == "reasoning":
            continue
        else:
            raise BadRequest(f"{where} is a {json.dumps(kind)[:40]} item: the gateway takes messages, function_call "
                             "and function_call_output items", f"{where}.type")
    return messages


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or a list of content parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise BadRequest(f"{where}[{j}] must be a text part like {{\"type\": \"input_text\", \"text\": \"...\"}} "
                             f"(the policy reads text only), not {json.dumps(part)[:60]}", f"{where}[{j}]")
    return "".join(texts)


def chat_tools(tools: Any) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be a list of function tools", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise BadRequest(f"tools[{i}] is {json.dumps(kind)[:40]}: only function tools are served "
                             '({"type": "function", "name": "...", "parameters": {...}})', f"tools[{i}]")
        if not isinstance(tool.get("name"), str):
            raise BadRequest(f"tools[{i}].name must be a string", f"tools[{i}].name")
        if tool.get("parameters") is not None and not isinstance(tool["parameters"], dict):
            raise BadRequest(f"tools[{i}].parameters must be a JSON schema object", f"tools[{i}].parameters")
        if not isinstance(tool.get("description"), (str, type(None))):
            raise BadRequest(f"tools[{i}].description must be a string", f"tools[{i}].description")
        function = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
        if tool.get("description"):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any, tools: list[dict]) -> Any:
    if choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise BadRequest('tool_choice "required" needs \'tools\': offer the tools it may call', "tool_choice")
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        names = [t["function"]["name"] for t in tools]
        if choice["name"] not in names:
            raise BadRequest(f"tool_choice names {choice['name']!r}, which is not among the tools offered ({names})",
                             "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    raise BadRequest('tool_choice must be "auto", "none", "required" or {"type": "function", "name": "..."}, not '
                     f"{json.dumps(choice)[:80]}", "tool_choice")


def chat_response_format(format_: Any) -> dict | None:
    if format_ is None:
        return None
    kind = format_.get("type") if isinstance(format_, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema" and isinstance(format_.get("schema"), dict):
        schema = {k: format_[k] for k in ("name", "schema", "strict", "description") if format_.get(k) is not None}
        return {"type": "json_schema", "json_schema": schema}
    raise BadRequest('text.format must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
                     '"name": ..., "schema": {...}}', "text.format")


# ---- answer -------------------------------------------------------------------------------------------

def answer(body: Any, store: ResponseStore, chat: Callable[[dict, str], dict]) -> dict:
    """The Response to a Responses request; `chat(chat_body, response_id)` is the gateway's chat path (it
    records the call under response_id). The conversation is stored for previous_response_id unless `store`
    is false."""
    check_responses(body)
    chat_body, history = to_chat(body, store)
    response_id = new_id("resp")
    created = int(time.time())
    completion = chat(chat_body, response_id)
    remember(body, store, response_id, history, completion)
    return to_response(body, completion, response_id, created)


def remember(body: dict, store: ResponseStore, response_id: str, history: list[dict], completion: dict) -> None:
    """Keep the conversation and its answer for previous_response_id, unless the request says store: false."""
    if body.get("store", True):
        message = completion["choices"][0]["message"]
        reply = {"role": "assistant", "content": message.get("content")}
        calls = _kept_calls(body, message.get("tool_calls") or [])
        if calls:
            reply["tool_calls"] = calls
        store.put(response_id, history + [reply])


def _kept_calls(body: dict, calls: list[dict]) -> list[dict]:
    limit = 1 if body.get("parallel_tool_calls") is False else body.get("max_tool_calls")
    return calls[:limit] if limit else calls


def to_response(body: dict, completion: dict, response_id: str, created: int, message_id: str | None = None) -> dict:
    """A Response object (status completed, or incomplete when the token limit cut the answer) for the
    gateway's chat completion of the translated request (`message_id`: its message item's, when streamed)."""
    choice = completion["choices"][0]
    message = choice["message"]
    incomplete = choice.get("finish_reason") == "length"
    status = "incomplete" if incomplete else "completed"
    output: list[dict] = []
    content = message.get("content") or ""
    calls = _kept_calls(body, message.get("tool_calls") or [])
    if content or not calls:
        part = {"type": "output_text", "text": content, "annotations": []}
        if choice.get("logprobs") and not calls:
            part["logprobs"] = [_logprob(t) for t in choice["logprobs"].get("content") or []]
        output.append({"type": "message", "id": message_id or new_id("msg"), "status": status, "role": "assistant",
                       "content": [part]})
    for call in calls:
        output.append({"type": "function_call", "id": new_id("fc"), "call_id": call["id"],
                       "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                       "status": "completed"})
    usage = completion.get("usage") or {}
    return {
        "id": response_id, "object": "response", "created_at": created, "status": status, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "max_tool_calls": body.get("max_tool_calls"), "model": completion["model"], "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"), "reasoning": body.get("reasoning"),
        "store": body.get("store", True), "temperature": body.get("temperature"),
        "text": body.get("text") or {"format": {"type": "text"}}, "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [], "top_p": body.get("top_p"), "truncation": body.get("truncation", "disabled"),
        "usage": {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": usage.get("completion_tokens", 0),
                  "total_tokens": usage.get("total_tokens", 0),
                  "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                  "output_tokens_details": {"reasoning_tokens": 0}},
        "user": body.get("user"), "metadata": body.get("metadata") or {},
    }


def _logprob(token: dict) -> dict:
    def one(t: dict) -> dict:
        return {"token": t.get("token", ""), "logprob": t.get("logprob", 0.0), "bytes": t.get("bytes") or []}
    return {**one(token), "top_logprobs": [one(t) for t in token.get("top_logprobs") or []]}


# ---- streaming ----------------------------------------------------------------------------------------

def stream(body: Any, store: ResponseStore, chat_stream: Callable[[dict, str], AnswerStream]) -> ResponseStream:
    """The streamed Response to a Responses request; `chat_stream(chat_body, response_id)` opens the gateway's
    chat stream (recorded under response_id). A refused request raises here, before any event."""
    check_responses(body)
    chat_body, history = to_chat(body, store)
    response_id = new_id("resp")
    return ResponseStream(body, store, history, response_id, chat_stream(chat_body, response_id))


class ResponseStream:
    """The Responses SSE events of one answer, in OpenAI's order, as its chat stream yields text: created and
    in_progress, the message item's added events with the first text, a delta per piece of text, then at the
    end the text's done events, a function_call item per call (added, arguments delta and done, done) and
    completed (incomplete when the token limit cut the answer). None between events: nothing to send yet.
    The conversation is stored (unless `store` is false) once the answer is whole."""

    def __init__(self, body: dict, store: ResponseStore, history: list[dict], response_id: str, chat: AnswerStream):
        self.body, self.store, self.history, self.id, self.chat = body, store, history, response_id, chat
        self.created = int(time.time())
        self.message_id = new_id("msg")
        self._sequence = 0

    def close(self) -> None:
        self.chat.close()

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {kind}\ndata: ".encode() + json.dumps(data).encode() + b"\n\n"

    def __iter__(self) -> Iterator[bytes | None]:
        empty = {"id": "", "created": self.created, "model": self.chat.model,
                 "choices": [{"message": {"content": ""}, "finish_reason": None}]}
        started = {**to_response(self.body, empty, self.id, self.created), "status": "in_progress",
                   "output": [], "usage": None, "incomplete_details": None}
        yield self._event("response.created", response=started)
        yield self._event("response.in_progress", response=started)
        where = {"item_id": self.message_id, "output_index": 0}
        text = ""
        for chunks in self.chat:
            out = []
            for chunk in chunks:
                if isinstance(chunk.get("error"), dict):
                    yield from self._failed(started, chunk["error"])
                    return
                for choice in chunk.get("choices") or []:
                    delta = (choice.get("delta") or {}).get("content")
                    if not delta:
                        continue
                    if not text:
                        out += self._message_opened()
                    text += delta
                    out.append(self._event("response.output_text.delta", **where, content_index=0, delta=delta,
                                           logprobs=[]))
            yield from out or [None]
        final = to_response(self.body, self.chat.completion, self.id, self.created, self.message_id)
        if text and not any(item["id"] == self.message_id for item in final["output"]):
            final["output"].insert(0, {"type": "message", "id": self.message_id, "status": final["status"],
                                       "role": "assistant",
                                       "content": [{"type": "output_text", "text": text, "annotations": []}]})
        remember(self.body, self.store, self.id, self.history, self.chat.completion)
        yield from self._rest(final, opened=bool(text))

    def _message_opened(self) -> list[bytes]:
        item = {"type": "message", "id": self.message_id, "status": "in_progress", "role": "assistant",
                "content": []}
        return [self._event("response.output_item.added", output_index=0, item=item),
                self._event("response.content_part.added", item_id=self.message_id, output_index=0, content_index=0,
                            part={"type": "output_text", "text": "", "annotations": []})]

    def _rest(self, final: dict, opened: bool) -> Iterator[bytes]:
        for index, item in enumerate(final["output"]):
            where = {"item_id": item["id"], "output_index": index}
            if item["type"] == "message":
                if not opened:
                    yield from self._message_opened()
                part = item["content"][0]
                yield self._event("response.output_text.done", **where, content_index=0, text=part["text"],
                                  logprobs=[])
                yield self._event("response.content_part.done", **where, content_index=0, part=part)
            else:
                yield self._event("response.output_item.added", output_index=index,
                                  item={**item, "arguments": "", "status": "in_progress"})
                yield self._event("response.function_call_arguments.delta", **where, delta=item["arguments"])
                yield self._event("response.function_call_arguments.done", **where, arguments=item["arguments"],
                                  name=item["name"])
            yield self._event("response.output_item.done", output_index=index, item=item)
        yield self._event("response.incomplete" if final["status"] == "incomplete" else "response.completed",
                          response=final)

    def _failed(self, started: dict, error: dict) -> Iterator[bytes]:
        message = str(error.get("message") or "the engine failed")
        yield self._event("error", code=str(error.get("code") or "server_error"), message=message, param=None)
        yield self._event("response.failed", response={**started, "status": "failed",
                                                       "error": {"code": "server_error", "message": message}})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
