"""What a rollout did, read from its spans: the tool calls it made, in order, for reward functions.

    from lightning_otel.rollouts.trace_view import tool_calls

    def my_reward(task, rollout):
        calls = [c for c in tool_calls(rollout) if c.name == "search"]
        ...

Each instrumentation records a tool call its own way, and `tool_calls` reads them all into one shape
(`ToolCall`: name, arguments, result, call id):
- a tool span (`execute_tool <name>`, or `<name>.tool`, or any span whose `gen_ai.operation.name` is
  `execute_tool` or whose `traceloop.span.kind` is `tool`) with the GenAI attributes `gen_ai.tool.name`,
  `gen_ai.tool.call.arguments` (JSON text), `gen_ai.tool.call.result`, `gen_ai.tool.call.id`: the OpenAI Agents
  SDK's and Microsoft Agent Framework's instrumentations;
- LangChain / LangGraph (Traceloop's `opentelemetry-instrumentation-langchain`): a tool span whose arguments
  attribute (`gen_ai.tool.call.arguments`, in older versions `traceloop.entity.input`) is the whole callback
  payload, `{"input_str", "inputs", "kwargs": {"tool_call_id"}, ...}`, and whose result
  (`gen_ai.tool.call.result` / `traceloop.entity.output`) is `{"output": <a ToolMessage or the text>}`;
- AutoGen: a tool span with the name and call id but no arguments or result; they are taken from the model's
  answer that asked for the call (`gen_ai.output.messages`, a `tool_call` part with the same id) and from the
  next prompt that carries its result (`gen_ai.input.messages`, a `tool_call_response` part);
- no tool spans at all (the plain OpenAI SDK loop, CrewAI): the calls the model asked for in its answers, with
  the results later prompts carried back (None when none did).

When a rollout has tool spans, they are its calls (a framework that traces its tools traces each of them);
otherwise the model's requests are. Calls keep the order they started in.
"""
from __future__ import annotations

import ast
import json
from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping

__all__ = ["ToolCall", "span_attributes", "tool_calls"]

LLM_OPERATIONS = ("chat", "text_completion", "completion", "generate_content")


@dataclass(frozen=True)
class ToolCall:
    name: str | None
    arguments: dict | str | None  # a JSON object as a dict, other arguments as their text, None when unrecorded
    result: str | None  # what the tool returned, as text; None when it was not recorded
    call_id: str | None = None
    start_ns: int | None = None
    failed: bool = False  # the tool span ended with status ERROR
    span_id: str | None = None  # the tool span, or the LLM span whose answer asked for the call
    source: str = "tool_span"  # "tool_span", or "request" when read from the model's answer

    def strings(self) -> list[str]:
        """The argument values that are text (all of the arguments when they are not an object)."""
        if isinstance(self.arguments, dict):
            return [v for v in self.arguments.values() if isinstance(v, str)]
        return [self.arguments] if isinstance(self.arguments, str) else []


def span_attributes(span: Mapping) -> dict:
    """A span's attributes as a dict, whether the store gave them as JSON text or already parsed."""
    attributes = span.get("attributes") or {}
    if isinstance(attributes, str):
        try:
            attributes = json.loads(attributes)
        except ValueError:
            return {}
    return attributes if isinstance(attributes, dict) else {}


