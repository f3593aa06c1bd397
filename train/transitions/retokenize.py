"""Token ids for LLM calls the gateway did not serve, and how far such ids drift from the engine's.

A call made to another endpoint (an outside OpenAI-compatible server, production traffic) has no token
record. Its recorded messages (`gen_ai.input.messages` / `gen_ai.output.messages` in the parts schema,
`gen_ai.system_instructions`, `gen_ai.tool.definitions`; on a span or in its GenAI log record, see the
llm_calls view) are turned back into the OpenAI request the agent sent, rendered the way the gateway
renders a request (tools and tool messages in the model's tool syntax when its chat template cannot render
tools, else given to the template as vLLM gives them: call arguments as objects, tools with vLLM's fields;
then the chat template with the generation prompt) and tokenised like vLLM does (no extra special tokens).
The completion is the assistant's text with its tool calls in the model's tool syntax (the gateway parses
calls out of that syntax with either template), plus the end-of-turn token unless the call stopped at its
length limit.

Such transitions carry token_source='retokenized' and completion_logprobs = [] (an empty list, never
NaN): no sampling logprobs exist for them. The trainer must compute their old-policy logprobs itself (the
policy's own logprobs before the update, so their first ratio is 1) and not read completion_logprobs.

Re-tokenised text is not what the model sampled: chat templates, tool-call formatting and non-canonical
tokenisations of sampled text all drift. `measure_drift` re-tokenises calls that do have a token record
and compares (`lightning-otel compile --drift`). A call whose answer the gateway opened itself (tool_choice
"required" or a named function: its record's lightning.prompt.forced_prefix) has that opening at the end of
its prompt ids, while the recorded messages hold it as the start of the answer: it is re-tokenised the way the
gateway sent it (prompt continued after the opening, completion without it), so only real drift is counted,
and such calls are counted apart. The tool syntax is the gateway's: the one named (compile --tool-format), else
detected from the same template as the gateway detects it (chat_tools.template_tools), so Llama's and Mistral's
calls and openings are re-tokenised in their own syntax. A template that trims the assistant turn (Llama's)
drops an opening's trailing space from the prompt; the model wrote that space, so it stays in the completion.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

from lightning_otel.errors import UserError
from lightning_otel.serve.chat_tools import has_tool_messages, template_tools
from lightning_otel.serve.toolcalls import ToolFormat, tool_format

log = logging.getLogger(__name__)


def _parse(text: str | None) -> list:
    if not text:
        return []
    value = json.loads(text)
    return value if isinstance(value, list) else [value]


def _arguments(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def openai_messages(system_instructions: str | None, input_messages: str | None) -> list[dict]:
    """The request's messages, OpenAI-shaped, from the recorded parts-schema JSON. Parts other than text,
    tool calls and tool results (images, reasoning) carry no text the template would render: dropped."""
    messages: list[dict] = []
    system = "".join(p.get("content") or "" for p in _parse(system_instructions)
                     if isinstance(p, dict) and p.get("type") == "text")
    if system:
        messages.append({"role": "system", "content": system})
    for message in _parse(input_messages):
        role, parts = message.get("role"), message.get("parts") or []
        text = "".join(p.get("content") or "" for p in parts if p.get("type") == "text")
        calls = [{"id": p.get("id"), "type": "function",
                  "function": {"name": p.get("name"), "arguments": _arguments(p.get("arguments", {}))}}
                 for p in parts if p.get("type") == "tool_call"]
        results = [p for p in parts if p.get("type") == "tool_call_response"]
        if results:
            for part in results:  # one tool message per result, as the agent sent them
                response = part.get("response")
                messages.append({"role": "tool", "tool_call_id": part.get("id"),
                                 "content": response if isinstance(response, str) else json.dumps(response)})
            continue
        out: dict = {"role": role, "content": text}
        if calls:
            out["tool_calls"] = calls
        messages.append(out)
    return messages


def openai_tools(tool_definitions: str | None) -> list[dict] | None:
    """gen_ai.tool.definitions (flat {"type", "name", ...} or OpenAI's nested {"function": {...}}) as OpenAI tools."""
    tools = []
    for tool in _parse(tool_definitions):
        function = tool.get("function") if isinstance(tool.get("function"), dict) else \
            {k: v for k, v in tool.items() if k != "type"}
        tools.append({"type": "function", "function": function})
    return tools or None


def assistant_message(output_messages: str | None) -> tuple[dict, str | None] | None:
    """The first answer (choice 0) as an OpenAI assistant message, and its finish reason."""
    answers = _parse(output_messages)
    if not answers:
        return None
    first = answers[0]
    message = openai_messages(None, json.dumps([{**first, "role": "assistant"}]))[0]
    return message, first.get("finish_reason")


@dataclass
class ChatTokenizer:
    """The model's tokenizer and chat template, applied as the gateway and vLLM apply them."""

    tokenizer: object
    native_tools: bool
    format: ToolFormat

    @classmethod
    def load(cls, model_dir: Path, tool_format_name: str | None = None, chat_template: str | None = None
             ) -> ChatTokenizer:
        """The tokenizer of `model_dir`, rendering with `chat_template` (the gateway's) when given, and with the
        gateway's call syntax: `tool_format_name`, else detected from the template as the gateway detects it."""
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        except (OSError, ValueError) as exc:
            raise UserError(f"cannot load a tokenizer from {model_dir}: {exc}") from None
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(f"{model_dir} has no chat template: its calls cannot be re-tokenised")
        tools = template_tools(Path(model_dir), chat_template, tool_format_name)
        return cls(tokenizer, tools.native, tool_format(tools.format))

    def prompt_text(self, messages: list[dict], tools: list[dict] | None, forced_prefix: str | None = None) -> str:
        """The prompt the gateway had the engine render: continued after `forced_prefix` when it forced one."""
        if not self.native_tools:
            if tools or has_tool_messages(messages):
                messages, tools = self.format.render_messages(messages, tools), None
        else:
            messages, tools = _as_vllm_renders(messages, tools)
        if forced_prefix:
            return self.tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": forced_prefix}],
                                                      tools=tools, continue_final_message=True, tokenize=False)
        return self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)

    def completion_text(self, message: dict, forced_prefix: str | None = None, prompt: str | None = None) -> str:
        """The answer as the model writes it (calls in its tool syntax), less the opening the gateway forced
        where `prompt` (the prompt text) ends with it."""
        text = self.format.render_messages([message], None)[0]["content"] if message.get("tool_calls") \
            else message.get("content") or ""
        if not forced_prefix or not text.startswith(forced_prefix):
            return text
        # A template that trims the assistant turn (Llama's) ends the prompt before the opening's trailing
        # space (`"parameters": `), which the model then writes itself: it is completion.
        if prompt is not None and not prompt.endswith(forced_prefix):
            forced_prefix = forced_prefix.rstrip()
        return text[len(forced_prefix):]

    def encode(self, calls: pl.DataFrame) -> pl.DataFrame:
        """Re-tokenise calls (columns trace_id, span_id, system_instructions, input_messages, output_messages,
        tool_definitions, and optionally forced_prefix: the opening the gateway forced into the call's prompt):
        their prompt_ids and completion_ids, null where the messages were not recorded or cannot be read
        (`problem` says why)."""
        prompts, completions, finished, problems = [], [], [], []
        for row in calls.iter_rows(named=True):
            try:
                messages = openai_messages(row["system_instructions"], row["input_messages"])
                answer = assistant_message(row["output_messages"])
            except (ValueError, AttributeError, TypeError) as exc:
                messages, answer, problem = [], None, f"unreadable recorded messages ({type(exc).__name__})"
            else:
                problem = None if messages and answer else "no recorded messages"
            if problem:
                prompts.append(None), completions.append(None), finished.append(False), problems.append(problem)
                continue
            forced = row.get("forced_prefix")
            prompts.append(self.prompt_text(messages, openai_tools(row["tool_definitions"]), forced))
            completions.append(self.completion_text(answer[0], forced, prompts[-1]))
            finished.append(answer[1] != "length")
            problems.append(None)
        prompt_ids = self._batch([p for p in prompts if p is not None])
        completion_ids = self._batch([c for c in completions if c is not None])
        eos = self.tokenizer.eos_token_id
        out_prompts, out_completions, k = [], [], 0
        for prompt, done in zip(prompts, finished):
            if prompt is None:
                out_prompts.append(None), out_completions.append(None)
                continue
            out_prompts.append(prompt_ids[k])
            out_completions.append(completion_ids[k] + ([eos] if done and eos is not None else []))
            k += 1
        return calls.select("trace_id", "span_id").with_columns(
            pl.Series("prompt_ids", out_prompts, dtype=pl.List(pl.Int32)),
            pl.Series("completion_ids", out_completions, dtype=pl.List(pl.Int32)),
            pl.Series("problem", problems, dtype=pl.String))

    def _batch(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]


