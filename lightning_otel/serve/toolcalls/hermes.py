"""Hermes style (Qwen2.5/3, Hermes, many ChatML fine-tunes, and what the bundled SmolLM2 is taught here): tools
are listed in the system prompt inside <tools></tools>, the model answers with
<tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks, anywhere after some text, and tool results
come back as <tool_response>...</tool_response> in a user turn."""
from __future__ import annotations

import json
import re
from collections.abc import Collection

from lightning_otel.serve.toolcalls.base import (ParsedOutput, as_call, past_arguments, plain_message, text_of,
                                                 with_guide)


class HermesToolFormat:
    name = "hermes"
    call_start = "<tool_call>"
    keep_special_tokens = False  # Qwen's <tool_call> is an added token, not a special one
    CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def render_messages(self, messages: list[dict], tools: list[dict] | None) -> list[dict]:
        out: list[dict] = []
        for message in messages:
            role = message.get("role")
            text = text_of(message.get("content"))
            if role == "assistant" and message.get("tool_calls"):
                calls = ["<tool_call>\n" + json.dumps({"name": call.get("function", {}).get("name"),
                                                       "arguments": past_arguments(call.get("function", {}))})
                         + "\n</tool_call>" for call in message["tool_calls"]]
                out.append({"role": "assistant", "content": "\n".join(filter(None, [text] + calls))})
            elif role == "tool":
                out.append({"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"})
            else:
                out.append(plain_message(role, text))
        if tools:
            listing = "\n".join(json.dumps(t.get("function", t)) for t in tools)
            out = with_guide(out, "You can call functions. Their signatures are inside <tools></tools>:\n<tools>\n"
                                  f"{listing}\n</tools>\nTo call one, answer with a JSON object inside "
                                  '<tool_call></tool_call>:\n<tool_call>\n{"name": <function-name>, "arguments": '
                                  "<args-json-object>}\n</tool_call>")
        return out

    def forced_prefix(self, tool_name: str | None) -> str:
        # The same text render_messages gives a past call (json.dumps of {"name", "arguments"}), cut where the
        # model's own choice starts: after `{"name": "` for any tool, after the name's `"arguments":` for one.
        # Never after a space: BPE vocabularies join a space to the word after it (` {`), so a prompt ending in
        # one leaves the model a token split it never saw in training (it then writes anything but arguments).
        if tool_name is None:
            return '<tool_call>\n{"name": "'
        return "<tool_call>\n" + json.dumps({"name": tool_name, "arguments": None})[:-len(" null}")]

    def parse(self, text: str, offered: Collection[str]) -> ParsedOutput:
        if not offered or self.call_start not in text:
            return ParsedOutput(text, [])
        calls = []
        for block in self.CALL.findall(text):
            try:
                calls.append(as_call(json.loads(block), offered))
            except json.JSONDecodeError:
                calls.append(None)
        if not calls or None in calls:
            return ParsedOutput(text, [])  # not calls a client could run: the model's text, as it wrote it
        content = text[:text.index(self.call_start)].strip()
        return ParsedOutput(content or None, calls)