def _json(text: Any) -> Any:
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def _as_text(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def _object_or_text(value: Any) -> dict | str | None:
    """Arguments as a dict when they are a JSON object (or a Python dict's repr, as LangChain writes input_str)."""
    if value is None or isinstance(value, dict):
        return value
    if not isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    parsed = _json(value)
    if isinstance(parsed, dict):
        return parsed
    try:
        literal = ast.literal_eval(value)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return value
    return literal if isinstance(literal, dict) else value


def _is_langchain_payload(value: Any) -> bool:
    return isinstance(value, dict) and "input_str" in value and ("inputs" in value or "kwargs" in value)


def _langchain_arguments(payload: dict) -> tuple[dict | str | None, str | None]:
    """(arguments, call id) from LangChain's on_tool_start payload."""
    kwargs = payload.get("kwargs") if isinstance(payload.get("kwargs"), dict) else {}
    inputs = payload.get("inputs")
    arguments = inputs if isinstance(inputs, dict) else _object_or_text(payload.get("input_str"))
    return arguments, kwargs.get("tool_call_id")


def _result(raw: Any) -> tuple[str | None, str | None]:
    """(result text, call id) from a result attribute; LangChain's is {"output": <ToolMessage or text>, ...}."""
    value = _json(raw)
    if not (isinstance(value, dict) and "output" in value and set(value) <= {"output", "kwargs"}):
        return _as_text(raw), None
    output = value["output"]
    message = output.get("kwargs") if isinstance(output, dict) and output.get("type") == "constructor" else None
    if isinstance(message, dict):
        return _as_text(message.get("content")), message.get("tool_call_id")
    return _as_text(output), None


def _is_tool_span(span: Mapping, attributes: dict) -> bool:
    name = str(span.get("name") or "")
    operation = span.get("operation_name") or attributes.get("gen_ai.operation.name")
    return (operation == "execute_tool" or name.startswith("execute_tool ") or name.endswith(".tool")
            or attributes.get("traceloop.span.kind") == "tool")


def _from_tool_span(span: Mapping, attributes: dict) -> ToolCall:
    name = attributes.get("gen_ai.tool.name") or attributes.get("traceloop.entity.name")
    if not name:
        span_name = str(span.get("name") or "")
        name = span_name.removeprefix("execute_tool ").removesuffix(".tool") or None
    raw = attributes.get("gen_ai.tool.call.arguments", attributes.get("traceloop.entity.input"))
    call_id = attributes.get("gen_ai.tool.call.id")
    parsed = _json(raw)
    if _is_langchain_payload(parsed):
        arguments, payload_id = _langchain_arguments(parsed)
        call_id = call_id or payload_id
    else:  # a JSON object, JSON text (decoded), other JSON (as recorded), or text that is no JSON
        arguments = _object_or_text(parsed if isinstance(parsed, (dict, str)) else raw)
    result, result_id = _result(attributes.get("gen_ai.tool.call.result", attributes.get("traceloop.entity.output")))
    return ToolCall(name=name, arguments=arguments, result=result, call_id=call_id or result_id,
                    start_ns=span.get("start_ns"), failed=span.get("status_code") == "ERROR",
                    span_id=span.get("span_id"))


def _messages(attributes: dict, key: str) -> list[dict]:
    value = _json(attributes.get(key))
    return [m for m in value if isinstance(m, dict)] if isinstance(value, list) else []


def _parts(messages: list[dict], kind: str) -> list[dict]:
    return [p for m in messages for p in (m.get("parts") or []) if isinstance(p, dict) and p.get("type") == kind]


def _is_llm_span(span: Mapping, attributes: dict) -> bool:
    operation = span.get("operation_name") or attributes.get("gen_ai.operation.name")
    return operation in LLM_OPERATIONS and span.get("name") != "lightning.generate"


def _ordered(spans: Iterable[Mapping]) -> list[tuple[Mapping, dict]]:
    listed = list(spans)
    order = sorted(range(len(listed)), key=lambda i: (listed[i].get("start_ns") is None,
                                                      listed[i].get("start_ns") or 0, i))
    return [(listed[i], span_attributes(listed[i])) for i in order]


def tool_calls(rollout: Mapping | Iterable[Mapping]) -> list[ToolCall]:
    """The tool calls of a rollout (the `rollout` dict a reward function gets, or its spans), in the order they
    started (module docstring: how each instrumentation's records are read)."""
    spans = (rollout.get("spans") or []) if isinstance(rollout, Mapping) else rollout
    ordered = _ordered(spans)
    requested: dict[str, ToolCall] = {}  # call id -> the call as the model asked for it
    unnamed: list[ToolCall] = []  # requests without an id cannot be matched or deduplicated
    responses: dict[str, str | None] = {}  # call id -> the result a later prompt carried back
    for span, attributes in ordered:
        if not _is_llm_span(span, attributes):
            continue
        for part in _parts(_messages(attributes, "gen_ai.input.messages"), "tool_call_response"):
            if part.get("id"):
                responses.setdefault(part["id"], _as_text(part.get("response")))
        for part in _parts(_messages(attributes, "gen_ai.output.messages"), "tool_call"):
            call = ToolCall(name=part.get("name"), arguments=_object_or_text(part.get("arguments")), result=None,
                            call_id=part.get("id"), start_ns=span.get("start_ns"), span_id=span.get("span_id"),
                            source="request")
            if call.call_id is None:
                unnamed.append(call)
            else:
                requested.setdefault(call.call_id, call)  # a framework's span wrapping the SDK's says it again
    traced = [_from_tool_span(span, attributes) for span, attributes in ordered if _is_tool_span(span, attributes)]
    if traced:
        return [_filled(call, requested.get(call.call_id or ""), responses.get(call.call_id or "")) for call in traced]
    calls = sorted([*requested.values(), *unnamed], key=lambda c: (c.start_ns is None, c.start_ns or 0))
    return [_filled(call, None, responses.get(call.call_id or "")) for call in calls]


def _filled(call: ToolCall, request: ToolCall | None, response: str | None) -> ToolCall:
    """The call with what its span left out taken from the model's request and the prompt that carried its result."""
    return replace(call, name=call.name or (request.name if request else None),
                   arguments=call.arguments if call.arguments is not None else (request.arguments if request else None),
                   result=call.result if call.result is not None else response)
