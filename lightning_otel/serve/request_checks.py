"""What the gateway checks in a request before the engine sees it: that the body is JSON every encoder
downstream can take, the type of every field it or the engine reads, and the rollout id (BadRequest: a 400
naming the parameter); what `tool_choice` asks; and the parameters that would make the engine sample from
another distribution than the policy's softmax(logits / T) while training rollouts force the temperature.
Agent traffic is untrusted: a wrong type here must never become a 500 (or a dropped connection) further down."""
from __future__ import annotations

import json
import re
from typing import Any

# Request parameters that move sampling away from the policy's softmax(logits / T), with their no-op values:
# vLLM samples (and records logprobs) after penalties, biases, token masks, guided decoding, min_tokens' EOS
# mask and top-k/p; beam search and best_of select. Passed on: what only truncates (stop), fixes (seed),
# reports (logprobs) or shapes the prompt (chat_template_kwargs), whose ids are recorded as sent.
OFF_POLICY_NEUTRAL: dict[str, tuple] = {
    "top_p": (1,), "top_k": (0, -1), "min_p": (0,), "typical_p": (1,), "top_a": (0,),
    "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,), "logit_bias": ({},),
    "bad_words": ([],), "allowed_token_ids": ([],), "min_tokens": (0,), "use_beam_search": (False,),
    "best_of": (1,), "watermarking": (False,), "thinking_token_budget": (), "logits_processors": ([],),
    "response_format": ({"type": "text"},), "structured_outputs": ({},), "guided_json": (), "guided_regex": (),
    "guided_choice": (), "guided_grammar": (), "guided_json_object": (False,),
}
OFF_POLICY_MODES = ("strip", "refuse")
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# Nesting deeper than any chat request needs (a tool schema of a dozen levels is rare); deeper bodies are a
# probe, and Python's recursive encoders would fail on them further down.
MAX_JSON_DEPTH = 64
# vLLM's default max_logprobs, and OpenAI's bound on top_logprobs: each one costs a top-k over the vocabulary.
MAX_LOGPROBS = 20
# What a rollout id may look like (the runner's are "ro-" and 16 hex digits): one spelling per rollout, so no
# escaping or normalising can make two ids name the same records.
ROLLOUT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
SURROGATE = re.compile("[\ud800-\udfff]")
NUMBERS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def parse_body(raw: bytes) -> Any:
    """The request body as JSON, refused (BadRequest) when it is not JSON the engine can take: invalid UTF-8,
    NaN or Infinity, nesting past MAX_JSON_DEPTH, or a lone surrogate escape ("\\ud800"), which no encoder
    downstream (the engine's tokenizer, the record's protobuf) can write."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise BadRequest(f"the request body nests deeper than {MAX_JSON_DEPTH} levels: flatten it") from None
    except ValueError as exc:  # UnicodeDecodeError included
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    _check_tree(body)
    return body


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number; send a finite number or null")


def _check_tree(body: Any) -> None:
    """Depth and strings of the parsed body, without recursion (Python's own recursion is what depth probes
    aim at). The path kept for the error is only built when one is raised."""
    stack: list[tuple[Any, int, tuple]] = [(body, 0, ())]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            if SURROGATE.search(value):
                raise BadRequest(f"{_where(path)} holds a lone UTF-16 surrogate escape (like \\ud800), which is "
                                 "not text: send valid Unicode", _where(path))
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise BadRequest(f"the request body nests deeper than {MAX_JSON_DEPTH} levels (at {_where(path)}): "
                             "flatten it", _where(path))
        for key, item in value.items() if isinstance(value, dict) else enumerate(value):
            if isinstance(key, str) and SURROGATE.search(key):
                stack.append((key, depth, path))
            if isinstance(item, (str, dict, list)):
                stack.append((item, depth + 1, (*path, key)))


def _where(path: tuple) -> str:
    text = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
    return text or "the body"


def check_rollout_id(rollout_id: str) -> None:
    if not ROLLOUT_ID.fullmatch(rollout_id):
        raise BadRequest(f"rollout id {rollout_id[:80]!r} is not one: it must be 1 to 128 letters, digits, '.', '_', "
                         "':' or '-', starting with a letter or digit (the runner's look like ro-<16 hex digits>); "
                         "use the base URL the runner gave the agent", "rollout_id")


def check_chat(body: Any, max_n: int) -> None:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    for i, message in enumerate(messages):
        _check_message(message, f"messages[{i}]")
    check_common(body, max_n)
    _check_tools(body.get("tools"))
    if not isinstance(body.get("logprobs", False), (bool, type(None))):
        raise BadRequest("'logprobs' must be true or false", "logprobs")
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, dict) and
                                    isinstance(options.get("include_usage", False), (bool, type(None)))):
        raise BadRequest("'stream_options' must be an object like {\"include_usage\": true}", "stream_options")
    forced_tool(body)
    check_no_request_template(body)


def check_completion(body: Any, max_n: int) -> None:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    prompt = body.get("prompt")
    if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt))):
        raise BadRequest("'prompt' must be a string or a list of token ids", "prompt")
    logprobs = body.get("logprobs")
    if logprobs is not None and not (_is_int(logprobs) and 0 <= logprobs <= MAX_LOGPROBS):
        raise BadRequest(f"'logprobs' must be an integer from 0 to {MAX_LOGPROBS}", "logprobs")
    check_common(body, max_n)
    if body.get("stream"):
        raise BadRequest("streaming is not supported on /v1/completions; use /v1/chat/completions", "stream")


def _check_message(message: Any, where: str) -> None:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise BadRequest(f"{where} must be an object with a string 'role'", where)
    if message["role"] not in ROLES:
        raise BadRequest(f"{where}.role {message['role'][:40]!r} is not a chat role: use one of {', '.join(ROLES)}",
                         f"{where}.role")
    content = message.get("content")
    if not (content is None or isinstance(content, str) or (isinstance(content, list) and all(
            isinstance(p, dict) and isinstance(p.get("type"), str) and
            (p["type"] != "text" or isinstance(p.get("text"), str)) for p in content))):
        raise BadRequest(f"{where}.content must be a string, null, or a list of parts like "
                         '{"type": "text", "text": "..."}', f"{where}.content")
    calls = message.get("tool_calls")
    if calls is not None and not (isinstance(calls, list) and all(_is_call(c) for c in calls)):
        raise BadRequest(f'{where}.tool_calls must be a list of {{"type": "function", "function": {{"name": "...", '
                         '"arguments": "{...}"}}}}', f"{where}.tool_calls")
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None and not isinstance(message[key], str):  # null: sent for unset fields
            raise BadRequest(f"{where}.{key} must be a string", f"{where}.{key}")


def _is_call(call: Any) -> bool:
    function = call.get("function") if isinstance(call, dict) else None
    return isinstance(function, dict) and isinstance(function.get("name"), str) and \
        (function.get("arguments") is None or isinstance(function["arguments"], (str, dict)))


def _check_tools(tools: Any) -> None:
    if tools is None:
        return
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BadRequest("'tools' must be a list of objects", "tools")
    for i, tool in enumerate(tools):
        function = tool.get("function", tool)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise BadRequest(f'tools[{i}] must be {{"type": "function", "function": {{"name": "...", "parameters": '
                             '{...}}}}: a function with a string name', f"tools[{i}]")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise BadRequest(f"tools[{i}]'s parameters must be a JSON schema object, like "
                             '{"type": "object", "properties": {...}}', f"tools[{i}].function.parameters")


def offered_tools(body: dict) -> list[str]:
    """The names of the tools the request offers, in its order."""
    return [f.get("name") for t in body.get("tools") or [] if isinstance(f := t.get("function") or t, dict)]


def forced_tool(body: dict) -> tuple[bool, str | None]:
    """What `tool_choice` asks: (whether the answer must be a tool call, the tool it must call, or None when
    the model chooses among several). "required" (and "any", LangChain's word for it) is a call of one of the
    offered tools: with one tool offered, of that one. "none" is (False, None) like "auto"; the caller stops
    offering the tools for it."""
    choice = body.get("tool_choice")
    if choice is None or choice in ("auto", "none"):
        return False, None
    names = offered_tools(body)
    if not names:
        raise BadRequest(f"tool_choice {json.dumps(choice)[:80]} needs 'tools': offer the tools it may call",
                         "tool_choice")
    if choice in ("required", "any"):
        return True, names[0] if len(set(names)) == 1 else None
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if not isinstance(name, str):
        raise BadRequest('tool_choice must be "auto", "none", "required" or {"type": "function", "function": '
                         f'{{"name": ...}}}}, not {json.dumps(choice)[:80]}', "tool_choice")
    if name not in names:
        raise BadRequest(f"tool_choice names {name!r}, which is not among the tools offered ({names})", "tool_choice")
    return True, name


def check_no_request_template(body: dict) -> None:
    """A request may not bring its own chat template: the engine trusts request-level templates only for the
    gateway's own (its chat_template option), and agent traffic is untrusted."""
    kwargs = body.get("chat_template_kwargs")
    if body.get("chat_template") is not None or (isinstance(kwargs, dict) and kwargs.get("chat_template") is not None):
        raise BadRequest("this gateway renders prompts with its own chat template and takes none from requests: "
                         "give the template to the gateway (its chat_template option, --chat-template FILE)",
                         "chat_template")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise BadRequest("'chat_template_kwargs' must be an object", "chat_template_kwargs")


def off_policy_params(body: dict) -> list[str]:
    """The request's parameters (in request order) whose values make the engine sample from another
    distribution than softmax(logits / T). tool_choice is not one: the gateway forces a call with a prompt
    prefix (its tokens are prompt, never trained), never by guiding what the policy samples."""
    return [key for key, value in body.items() if key in OFF_POLICY_NEUTRAL and not _neutral(key, value, body)]


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
    """What both routes share: counts, lengths, sampling numbers, stop strings, logprob counts."""
    n = body.get("n", 1)
    if not _is_int(n) or not 1 <= n <= max_n:
        raise BadRequest(f"'n' must be an integer from 1 to {max_n}", "n")
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and (not _is_int(value) or value < 1):  # the engine bounds it by its context
            raise BadRequest(f"'{key}' must be a positive integer", key)
    if not isinstance(body.get("stream", False), bool):
        raise BadRequest("'stream' must be true or false", "stream")
    for key in NUMBERS:
        value = body.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise BadRequest(f"'{key}' must be a number, not {json.dumps(value)[:40]}", key)
    if not (body.get("seed") is None or _is_int(body["seed"]) and -2**63 <= body["seed"] < 2**63):
        raise BadRequest("'seed' must be a 64-bit integer", "seed")
    stop = body.get("stop")
    if not (stop is None or isinstance(stop, str) or
            (isinstance(stop, list) and all(isinstance(s, str) for s in stop))):
        raise BadRequest("'stop' must be a string or a list of strings", "stop")
    for key in ("top_logprobs", "prompt_logprobs"):
        value = body.get(key)
        if value is not None and not (_is_int(value) and 0 <= value <= MAX_LOGPROBS):
            raise BadRequest(f"'{key}' must be an integer from 0 to {MAX_LOGPROBS} (the engine's max_logprobs)", key)
    if not isinstance(body.get("model", ""), (str, type(None))):
        raise BadRequest("'model' must be a string (any name: the gateway serves its policy under it)", "model")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
