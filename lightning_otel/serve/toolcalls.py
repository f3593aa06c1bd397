"""Tool-call formats: how a model family writes tool calls in text, and how OpenAI tool messages are put
back into text for its chat template.

Hermes style (Qwen2.5, Hermes, many ChatML fine-tunes, and what the bundled SmolLM2 is taught here):
tools are listed in the system prompt inside <tools></tools>, the model answers with
<tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks, and tool results come back as
<tool_response>...</tool_response>. Formats are pluggable by name (`--tool-format`).

What parses as a call is what a client can run, as OpenAI defines a call: the name of a tool the request
offered, and arguments that are a JSON object (returned string-encoded). An answer with any block that is not
such a call (arguments 1, a list, a string that is not an object; a tool that was not offered; not JSON) is
returned whole as text content: frameworks reject malformed calls, and the text keeps what the model wrote.
"""
from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[dict]  # OpenAI shape: {"id", "type": "function", "function": {"name", "arguments": str}}


class ToolFormat(Protocol):
    name: str

    def render_messages(self, messages: list[dict], tools: list[dict] | None) -> list[dict]:
        """Messages whose content is plain text the model's chat template can render."""

    def parse(self, text: str, offered: Collection[str]) -> ParsedOutput:
        """Split generated text into content and calls of the `offered` tools (none offered: all text)."""

    def forced_prefix(self, tool_name: str | None) -> str:
        """The start of an answer that is a tool call: of the tool named, or of any tool when None."""


def _text(content) -> str:
    """OpenAI content: a string, None, or a list of parts (only text parts carry text)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return str(content)


class HermesToolFormat:
    name = "hermes"
    call_start = "<tool_call>"
    CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def render_messages(self, messages: list[dict], tools: list[dict] | None) -> list[dict]:
        out: list[dict] = []
        for message in messages:
            role = message.get("role")
            text = _text(message.get("content"))
            if role == "assistant" and message.get("tool_calls"):
                calls = []
                for call in message["tool_calls"]:
                    function = call.get("function", {})
                    arguments = function.get("arguments", "{}")
                    try:
                        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
                    except json.JSONDecodeError:
                        pass  # shown to the model as the string it wrote
                    calls.append("<tool_call>\n" + json.dumps({"name": function.get("name"), "arguments": arguments})
                                 + "\n</tool_call>")
                text = "\n".join(filter(None, [text] + calls))
                out.append({"role": "assistant", "content": text})
            elif role == "tool":
                out.append({"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"})
            elif role == "developer":
                out.append({"role": "system", "content": text})
            else:
                out.append({"role": role, "content": text})
        if tools:
            listing = "\n".join(json.dumps(t.get("function", t)) for t in tools)
            guide = ("You can call functions. Their signatures are inside <tools></tools>:\n<tools>\n"
                     f"{listing}\n</tools>\nTo call one, answer with a JSON object inside <tool_call></tool_call>:"
                     '\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
            if out and out[0]["role"] == "system":
                out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{guide}"}
            else:
                out.insert(0, {"role": "system", "content": guide})
        return out

    def forced_prefix(self, tool_name: str | None) -> str:
        # The same text render_messages gives a past call (json.dumps of {"name", "arguments"}), cut where the
        # model's own choice starts: after `{"name": "` for any tool, after the name's `"arguments": ` for one.
        if tool_name is None:
            return '<tool_call>\n{"name": "'
        return "<tool_call>\n" + json.dumps({"name": tool_name, "arguments": None})[:-len("null}")]

    def parse(self, text: str, offered: Collection[str]) -> ParsedOutput:
        if not offered or "<tool_call>" not in text:
            return ParsedOutput(text, [])
        calls = [_call(block, offered) for block in self.CALL.findall(text)]
        if not calls or None in calls:
            return ParsedOutput(text, [])  # not calls a client could run: the model's text, as it wrote it
        content = text[:text.index("<tool_call>")].strip()
        return ParsedOutput(content or None, calls)


def _call(block: str, offered: Collection[str]) -> dict | None:
    """One call in OpenAI's shape, or None when the block is not a call of an offered tool with a JSON object
    for arguments (missing arguments are an empty object: a tool without parameters)."""
    try:
        call = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or call["name"] not in offered:
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            if not isinstance(json.loads(arguments), dict):
                return None
        except json.JSONDecodeError:
            return None
    elif isinstance(arguments, dict):
        arguments = json.dumps(arguments)
    else:
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call["name"], "arguments": arguments}}


FORMATS: dict[str, ToolFormat] = {"hermes": HermesToolFormat()}


def tool_format(name: str) -> ToolFormat:
    if name not in FORMATS:
        raise ValueError(f"unknown tool format {name!r}; known: {sorted(FORMATS)}")
    return FORMATS[name]
