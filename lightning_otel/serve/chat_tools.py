"""How the gateway puts a chat request's tools before the engine, and keeps `tool_choice` itself.

Two ways to show the model its tools, chosen per model:
- rendered: the model's chat template knows no tools (the bundled SmolLM2). Tools, past calls and tool results
  become text in the model's tool syntax (toolcalls.ToolFormat) before the template sees the messages.
- native: the template renders `tools` (Qwen2.5/3, Llama 3.x, Mistral; or the template given to the gateway,
  its chat_template option). Messages go to vLLM as OpenAI messages (past calls as `tool_calls`, whose
  string arguments vLLM parses into objects for the template, results as `tool` messages) and the tools as
  `tools`, so the model sees them as it was trained to. vLLM's own tool_choice is always "none": vLLM
  keeps the tools in the prompt for it (exclude_tools_when_tool_choice_none is off by default), runs no tool
  parser and guides nothing. Its parsers are not used because they need the engine started with one per
  model family, and the Hermes one needs `<tool_call>` to be a single token, which not every vocabulary has.

Which way, and the call syntax (toolcalls: Hermes, Llama 3.x JSON, Mistral's two), are decided in one place,
template_tools, from the template the engine renders with: native when it uses `tools`; the syntax named by the
user, else detected from the template's markers (<tool_call>, [TOOL_CALLS], <|python_tag|> or Llama's
{"name": ..., "parameters": ...} instruction), else Hermes. The gateway, serve, rollouts and the re-tokeniser
all ask it. A format whose markers are special tokens (Mistral's) has the engine keep special tokens in the
text of requests that offer tools, so the markers survive to be parsed.

Either way the gateway reads calls out of the generated text with its ToolFormat, and answers tool_choice as
OpenAI defines it: "auto" lets the model choose; "none" offers no tools (none are rendered); "required"
(LangChain's "any") is a call of one of the offered tools, and a named function a call of that tool. A forced
call is an opening put at the end of the prompt for the policy to continue (an assistant message continued
with continue_final_message): the format's forced_prefix, the call's opening up to its arguments,
`<tool_call>\n{"name": "<tool>", "arguments": ` in Hermes, `{"name": "<tool>", "parameters": ` in Llama's,
`[TOOL_CALLS]<tool>[ARGS]` in Mistral v11's. With one tool offered, or one named, the name is known. With
several, a first short generation picks it: the prompt is continued after the opening up to the name
(forced_prefix(None): `<tool_call>\n{"name": "`, `[TOOL_CALLS]`, ...) with the choice constrained to the
offered names (vLLM's structured outputs, {"choice": [...]}), then the real generation continues after the
full opening. The opening, the chosen name included, is prompt in the record (`lightning.prompt.forced_prefix`
names it), never completion: the recorded completion is only what the policy sampled freely, so nothing is
trained on tokens sampled under a constraint.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lightning_otel.errors import UserError
from lightning_otel.serve.request_checks import forced_tool, offered_tools
from lightning_otel.serve import toolcalls
from lightning_otel.serve.toolcalls import ToolFormat, detect_tool_format

# What a name choice must not inherit from the request: stops and constraints that could cut or bend the name,
# and answers the choice has no use for.
NOT_FOR_NAME_CHOICE = ("stop", "stop_token_ids", "min_tokens", "ignore_eos", "response_format", "structured_outputs",
                       "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_json_object",
                       "logit_bias", "bad_words", "allowed_token_ids", "max_completion_tokens", "top_logprobs",
                       "prompt_logprobs")


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools and tool_choice ask of the gateway."""

    tools: list[dict] | None  # shown to the model: None without tools, and under tool_choice "none"
    names: tuple[str, ...]    # the offered tools, in request order: the only names a parsed call may have
    must_call: bool           # the answer starts as a call (tool_choice "required" or a named function)
    name: str | None          # the tool it calls; None with must_call: the engine chooses among `names`

    @property
    def offered(self) -> frozenset[str]:
        return frozenset(self.names) if self.tools else frozenset()