def _as_vllm_renders(messages: list[dict], tools: list[dict] | None) -> tuple[list[dict], list[dict] | None]:
    """Messages and tools as vLLM hands them to a chat template: a call's arguments as an object (a string is
    parsed; one that is not a JSON object becomes {}), and each tool with the fields of vLLM's tool model."""
    out = []
    for message in messages:
        if message.get("role") == "assistant" and message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                function = dict(call.get("function") or {})
                arguments = function.get("arguments") or {}
                if isinstance(arguments, str):
                    try:
                        arguments = json.loads(arguments)
                    except json.JSONDecodeError:
                        arguments = {}
                function["arguments"] = arguments if isinstance(arguments, dict) else {}
                calls.append({**call, "function": function})
            message = {**message, "tool_calls": calls}
        out.append(message)
    if tools:
        tools = [{"type": "function", "function": {
            "name": f.get("name"), "description": f.get("description"), "parameters": f.get("parameters"),
            **({"strict": f["strict"]} if f.get("strict") is not None else {})}}
            for f in (t.get("function") or t for t in tools)]
    return out, tools


def edit_distance(a, b) -> int:
    """Levenshtein distance between two token id sequences (common prefix and suffix trimmed first, then
    one vectorised row per token of the shorter side)."""
    a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
    n = min(len(a), len(b))
    same = a[:n] == b[:n]
    start = n if same.all() else int(np.argmin(same))
    a, b = a[start:], b[start:]
    n = min(len(a), len(b))
    same = a[len(a) - n:][::-1] == b[len(b) - n:][::-1]
    end = n if same.all() else int(np.argmin(same))
    a, b = a[:len(a) - end], b[:len(b) - end]
    if len(a) > len(b):
        a, b = b, a
    if len(a) == 0:
        return len(b)
    offsets = np.arange(len(b) + 1)
    row = offsets.copy()
    for i, token in enumerate(a, 1):
        best = np.empty_like(row)
        best[0] = i
        best[1:] = np.minimum(row[:-1] + (b != token), row[1:] + 1)
        row = np.minimum.accumulate(best - offsets) + offsets  # insertions: row[j] = min_k best[k] + (j - k)
    return int(row[-1])


