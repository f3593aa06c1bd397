"""What every tool-call format shares: the ToolFormat protocol, the parsed answer, and the rules a call must
meet (an offered tool, arguments that are a JSON object) whatever syntax it was written in."""
from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Protocol


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[dict]  # OpenAI shape: {"id", "type": "function", "function": {"name", "arguments": str}}


class ToolFormat(Protocol):
    """How one model family writes tool calls in text (see the package docstring for the rules every format
    keeps)."""

    name: str
    # The text that begins a call in generated output ("<tool_call>" for Hermes). Text before its first
    # occurrence is the answer's content; an answer that never holds it is all content, so a streamed answer
    # may send text as it comes until the text holds call_start or ends with a prefix of it.
    call_start: str
    # Whether the format's markers are special tokens in its family's vocabularies (Mistral's [TOOL_CALLS]):
    # the engine must then keep special tokens in the generated text (vLLM's skip_special_tokens=False), or the
    # markers vanish before the text is parsed.
    keep_special_tokens: bool

    def render_messages(self, messages: list[dict], tools: list[dict] | None) -> list[dict]:
        """Messages whose content is plain text a chat template that knows no tools can render: the tools
        described in the system message, past calls in the format's syntax, tool results as text."""

    def parse(self, text: str, offered: Collection[str]) -> ParsedOutput:
        """Split generated text into content and calls of the `offered` tools (none offered: all text)."""

    def forced_prefix(self, tool_name: str | None) -> str:
        """The start of an answer that is a call of the tool named, as render_messages writes a past call, up
        to where its arguments object starts; with None, of any tool, up to where the name's characters start
        (a name chosen there, then forced_prefix(name), continue it)."""


def text_of(content) -> str:
    """OpenAI content: a string, None, or a list of parts (only text parts carry text)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return str(content)


def openai_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def as_call(value, offered: Collection[str], argument_keys: tuple[str, ...] = ("arguments",),
            new_id: Callable[[], str] = openai_call_id) -> dict | None:
    """`value` (a decoded JSON object {"name", <argument key>}) as one call in OpenAI's shape, or None when it
    is not a call of an offered tool with a JSON object for arguments. The first of `argument_keys` present
    holds the arguments; none present is an empty object (a tool without parameters)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    key = next((k for k in argument_keys if k in value), None)
    return named_call(value["name"], value[key] if key else {}, offered, new_id)


def named_call(name: str, arguments, offered: Collection[str], new_id: Callable[[], str] = openai_call_id
               ) -> dict | None:
    """A call of `name` with `arguments` (an object, or a string that holds one), or None when the tool was
    not offered or the arguments are not a JSON object. Arguments are returned string-encoded, as OpenAI does."""
    if name not in offered:
        return None
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
    return {"id": new_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def past_arguments(function: dict):
    """A past call's arguments as the model wrote them: the object its string holds, else the string as is."""
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return arguments


def decode_json(text: str, at: int) -> tuple[object, int] | None:
    """The JSON value starting at `text[at]` (after whitespace) and the index after it, or None."""
    while at < len(text) and text[at].isspace():
        at += 1
    try:
        return json.JSONDecoder().raw_decode(text, at)
    except json.JSONDecodeError:
        return None


def with_guide(messages: list[dict], guide: str) -> list[dict]:
    """`messages` with `guide` (the tools and how to call them) at the end of the system message, or as one."""
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{guide}"}, *messages[1:]]
    return [{"role": "system", "content": guide}, *messages]


def tool_listing(tools: list[dict]) -> str:
    """The offered functions, one JSON object a line."""
    return "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)


def plain_message(role: str, content: str) -> dict:
    """A message any template renders: developer messages become system ones (few templates know the role)."""
    return {"role": "system" if role == "developer" else role, "content": content}
