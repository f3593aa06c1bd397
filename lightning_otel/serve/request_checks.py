"""What the gateway checks in a request before the engine sees it: the body's shape (BadRequest: a 400 naming
the parameter), what `tool_choice` asks, and the parameters that would make the engine sample from another
distribution than the policy's softmax(logits / T) while training rollouts force the temperature."""
from __future__ import annotations

import json
from typing import Any

# Request parameters that move sampling away from the policy's softmax(logits / T), with their no-op values:
# vLLM samples (and records logprobs) after penalties, biases, token masks, guided decoding, min_tokens' EOS
# mask and top-k/p; beam search and best_of select. Passed on: what only truncates (stop), fixes (seed),
# reports (logprobs) or shapes the prompt (chat_template), whose ids are recorded as sent.
OFF_POLICY_NEUTRAL: dict[str, tuple] = {
    "top_p": (1,), "top_k": (0, -1), "min_p": (0,), "typical_p": (1,), "top_a": (0,),
    "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,), "logit_bias": ({},),
    "bad_words": ([],), "allowed_token_ids": ([],), "min_tokens": (0,), "use_beam_search": (False,),
    "best_of": (1,), "watermarking": (False,), "thinking_token_budget": (), "logits_processors": ([],),
    "response_format": ({"type": "text"},), "structured_outputs": ({},), "guided_json": (), "guided_regex": (),
    "guided_choice": (), "guided_grammar": (), "guided_json_object": (False,),
}
OFF_POLICY_MODES = ("strip", "refuse")


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def check_chat(body: Any, max_n: int) -> None:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'", f"messages[{i}]")
    check_common(body, max_n)
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise BadRequest("'tools' must be a list of objects", "tools")
    forced_tool(body)


def forced_tool(body: dict) -> tuple[bool, str | None]:
    """What `tool_choice` asks: (whether the answer must be a tool call, the tool it must call or None for
    any). "none" is (False, None) like "auto"; the caller stops offering the tools for it."""
    choice = body.get("tool_choice")
    if choice is None or choice in ("auto", "none"):
        return False, None
    names = [f.get("name") for t in body.get("tools") or [] if isinstance(f := t.get("function") or t, dict)]
    if not names:
        raise BadRequest(f"tool_choice {json.dumps(choice)[:80]} needs 'tools': offer the tools it may call",
                         "tool_choice")
    if choice == "required":
        return True, None
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if not isinstance(name, str):
        raise BadRequest('tool_choice must be "auto", "none", "required" or {"type": "function", "function": '
                         f'{{"name": ...}}}}, not {json.dumps(choice)[:80]}', "tool_choice")
    if name not in names:
        raise BadRequest(f"tool_choice names {name!r}, which is not among the tools offered ({names})", "tool_choice")
    return True, name


def off_policy_params(body: dict, native_tools: bool = False) -> list[str]:
    """The request's parameters (in request order) whose values make the engine sample from another
    distribution than softmax(logits / T). With native tools, vLLM guides tool_choice "required" or a named
    function with a JSON schema; rendered tools force it with a prompt prefix instead, which is harmless."""
    names = [key for key, value in body.items() if key in OFF_POLICY_NEUTRAL and not _neutral(key, value, body)]
    if native_tools and body.get("tools") and forced_tool(body)[0]:
        names.append("tool_choice")
    return names


def _neutral(key: str, value: Any, body: dict) -> bool:
    if value is None:
        return True
    if key == "logit_bias":
        return isinstance(value, dict) and all(v == 0 for v in value.values())
    if key == "response_format":
        return isinstance(value, dict) and value.get("type") == "text"
    if key == "structured_outputs":  # a dict with no constraint in it (backend or whitespace options only)
        return isinstance(value, dict) and all(value.get(k) in (None, False) for k in
                                               ("json", "regex", "choice", "grammar", "json_object", "structural_tag"))
    if key == "best_of" and value == body.get("n", 1):
        return True  # as many candidates as answers: no selection
    return value in OFF_POLICY_NEUTRAL[key]


def check_common(body: dict, max_n: int) -> None:
    n = body.get("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= max_n:
        raise BadRequest(f"'n' must be an integer from 1 to {max_n}", "n")
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise BadRequest(f"'{key}' must be a positive integer", key)
    if not isinstance(body.get("stream", False), bool):
        raise BadRequest("'stream' must be true or false", "stream")