@dataclass
class Drift:
    """Re-tokenised ids against the engine's, over calls that have both."""

    calls: int = 0
    prompt_differs: float = float("nan")      # fraction of calls whose prompt ids differ
    completion_differs: float = float("nan")
    prompt_edits: float = float("nan")        # mean token edit distance per call
    completion_edits: float = float("nan")
    prompt_mismatch: float = float("nan")     # edits / engine tokens, over all calls
    completion_mismatch: float = float("nan")
    unreadable: int = 0                        # calls with a record whose messages could not be re-tokenised
    forced: int = 0                            # calls whose prompt ends with an opening the gateway forced
    forced_differ: int = 0                     # of those, calls whose prompt or completion ids still differ

    def lines(self) -> list[str]:
        if not self.calls:
            return [f"drift: no call has both a token record and recorded messages ({self.unreadable} unreadable)"]
        lines = [f"drift over {self.calls} calls with both a token record and recorded messages:",
                 f"  prompt:     {self.prompt_differs:.1%} of calls differ, {self.prompt_edits:.2f} token edits per "
                 f"call, {self.prompt_mismatch:.2%} of tokens",
                 f"  completion: {self.completion_differs:.1%} of calls differ, {self.completion_edits:.2f} token "
                 f"edits per call, {self.completion_mismatch:.2%} of tokens"]
        if self.forced:
            lines.append(f"  {self.forced} call(s) had a tool-call opening forced into the prompt by the gateway "
                         f"(tool_choice required or a named function): it was compared as prompt, where the engine "
                         f"had it, so it is not counted as drift; {self.forced_differ} of them differ still")
        return lines


def measure_drift(engine: pl.DataFrame, retokenized: pl.DataFrame) -> Drift:
    """Compare `engine` (trace_id, span_id, prompt_ids, completion_ids from token records, and optionally
    forced_prefix) with ChatTokenizer.encode's output for the same calls (given the same forced_prefix)."""
    both = engine.join(retokenized.rename({"prompt_ids": "re_prompt", "completion_ids": "re_completion"}),
                       on=["trace_id", "span_id"], how="inner")
    unreadable = both.filter(pl.col("re_prompt").is_null()).height
    both = both.filter(pl.col("re_prompt").is_not_null())
    if both.height == 0:
        return Drift(unreadable=unreadable)
    stats, differs = {}, np.zeros(both.height, dtype=bool)
    for side in ("prompt", "completion"):
        ours, theirs = both[f"{side}_ids"].to_list(), both[f"re_{side}"].to_list()
        edits = np.array([edit_distance(x, y) if x != y else 0 for x, y in zip(ours, theirs)])
        differs |= edits > 0
        tokens = sum(len(x) for x in ours)
        stats[side] = (float(np.mean(edits > 0)), float(edits.mean()), float(edits.sum() / tokens) if tokens else 0.0)
    forced = (both["forced_prefix"].fill_null("").str.len_chars() > 0).to_numpy() if "forced_prefix" in both.columns \
        else np.zeros(both.height, dtype=bool)
    return Drift(both.height, stats["prompt"][0], stats["completion"][0], stats["prompt"][1], stats["completion"][1],
                 stats["prompt"][2], stats["completion"][2], unreadable, forced=int(forced.sum()),
                 forced_differ=int((forced & differs).sum()))
