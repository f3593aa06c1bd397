"""Tool-call formats: how a model family writes tool calls in text, and how OpenAI tool messages are put
back into text for a chat template that cannot render them. One module per family:

- "hermes" (hermes.py; Qwen2.5/3, Hermes, ChatML fine-tunes, the bundled SmolLM2 as taught here):
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.
- "llama3_json" (llama3.py; Llama 3.1/3.2/3.3): a bare `{"name": ..., "parameters": {...}}`, several
  separated by ";".
- "mistral" and "mistral_v11" (mistral.py): `[TOOL_CALLS] [{"name": ..., "arguments": {...}}]` before
  Mistral's v11 tokenizers, `[TOOL_CALLS]name[ARGS]{...}` from v11 on.

Which one the gateway uses is named (`--tool-format`, the `tool_format` setting) or detected from the chat
template the engine renders with (detect_tool_format: the markers the template writes), Hermes when the
template names none.

What parses as a call is what a client can run, as OpenAI defines a call: the name of a tool the request
offered, and arguments that are a JSON object (returned string-encoded). An answer with any call that is not
such a call (arguments 1, a list, a string that is not an object; a tool that was not offered; not JSON) is
returned whole as text content: frameworks reject malformed calls, and the text keeps what the model wrote.
Every format keeps three promises the gateway builds on: a rendered past call parses back to the same call;
forced_prefix(name) is how a rendered call of that tool starts, cut where its arguments object starts, and
forced_prefix(None) is cut where the name starts; and text before `call_start` is content.
"""
from __future__ import annotations

import re

from lightning_otel.errors import UserError
from lightning_otel.serve.toolcalls.base import ParsedOutput, ToolFormat
from lightning_otel.serve.toolcalls.hermes import HermesToolFormat
from lightning_otel.serve.toolcalls.llama3 import PYTHON_TAG, Llama3JsonToolFormat
from lightning_otel.serve.toolcalls.mistral import ARGS, TOOL_CALLS, MistralToolFormat

__all__ = ["DEFAULT_FORMAT", "FORMATS", "HermesToolFormat", "Llama3JsonToolFormat", "MistralToolFormat",
           "ParsedOutput", "ToolFormat", "detect_tool_format", "tool_format"]

FORMATS: dict[str, ToolFormat] = {
    "hermes": HermesToolFormat(),
    "llama3_json": Llama3JsonToolFormat(),
    "mistral": MistralToolFormat("mistral", args_syntax=False),
    "mistral_v11": MistralToolFormat("mistral_v11", args_syntax=True),
}
DEFAULT_FORMAT = "hermes"  # what the bundled model is taught, and what most tool-trained open models write
# Llama's instruction for the shape of a call, on one line: {"name": <function name>, "parameters": ...}.
LLAMA_JSON = re.compile(r'\{"name"\s*:[^\n{}]{0,80}"parameters"\s*:')


def tool_format(name: str) -> ToolFormat:
    """The format of that name; an unknown name is a UserError that lists the known ones."""
    if name not in FORMATS:
        raise UserError(f"tool format {name!r} is unknown: choose one of {', '.join(FORMATS)} (or name none, and "
                        f"it is detected from the chat template)")
    return FORMATS[name]


def detect_tool_format(template: str) -> str:
    """The call syntax a chat template writes (the Jinja source, or several joined): its markers decide,
    Hermes's <tool_call> first, and Hermes when it has none (a template that renders no tools)."""
    text = template.replace('\\"', '"')  # quotes inside double-quoted Jinja strings
    if "<tool_call>" in text:
        return "hermes"
    if TOOL_CALLS in text:
        return "mistral_v11" if ARGS in text else "mistral"
    if PYTHON_TAG in text or LLAMA_JSON.search(text):
        return "llama3_json"
    return DEFAULT_FORMAT
