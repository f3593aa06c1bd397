"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: the model answers with a bare JSON object
{"name": ..., "parameters": {...}} (sometimes after the <|python_tag|> special token, which the engine drops
from the text unless asked to keep special tokens), several separated by ";". Llama's own templates render a
past call the same way, one per assistant turn, and a tool result as a turn of the `ipython` role.

A call answer is the answer from its first "{" on: one or more such objects, separated by ";" or whitespace
(text after the last one is dropped, as Hermes drops text after its last block); the text before that "{" is
the content. The model's "parameters" and the OpenAI-style "arguments" are both read.
"""
from __future__ import annotations

import json
from collections.abc import Collection

from lightning_otel.serve.toolcalls.base import (ParsedOutput, as_call, decode_json, past_arguments, plain_message,
                                                 text_of, tool_listing, with_guide)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolFormat:
    name = "llama3_json"
    call_start = "{"
    keep_special_tokens = False  # the JSON is plain text; <|python_tag|> before it may go

    def render_messages(self, messages: list[dict], tools: list[dict] | None) -> list[dict]:
        out: list[dict] = []
        for message in messages:
            role = message.get("role")
            text = text_of(message.get("content"))
            if role == "assistant" and message.get("tool_calls"):
                calls = "; ".join(self._call_text(call.get("function", {})) for call in message["tool_calls"])
                out.append({"role": "assistant", "content": f"{text}\n{calls}" if text else calls})
            elif role == "tool":
                out.append({"role": "ipython", "content": text})  # the role Llama's tool results come in
            else:
                out.append(plain_message(role, text))
        if tools:
            out = with_guide(out, "You can call these functions, each described by a JSON object:\n"
                                  f"{tool_listing(tools)}\n\nTo call one, answer with nothing but a JSON object "
                                  'of its name and arguments: {"name": <function name>, "parameters": <arguments '
                                  'as a JSON object>}. Separate several calls with "; ". Their results come back '
                                  "in ipython turns.")
        return out

    @staticmethod
    def _call_text(function: dict) -> str:
        return json.dumps({"name": function.get("name"), "parameters": past_arguments(function)}, ensure_ascii=False)

    def forced_prefix(self, tool_name: str | None) -> str:
        # A past call as Llama's templates render it, `{"name": "<tool>", "parameters": <arguments>}`, cut where
        # the name (None) or the arguments (a tool named) start, never after a space (hermes.py says why).
        if tool_name is None:
            return '{"name": "'
        return json.dumps({"name": tool_name, "parameters": None}, ensure_ascii=False)[:-len(" null}")]

    def parse(self, text: str, offered: Collection[str]) -> ParsedOutput:
        if not offered or self.call_start not in text:
            return ParsedOutput(text, [])
        start = text.index(self.call_start)
        calls, at = [], start
        while True:
            decoded = decode_json(text, at)
            call = as_call(decoded[0], offered, ("parameters", "arguments")) if decoded else None
            if call is None:
                return ParsedOutput(text, [])  # not calls a client could run: the model's text, as it wrote it
            calls.append(call)
            at = _after_separator(text, decoded[1])
            if at is None:
                break
        content = text[:start].strip().removesuffix(PYTHON_TAG).strip()
        return ParsedOutput(content or None, calls)


def _after_separator(text: str, at: int) -> int | None:
    """Where the next call starts after the one ending at `at` (past a ";", whitespace and an optional
    <|python_tag|>), or None when no other call follows."""
    rest = text[at:].lstrip().removeprefix(";").lstrip().removeprefix(PYTHON_TAG).lstrip()
    return len(text) - len(rest) if rest.startswith("{") else None