def plan_tools(body: dict) -> ToolPlan:
    must_call, name = forced_tool(body)
    tools = None if body.get("tool_choice") == "none" else (body.get("tools") or None)
    return ToolPlan(tools, tuple(dict.fromkeys(offered_tools(body))), must_call, name)


def has_tool_messages(messages: list[dict]) -> bool:
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def chat_upstream(body: dict, plan: ToolPlan, tool_format: ToolFormat, native: bool,
                  chat_template: str | None) -> dict:
    """The request for the engine, without the forced opening (with_opening adds it)."""
    upstream = {k: v for k, v in body.items()
                if k not in ("stream", "stream_options", "parallel_tool_calls", "tools", "tool_choice")}
    if native:
        if plan.tools:
            upstream.update(tools=plan.tools, tool_choice="none")
    elif plan.tools or has_tool_messages(body["messages"]):
        upstream["messages"] = tool_format.render_messages(body["messages"], plan.tools)
    if plan.tools and tool_format.keep_special_tokens:
        upstream["skip_special_tokens"] = False  # its call markers are special tokens: keep them to parse calls
    if chat_template is not None:
        upstream["chat_template"] = chat_template
    return upstream


def with_opening(upstream: dict, opening: str, n: int | None = None) -> dict:
    """`upstream` continued after `opening`: the start of the answer, written for the policy to go on from."""
    if not opening:
        return upstream
    out = {**upstream, "messages": [*upstream["messages"], {"role": "assistant", "content": opening}],
           "continue_final_message": True, "add_generation_prompt": False}
    if n is not None:
        out["n"] = n
    return out


def name_choice(upstream: dict, opening: str, names: tuple[str, ...]) -> dict:
    """The short generation that picks the tool of a forced call among several: `upstream` continued after
    `opening` (a call's start, up to its name) with the answer constrained to one of `names`."""
    request = {k: v for k, v in with_opening(upstream, opening).items() if k not in NOT_FOR_NAME_CHOICE}
    request.update(structured_outputs={"choice": list(names)},
                   max_tokens=max(len(name.encode()) for name in names) + 1)  # a token is at least a byte; + the end
    return request


def renders_tools(template: str) -> bool:
    """Whether a chat template uses `tools` (else the gateway renders them into the messages)."""
    return "tools" in template


@dataclass(frozen=True)
class TemplateTools:
    """How the template the engine renders with takes tools."""

    native: bool  # it renders `tools` itself (else the gateway renders them into the messages)
    format: str   # the call syntax calls are parsed from, forced in and rendered with (toolcalls.FORMATS)


def model_templates(model_dir: Path) -> list[str]:
    """The chat template(s) a model folder brings: chat_template.jinja and tokenizer_config.json's (a list of
    named templates counts as its text)."""
    texts = [p.read_text() for p in (model_dir / "chat_template.jinja",) if p.is_file()]
    config = model_dir / "tokenizer_config.json"
    if config.is_file():
        texts.append(str(json.loads(config.read_text()).get("chat_template", "")))
    return texts


def template_tools(model_dir: Path | None, chat_template: str | None = None,
                   tool_format: str | None = None) -> TemplateTools:
    """The one place that decides, for the gateway and for re-tokenising, how tools meet the template the engine
    renders with (`chat_template` when given, else the model folder's own; neither: none): native or not, and
    the call syntax, `tool_format` when named (an unknown name is a UserError listing the known ones), else
    detected from the template's markers (toolcalls.detect_tool_format: Hermes when it has none)."""
    if chat_template is not None:
        texts = [chat_template]
    else:
        texts = model_templates(Path(model_dir)) if model_dir is not None else []
    name = tool_format or detect_tool_format("\n".join(texts))
    toolcalls.tool_format(name)
    return TemplateTools(any(renders_tools(text) for text in texts), name)


def read_chat_template(path: Path | str) -> str:
    """The text of a Jinja chat template file (a --chat-template option)."""
    path = Path(path).expanduser()
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"chat template {path}: cannot read it ({exc}); give a Jinja template file") from None
    if not text.strip():
        raise UserError(f"chat template {path} is empty; give a Jinja template file")
    return text
