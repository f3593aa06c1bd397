"""Mistral tool calls, after the [TOOL_CALLS] special token, in one of two syntaxes:

- "mistral" (tokenizers before v11: Mistral 7B v0.3, Nemo, Small 3/3.1): a JSON list of calls,
  `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (Mistral's templates add each call's "id").
- "mistral_v11" (v11 and later: Small 3.2, Magistral, Devstral): one run per call,
  `[TOOL_CALLS]name[ARGS]{...}`, with `[CALL_ID]id` before [ARGS] in some v11 renderings.

Either format parses both syntaxes; they differ in how they render past calls and force one. The markers are
special tokens, so the engine is asked to keep special tokens in the text (keep_special_tokens). Mistral's
templates insist on call ids of 9 letters and digits, so calls parsed here get such ids (the agent sends them
back with the results). The text before the first [TOOL_CALLS] is the content; text after a call's JSON is
dropped.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Collection

from lightning_otel.serve.toolcalls.base import (ParsedOutput, as_call, decode_json, named_call, past_arguments,
                                                 plain_message, text_of, tool_listing, with_guide)

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
RESULTS, END_RESULTS = "[TOOL_RESULTS]", "[/TOOL_RESULTS]"


def mistral_call_id() -> str:
    return uuid.uuid4().hex[:9]


class MistralToolFormat:
    call_start = TOOL_CALLS
    keep_special_tokens = True

    def __init__(self, name: str, args_syntax: bool):
        self.name, self.args_syntax = name, args_syntax  # args_syntax: [TOOL_CALLS]name[ARGS]{...}, else a list

    def render_messages(self, messages: list[dict], tools: list[dict] | None) -> list[dict]:
        out: list[dict] = []
        results: list[str] = []  # a run of tool results is one user turn: Mistral's templates alternate turns
        for message in messages:
            role = message.get("role")
            text = text_of(message.get("content"))
            if role == "tool":
                results.append(self._result_text(text, message.get("tool_call_id")))
                continue
            if results:
                out.append({"role": "user", "content": "".join(results)})
                results = []
            if role == "assistant" and message.get("tool_calls"):
                out.append({"role": "assistant", "content": text + self._calls_text(message["tool_calls"])})
            else:
                out.append(plain_message(role, text))
        if results:
            out.append({"role": "user", "content": "".join(results)})
        if tools:
            how = (f"To call one, answer with {TOOL_CALLS}, its name, {ARGS} and its arguments as a JSON object: "
                   f"{TOOL_CALLS}<function name>{ARGS}<arguments>, once per call." if self.args_syntax else
                   f"To call them, answer with {TOOL_CALLS} and a JSON list of the calls: {TOOL_CALLS} "
                   '[{"name": <function name>, "arguments": <arguments as a JSON object>}].')
            out = with_guide(out, f"You can call these functions, each described by a JSON object:\n"
                                  f"{tool_listing(tools)}\n\n{how} Their results come back between {RESULTS} "
                                  f"and {END_RESULTS}.")
        return out

    def _calls_text(self, calls: list[dict]) -> str:
        functions = [call.get("function", {}) for call in calls]
        if self.args_syntax:
            return "".join(f"{TOOL_CALLS}{f.get('name')}{ARGS}{json.dumps(past_arguments(f), ensure_ascii=False)}"
                           for f in functions)
        return f"{TOOL_CALLS} " + json.dumps([{"name": f.get("name"), "arguments": past_arguments(f)}
                                              for f in functions], ensure_ascii=False)

    def _result_text(self, text: str, call_id) -> str:
        if self.args_syntax:
            return f"{RESULTS}{text}{END_RESULTS}"
        result = {"content": text, **({"call_id": call_id} if call_id else {})}
        return f"{RESULTS} {json.dumps(result, ensure_ascii=False)}{END_RESULTS}"

    def forced_prefix(self, tool_name: str | None) -> str:
        # A past call as _calls_text renders it, cut where the name (None) or the arguments (a tool named) start.
        if self.args_syntax:
            return TOOL_CALLS if tool_name is None else f"{TOOL_CALLS}{tool_name}{ARGS}"
        if tool_name is None:
            return f'{TOOL_CALLS} [{{"name": "'
        # never after a space (hermes.py says why)
        opening = json.dumps({"name": tool_name, "arguments": None}, ensure_ascii=False)[:-len(" null}")]
        return f"{TOOL_CALLS} [{opening}"

    def parse(self, text: str, offered: Collection[str]) -> ParsedOutput:
        if not offered or TOOL_CALLS not in text:
            return ParsedOutput(text, [])
        content, *segments = text.split(TOOL_CALLS)
        calls: list[dict] = []
        for segment in filter(str.strip, segments):  # repeated markers with nothing between count as one
            found = _segment_calls(segment.strip(), offered)
            if found is None:
                return ParsedOutput(text, [])  # not calls a client could run: the model's text, as it wrote it
            calls += found
        if not calls:
            return ParsedOutput(text, [])
        return ParsedOutput(content.strip() or None, calls)


def _segment_calls(segment: str, offered: Collection[str]) -> list[dict] | None:
    """The calls written after one [TOOL_CALLS]: a JSON list of calls (or one call object), or
    `name[ARGS]{...}` (`name[CALL_ID]id[ARGS]{...}`, or `name{...}`); None when any is not a call."""
    if segment[0] in "[{":
        decoded = decode_json(segment, 0)
        if decoded is None:
            return None
        items = decoded[0] if isinstance(decoded[0], list) else [decoded[0]]
        calls = [as_call(item, offered, new_id=mistral_call_id) for item in items]
        return None if not calls or None in calls else calls
    if ARGS in segment:
        head, arguments = segment.split(ARGS, 1)
    elif "{" in segment:
        head, arguments = segment[:segment.index("{")], segment[segment.index("{"):]
    else:
        return None
    decoded = decode_json(arguments, 0)
    if decoded is None:
        return None
    call = named_call(head.split(CALL_ID, 1)[0].strip(), decoded[0], offered, mistral_call_id)
    return None if call is None else [call]
