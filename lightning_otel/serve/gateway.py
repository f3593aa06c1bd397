"""The rollout gateway: an OpenAI-compatible server in front of the engine that records, for every choice
it returns, the exact prompt and completion token ids and sampling logprobs as a `lightning.generate`
span whose parent is the client's LLM span (named by the request's W3C `traceparent`).

Routes: POST /v1/chat/completions, /v1/responses, /v1/completions, GET /v1/models, each also under
/r/<rollout_id>/ (the runner points each agent at its own prefix). Any model name is served by the current
policy, so scripts that hard-code `gpt-4o` run unchanged. While the temperature is forced (training rollouts), request
parameters that sample from another distribution than softmax(logits / T) (penalties, logit_bias, guided
decoding, ...: request_checks.OFF_POLICY_NEUTRAL) are stripped and listed in the record, or refused
(`off_policy_params`).
Streaming (`stream: true`, chat and Responses) is real: chunks go out as the engine samples them, text that may
begin a tool call is held back until it is parsed, and the exact token ids and logprobs are recorded whole when
the stream ends (streaming.py; a client that leaves mid-stream stops the generation, and what was generated is
recorded with finish reason `client_disconnected`).

Tools (chat_tools.py): the gateway parses calls out of the generated text in the model's call syntax (Hermes,
Llama 3.x JSON or Mistral's: toolcalls; named, or detected from the chat template) into OpenAI `tool_calls`
(an offered tool, arguments a JSON object; anything else stays text). A chat template that renders `tools`
(the model's, or `GatewayConfig.chat_template`, sent as vLLM's request-level chat_template) gets them as OpenAI
`tools` with vLLM's tool_choice "none"; for one that cannot, tools and tool messages are rendered into the
messages in the call syntax. `tool_choice` is the gateway's: "required" or a named function opens the call at
the end of the prompt for the policy to continue (with several tools offered, a short generation constrained
to their names picks one first), "none" shows no tools. The opening is prompt in the record
(`lightning.prompt.forced_prefix`), never completion.

The Responses API (/v1/responses) is translated to a chat call and back (responses.py), streamed or not: its
record is a chat call's, under the response's own id ("resp_..."), which the client's LLM spans carry too.

Prompt patches (`GatewayConfig.prompts`, prompts.py): a chat or Responses call whose system message a patch
targets reaches the engine with the patch applied (system text replaced or extended, demonstrations inserted);
its record carries `lightning.prompt.version` and `lightning.prompt.patch_id`, and its prompt ids are the
patched prompt's. Legacy completions have no system message and are never patched.

Closed models (`GatewayConfig.forward_url`, forward.py): chat and Responses calls go to an outside
OpenAI-compatible endpoint instead of the engine, with the patch applied, the temperature and token cap forced as
request parameters, and are recorded as text (`lightning.forward` spans: no token ids, never trained on). Tools,
tool calls and streams pass through as the endpoint gives them; legacy completions are refused.

One adapter per agent (`GatewayConfig.adapters`, adapters.py): each call is served by the LoRA adapter its
request's model names, else by its agent's (the `x-lightning-agent` header the capture distro derives from the
agent process's live spans), else by the base model; its record carries `lightning.adapter`.

Scripted rollouts (`script()`): the calls of one rollout are answered, in order, with given texts instead of
samples, so an agent can be walked along a labelled path (the SFT warm start's demonstrations). The engine
still sees each prompt (generating one token), so the recorded prompt ids are exact; the record carries the
answer as `lightning.scripted.answer` and no completion ids.
"""
from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.propagate import extract
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode

from lightning_otel.capture.distro import LightningSpanExporter
from lightning_otel.errors import UserError
from lightning_otel.httpserver import ConnectionLimits, check_exposure
from lightning_otel.serve.adapters import (ADAPTER_ATTRIBUTE, AGENT_ATTRIBUTE, adapter_for, check_adapters,
                                          header_agent)
from lightning_otel.serve.chat_tools import (ToolPlan, chat_upstream, name_choice, plan_tools, template_tools,
                                             with_opening)
from lightning_otel.serve.engine import Engine, EngineError
from lightning_otel.serve import forward
from lightning_otel.serve.gate import SwapGate
from lightning_otel.serve.gateway_http import GatewayHandler, GatewayServer
from lightning_otel.serve import responses
from lightning_otel.serve.prompts import PromptPatch, PromptPatches
from lightning_otel.serve.request_checks import (OFF_POLICY_MODES, BadRequest, check_chat, check_completion,
                                                 off_policy_params)
from lightning_otel.serve.streaming import AnswerStream, ChatStream, FinishedStream
from lightning_otel.serve.toolcalls import ToolFormat, tool_format

log = logging.getLogger(__name__)
GENERATE_SPAN = "lightning.generate"
STRIPPED_ATTRIBUTE = "lightning.request.stripped"
FORCED_PREFIX_ATTRIBUTE = "lightning.prompt.forced_prefix"
FINISH_ATTRIBUTE = "gen_ai.response.finish_reasons"


@dataclass
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 0
    collector_url: str | None = None
    collector_token: str | None = None
    # The call syntax (toolcalls.FORMATS). None: detected from chat_template when one is given (else Hermes);
    # callers that know the model pass chat_tools.template_tools(model_dir, chat_template, name).format.
    tool_format: str | None = None
    # A Jinja chat template the engine renders every chat request with, instead of the model's own (sent as
    # vLLM's request-level chat_template: the engine needs --trust-request-chat-template, which the engine the
    # project starts has; an attached vLLM must be started with it).
    chat_template: str | None = None
    # Whether the template renders `tools` itself (chat_tools: native), else the gateway renders them into the
    # messages. None: decided from chat_template when one is given (else False); callers that know the model
    # pass chat_tools.template_tools(model_dir, chat_template).native.
    native_tools: bool | None = None
    max_body_bytes: int = 16 * 1024 * 1024
    # Slow clients, and open connections: every rollout of a run holds one while its call waits on the engine, and
    # a GPU engine batches hundreds of sequences, so the gateway takes 1024 (the collector's default is 256);
    # 256 clients measured against 256 connections got a 503 (benchmarks/RESULTS.md, gateway load sweep).
    connection_limits: ConnectionLimits = field(default_factory=lambda: ConnectionLimits(max_connections=1024))
    # The longest one write of an answer (an SSE event, a JSON body) may wait for the client to read: a client
    # that stops reading its stream gives its connection back after this, instead of holding it forever.
    send_timeout_s: float = 30.0
    default_max_tokens: int = 512
    # Training rollouts: cap every request's generation length, and sample at one temperature whatever the
    # agent asks (GRPO needs diverse samples; temperature 1 keeps the recorded logprobs those of the policy).
    max_tokens_cap: int | None = None
    temperature: float | None = None
    max_n: int = 16
    # Prompt collection (the SFT warm start needs only each agent's first prompt): calls of one rollout
    # (its /r/<rollout_id>/ prefix) after this many are refused with a 400 that names the limit.
    max_calls_per_rollout: int | None = None
    # While `temperature` is forced: what to do with a request's non-neutral OFF_POLICY_NEUTRAL parameters.
    # "strip" (default: agents send penalties or response_format from their own config, and an unchanged agent
    # must keep running) drops them and lists them in the record; "refuse" answers 400 naming them.
    off_policy_params: str = "strip"
    # Responses API: how many recent responses' conversations are kept in memory for previous_response_id.
    stored_responses: int = 4096
    # Requests must send `Authorization: Bearer <api_key>` (None: none needed, which only loopback allows unless
    # insecure_no_auth is set).
    api_key: str | None = None
    insecure_no_auth: bool = False
    # Prompt patches (prompts.py): chat and Responses calls whose system message a patch targets reach the engine
    # patched, and their records carry the patch's version and id.
    prompts: PromptPatches | None = None
    # Closed models (forward.py): an outside OpenAI-compatible endpoint (its base URL, .../v1) that answers instead
    # of an engine; the environment variable with its key (None: the agent's own Authorization header goes
    # through); the model name every call is sent with (None: the agent's); seconds one read of its answer may wait.
    forward_url: str | None = None
    forward_api_key_env: str | None = None
    forward_model: str | None = None
    forward_timeout_s: float = 300.0
    # One adapter per agent (adapters.py): {adapter name: regex over whole agent names}. Each call is served by
    # the adapter its request's model names, else by its agent's (the x-lightning-agent header the capture distro
    # sends), else by the base model; its record names the adapter (lightning.adapter). Empty: every call is
    # served by the current policy. The engine must be a PolicyEngine (served_model).
    adapters: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.adapters = check_adapters(self.adapters, "gateway adapters")
        if self.chat_template is not None and not (isinstance(self.chat_template, str) and self.chat_template.strip()):
            raise UserError("chat_template: give the text of a Jinja chat template (or None for the model's own)")
        found = template_tools(None, self.chat_template, self.tool_format)
        if self.native_tools is None:
            self.native_tools = found.native
        self.tool_format = found.format
        if not (isinstance(self.send_timeout_s, (int, float)) and self.send_timeout_s > 0):
            raise UserError(f"send_timeout_s={self.send_timeout_s!r}: give a positive number of seconds")
        if self.off_policy_params not in OFF_POLICY_MODES:
            raise UserError(f"off_policy_params {self.off_policy_params!r}: choose \"strip\" (drop them and say so "
                            "in the record) or \"refuse\" (answer 400)")
        if not (isinstance(self.stored_responses, int) and self.stored_responses >= 0):
            raise UserError(f"stored_responses={self.stored_responses!r}: give a count of responses (0 keeps none)")
        if self.api_key is not None and not self.api_key.strip():
            raise UserError("the API key is empty: give one, or none for a server on loopback only")
        if self.prompts is not None and not isinstance(self.prompts, PromptPatches):
            raise UserError("prompts: give PromptPatches (lightning_otel.serve.prompts.load_patches(path)) or None")
        if not self.insecure_no_auth:
            check_exposure(self.host, self.api_key is not None, "give an API key (--api-key)")
        if self.forward_url is not None:
            forward.check_config(self.forward_url, self.chat_template, self.forward_timeout_s,
                                 self.forward_api_key_env, self.api_key)

@dataclass
class ChatCall:
    """A chat request checked, counted and made into the engine's request."""
    body: dict
    headers: dict[str, str]
    rollout_id: str | None
    response_id: str | None  # a Responses call's id (the record's), else the engine's
    requested_model: str
    plan: ToolPlan
    upstream: dict
    scripted: str | None
    stripped: list[str]
    patch: PromptPatch | None = None
    adapter: str | None = None  # the adapter that serves the call (one adapter per agent), None: the policy


class Gateway:
    def __init__(self, engine: Engine | None, config: GatewayConfig, gate: SwapGate | None = None):
        """`engine`: what answers; None when the config forwards to an outside endpoint (forward_url). `gate`:
        the engine's SwapGate (PolicyEngine.gate), held around each model request so that a change of policy
        waits for the requests in flight and holds the new ones (gate.py); None: a gate of the gateway's own."""
        self.outside = None if config.forward_url is None else forward.Outside(
            config.forward_url, config.forward_api_key_env, config.forward_model, config.forward_timeout_s)
        if (engine is None) == (self.outside is None):
            raise ValueError("give an engine, or a config with forward_url, not both")
        self.engine: Engine = engine if engine is not None else self.outside  # type: ignore[assignment]
        self.config = config
        self.gate = gate if gate is not None else SwapGate()
        self.format: ToolFormat = tool_format(config.tool_format)
        self.provider = TracerProvider(resource=Resource.create({"service.name": "lightning-gateway"}))
        if config.collector_url:
            exporter = LightningSpanExporter(endpoint=config.collector_url, token=config.collector_token)
            self.provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=200))
        self.tracer = self.provider.get_tracer("lightning_otel.serve.gateway")
        self.server = GatewayServer((config.host, config.port), GatewayHandler, self, config.connection_limits)
        self.port = self.server.server_address[1]
        self.url = f"http://{config.host}:{self.port}"
        self._thread: threading.Thread | None = None
        self._calls: dict[str, int] = {}
        self._scripts: dict[str, list[str]] = {}
        self._calls_lock = threading.Lock()
        self._warned: set[str] = set()  # off-policy parameters already logged once
        self.responses = responses.ResponseStore(config.stored_responses)

    def start(self) -> None:
        self._thread = threading.Thread(target=self.server.serve_forever, name="gateway-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._thread is not None:
            self.server.shutdown()
        self.server.server_close()
        self.provider.shutdown()  # flushes the generate spans still queued

    def flush(self) -> None:
        self.provider.force_flush()

    def base_url(self, rollout_id: str | None = None) -> str:
        return f"{self.url}/r/{rollout_id}/v1" if rollout_id else f"{self.url}/v1"

    def script(self, rollout_id: str, answers: list[str] | None) -> None:
        """Answer the rollout's calls with `answers`, in order, and refuse the calls after them; None forgets
        the rollout (its script and its call count)."""
        with self._calls_lock:
            if answers is None:
                self._scripts.pop(rollout_id, None)
                self._calls.pop(rollout_id, None)
            else:
                self._scripts[rollout_id] = [str(a) for a in answers]

    def _count_call(self, rollout_id: str | None) -> str | None:
        """Count the rollout's call against its limit; the scripted answer for it, if the rollout has one."""
        if rollout_id is None:
            return None
        with self._calls_lock:
            script = self._scripts.get(rollout_id)
            limits = [x for x in (self.config.max_calls_per_rollout, None if script is None else len(script))
                      if x is not None]
            if not limits:
                return None
            made, limit = self._calls.get(rollout_id, 0), min(limits)
            if made >= limit:
                what = ("answers scripted for it" if script is not None and limit == len(script)
                        else "this gateway only collects each agent's first prompt(s)")
                raise BadRequest(f"rollout {rollout_id} may make {limit} model call(s) here and this is call "
                                 f"{made + 1}: {what}, so the agent is expected to stop here")
            self._calls[rollout_id] = made + 1
            return None if script is None else script[made]

    def _off_policy(self, body: dict, rollout_id: str | None) -> list[str]:
        """The parameters to strip from this request (refused instead under off_policy_params="refuse"): none
        unless the temperature is forced, none for a scripted rollout (its answers are not sampled)."""
        if self.config.temperature is None or rollout_id in self._scripts:
            return []
        names = off_policy_params(body)
        if names and self.config.off_policy_params == "refuse":
            listed = ", ".join(f"'{n}' {json.dumps(body[n])[:60]}" for n in names)
            raise BadRequest(f"{listed}: the engine would sample from another distribution than the policy's "
                             "softmax(logits / T), so the recorded logprobs would not be the ones the learner trains "
                             "on (this gateway records training rollouts). Drop it from the agent's request or config, "
                             "or start the gateway with off_policy_params=\"strip\" to drop it here and list it in "
                             "the record", names[0])
        for name in set(names) - self._warned:  # once per name: agents send the same config every call
            log.warning("stripping %r from requests: it changes the sampling distribution (listed in the "
                        "records as %s)", name, STRIPPED_ATTRIBUTE)
            self._warned.add(name)
        return names

    def _apply_overrides(self, upstream: dict, scripted: str | None = None, stripped: list[str] = ()) -> None:
        cap = 1 if scripted is not None else self.config.max_tokens_cap  # a scripted call needs the prompt only
        if cap is not None:
            for key in ("max_tokens", "max_completion_tokens"):
                if upstream.get(key) is not None:
                    upstream[key] = min(upstream[key], cap)
        if self.config.temperature is not None:
            upstream["temperature"] = self.config.temperature
        for name in stripped:
            upstream.pop(name, None)

    # ---- chat completions ------------------------------------------------------------------------------

    def _chat_call(self, body: dict, headers: dict[str, str], rollout_id: str | None,
                   response_id: str | None) -> ChatCall:
        check_chat(body, self.config.max_n)
        # Both chat and Responses calls come through here: a patch changes what the engine gets, not what the
        # client sent (a Responses conversation is stored unpatched).
        body, patch = self.config.prompts.apply(body) if self.config.prompts is not None else (body, None)
        stripped = self._off_policy(body, rollout_id)  # before counting: a refused call is not one
        scripted = self._count_call(rollout_id)
        plan = plan_tools(body)
        upstream = chat_upstream(body, plan, self.format, bool(self.config.native_tools), self.config.chat_template)
        if upstream.get("max_tokens") is None and upstream.get("max_completion_tokens") is None:
            upstream["max_tokens"] = self.config.default_max_tokens
        self._apply_overrides(upstream, scripted, stripped)
        requested = str(body.get("model") or self.engine.model_name)
        return ChatCall(body, headers, rollout_id, response_id, requested, plan, upstream, scripted, stripped, patch,
                        self._adapter(requested, headers))

    def _adapter(self, requested_model: str, headers: dict[str, str]) -> str | None:
        """The adapter that serves a call (adapters.adapter_for); None without adapters configured."""
        if not self.config.adapters:
            return None
        return adapter_for(self.config.adapters, requested_model, header_agent(headers))

    def chat(self, body: dict, headers: dict[str, str], rollout_id: str | None, response_id: str | None = None) -> dict:
        """A chat completion, whole (`response_id`: a Responses call's id, to record it under)."""
        if self.outside is not None:
            return self._forward(body, headers, rollout_id, response_id, stream=False)
        return self._whole_chat(self._chat_call(body, headers, rollout_id, response_id))

    def chat_stream(self, body: dict, headers: dict[str, str], rollout_id: str | None,
                    response_id: str | None = None) -> AnswerStream:
        """A chat completion as stream chunks, sampled as they go out (streaming.py). A request the gateway or
        the engine refuses raises here, before any chunk. A forced call shows nothing until it is parsed and a
        scripted answer is not sampled: both are made whole and replayed as chunks."""
        if self.outside is not None:
            return self._forward(body, headers, rollout_id, response_id, stream=True)
        call = self._chat_call(body, headers, rollout_id, response_id)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        if call.plan.must_call or call.scripted is not None:
            return FinishedStream(self._whole_chat(call), include_usage)
        started = time.time_ns()
        chunks = self._generate(call.upstream, stream=True, adapter=call.adapter)

        def record(index: int, prompt_ids: list[int], completion_ids: list[int], logprobs: list, started_ns: int,
                   ended_ns: int, finish: str | None) -> None:
            self._record(headers, rollout_id, call.requested_model, stream.id, index, prompt_ids, completion_ids,
                         logprobs, started_ns, ended_ns, stripped=call.stripped, finish_reason=finish,
                         patch=call.patch, adapter=call.adapter)

        stream = ChatStream(chunks, record, self.format, call.plan.offered, call.requested_model, response_id,
                            bool(body.get("logprobs")), include_usage, started)
        return stream

    def _whole_chat(self, call: ChatCall) -> dict:
        body, headers, rollout_id, scripted = call.body, call.headers, call.rollout_id, call.scripted
        requested_model, plan, stripped = call.requested_model, call.plan, call.stripped
        started = time.time_ns()
        requests = self._requests(call.upstream, plan, scripted, call.adapter)
        runs = [(opening, self._generate(request, adapter=call.adapter)) for opening, request in requests]
        ended = time.time_ns()
        # A Responses call is recorded under its own id.
        response_id = call.response_id or runs[0][1].get("id") or f"chatcmpl-{uuid.uuid4().hex}"
        choices, pieces, usage = [], [], {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        for opening, result in runs:
            prompt_ids = result.get("prompt_token_ids") or []
            usage = {k: v + _usage(result)[k] for k, v in usage.items()}
            for choice in result.get("choices", []):
                # A forced call's opening is the start of the answer the client gets, and prompt in the record.
                content = opening + ((choice.get("message") or {}).get("content") or "")
                pieces.append([opening, *_pieces(choice)] if opening else _pieces(choice))
                if scripted is not None:
                    content, choice = scripted, {**choice, "finish_reason": "stop", "token_ids": [], "logprobs": None}
                    pieces[-1] = [scripted]
                parsed = self.format.parse(content, plan.offered)
                message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
                finish = choice.get("finish_reason")
                if parsed.tool_calls:
                    message["tool_calls"] = parsed.tool_calls
                    finish = "tool_calls"
                token_logprobs = [t.get("logprob") for t in ((choice.get("logprobs") or {}).get("content") or [])]
                out = {"index": len(choices), "message": message, "finish_reason": finish,
                       "logprobs": choice.get("logprobs") if body.get("logprobs") else None}
                choices.append(out)
                self._record(headers, rollout_id, requested_model, response_id, out["index"], prompt_ids,
                             choice.get("token_ids") or [], token_logprobs, started, ended, scripted, stripped,
                             opening, choice.get("finish_reason"), call.patch, call.adapter)
        return {"id": response_id, "object": "chat.completion", "created": int(time.time()), "model": requested_model,
                "choices": choices, "usage": usage, "_token_pieces": pieces}

    def _requests(self, upstream: dict, plan: ToolPlan, scripted: str | None,
                  adapter: str | None = None) -> list[tuple[str, dict]]:
        """The engine requests that answer a chat request, each with the opening it continues ("" for none):
        one, but for a call forced among several tools, one per tool the name choice picked (its n choices)."""
        if not plan.must_call:
            return [("", upstream)]
        if plan.name is not None or scripted is not None:  # a scripted answer needs the prompt only
            opening = self.format.forced_prefix(plan.name)
            return [(opening, with_opening(upstream, opening))]
        chosen = self._choose_names(upstream, plan, adapter)
        return [(self.format.forced_prefix(name), with_opening(upstream, self.format.forced_prefix(name),
                                                                n=chosen.count(name)))
                for name in dict.fromkeys(chosen)]

    def _choose_names(self, upstream: dict, plan: ToolPlan, adapter: str | None = None) -> list[str]:
        """One offered tool per choice, sampled by the policy with the answer constrained to the names."""
        result = self._generate(name_choice(upstream, self.format.forced_prefix(None), plan.names), adapter=adapter)
        names = [((c.get("message") or {}).get("content") or "") for c in result.get("choices", [])]
        if not names or any(name not in plan.names for name in names):
            raise EngineError(502, {"error": {"message": f"the engine's choice of a tool among {list(plan.names)} "
                                                         f"gave {names}: structured outputs did not hold",
                                              "type": "engine_error"}})
        return names

    def _generate(self, request: dict, stream: bool = False, adapter: str | None = None) -> Any:
        """A chat generation (whole, or the engine's open stream) by the policy, or by `adapter`'s model; a request
        the engine refuses because the chat template cannot render it is answered with an error that says so (the
        engine's own message gives only the template's reason)."""
        served = self._served(adapter)
        try:
            if stream:
                return self.engine.stream("/v1/chat/completions", request, **served)
            return self.engine.generate("/v1/chat/completions", request, **served)
        except EngineError as exc:
            if exc.status != 400:
                raise
            reason = self._render_failure(request)
            if reason is None:
                raise
            which = "the gateway's chat_template" if self.config.chat_template is not None else \
                "the model's chat template"
            hint = ("; start vLLM with --trust-request-chat-template, or give the gateway no chat_template"
                    if "trust-request-chat-template" in reason else "")
            raise BadRequest(f"{which} could not render this request: {reason}{hint}", "messages") from None

    def _served(self, adapter: str | None) -> dict:
        """The engine's `model` argument for a call (none without adapters configured: the current policy)."""
        return {"model": self.engine.served_model(adapter)} if self.config.adapters else {}

    def _render_failure(self, request: dict) -> str | None:
        """Why the engine cannot render `request`'s prompt, or None when it can (the refusal was another)."""
        keys = ("messages", "tools", "chat_template", "chat_template_kwargs", "add_generation_prompt",
                "continue_final_message")
        try:
            self.engine.tokenize_chat({k: request[k] for k in keys if k in request})
        except EngineError as exc:
            return str(exc) if exc.status == 400 else None
        return None

    def respond(self, body: dict, headers: dict[str, str], rollout_id: str | None) -> dict:
        """POST /v1/responses: the Responses API over chat(), recorded under the response's id."""
        return responses.answer(body, self.responses,
                                lambda chat_body, response_id: self.chat(chat_body, headers, rollout_id, response_id))

    def respond_stream(self, body: dict, headers: dict[str, str], rollout_id: str | None) -> responses.ResponseStream:
        """POST /v1/responses with `stream: true`: its events over chat_stream(), as the text is sampled."""
        return responses.stream(body, self.responses, lambda chat_body, response_id: self.chat_stream(
            chat_body, headers, rollout_id, response_id))

    # ---- closed models: forwarded to an outside endpoint ------------------------------------------------

    def _forward(self, body: dict, headers: dict[str, str], rollout_id: str | None, response_id: str | None,
                 stream: bool) -> dict | forward.ForwardStream:
        """A chat call answered by the outside endpoint (forward.py): checked, patched, counted, the run's
        temperature and token cap forced, recorded as text."""
        check_chat(body, self.config.max_n)
        request, patch = self.config.prompts.apply(body) if self.config.prompts is not None else (body, None)
        if self._count_call(rollout_id) is not None:
            raise BadRequest("scripted answers need an engine: this gateway forwards to an outside endpoint")
        requested_model = str(body.get("model") or self.outside.model_name)  # type: ignore[union-attr]
        request = forward.outside_request(self.outside, request, self.config.max_tokens_cap)  # type: ignore[arg-type]
        self._apply_overrides(request)
        base = forward.call_attributes(self.outside, request, requested_model,  # type: ignore[arg-type]
                                       rollout_id, patch)
        if (agent := header_agent(headers)) is not None:
            base[AGENT_ATTRIBUTE] = agent

        def record(attributes: dict, started: int, ended: int, error: str | None, message: str | None) -> None:
            span = self.tracer.start_span(forward.FORWARD_SPAN, context=extract(headers), kind=SpanKind.SERVER,
                                          start_time=started, attributes=attributes)
            if error is not None:
                span.set_attribute("error.type", error)
                span.set_status(Status(StatusCode.ERROR, (message or error)[:1000]))
            span.end(end_time=ended)

        if stream:
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return forward.forward_stream(self.outside, request, headers, base, record,  # type: ignore[arg-type]
                                          requested_model, include_usage, response_id)
        return forward.forward_whole(self.outside, request, headers, base, record,  # type: ignore[arg-type]
                                     response_id)

    # ---- legacy completions ----------------------------------------------------------------------------

    def complete(self, body: dict, headers: dict[str, str], rollout_id: str | None) -> dict:
        if self.outside is not None:
            raise BadRequest("this gateway forwards to an outside endpoint and passes on chat completions and the "
                             "Responses API only: legacy /v1/completions are not forwarded; call "
                             "/v1/chat/completions", "prompt")
        check_completion(body, self.config.max_n)
        stripped = self._off_policy(body, rollout_id)
        scripted = self._count_call(rollout_id)
        requested_model = str(body.get("model") or self.engine.model_name)
        adapter = self._adapter(requested_model, headers)
        upstream = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        upstream.setdefault("max_tokens", self.config.default_max_tokens)
        self._apply_overrides(upstream, scripted, stripped)
        started = time.time_ns()
        result = self.engine.generate("/v1/completions", upstream, **self._served(adapter))
        ended = time.time_ns()
        choices = []
        for choice in result.get("choices", []):
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
            index = choice.get("index", len(choices))
            if scripted is not None:
                choice, logprobs = {**choice, "text": scripted, "finish_reason": "stop", "token_ids": []}, []
            choices.append({"index": index, "text": choice.get("text", ""),
                            "finish_reason": choice.get("finish_reason"), "logprobs": None})
            self._record(headers, rollout_id, requested_model, result.get("id"), index,
                         choice.get("prompt_token_ids") or [], choice.get("token_ids") or [], logprobs, started, ended,
                         scripted, stripped, finish_reason=choice.get("finish_reason"), adapter=adapter)
        return {"id": result.get("id"), "object": "text_completion", "created": int(time.time()),
                "model": requested_model, "choices": choices, "usage": _usage(result)}

    def _record(self, headers: dict[str, str], rollout_id: str | None, requested_model: str, response_id: Any,
                index: int, prompt_ids: list[int], completion_ids: list[int], logprobs: list, started: int,
                ended: int, scripted: str | None = None, stripped: list[str] = (), forced_prefix: str = "",
                finish_reason: str | None = None, patch: PromptPatch | None = None,
                adapter: str | None = None) -> None:
        attributes = {
            "lightning.policy.version": self.engine.policy_version, "lightning.engine": self.engine.name,
            "gen_ai.request.model": requested_model, "lightning.choice.index": index,
            "lightning.prompt.token_ids": list(prompt_ids), "lightning.completion.token_ids": list(completion_ids),
            "lightning.completion.logprobs": [float(x) if x is not None else float("nan") for x in logprobs],
        }
        if response_id:
            attributes["gen_ai.response.id"] = str(response_id)
        if rollout_id:
            attributes["lightning.rollout.id"] = rollout_id
        if scripted is not None:
            attributes["lightning.scripted.answer"] = scripted
        if stripped:
            attributes[STRIPPED_ATTRIBUTE] = list(stripped)
        if forced_prefix:  # the end of the prompt ids: the answer's opening the gateway wrote, not the policy
            attributes[FORCED_PREFIX_ATTRIBUTE] = forced_prefix
        if finish_reason:  # the engine's (stop, length), or why a stream was cut: client_disconnected, error
            attributes[FINISH_ATTRIBUTE] = [finish_reason]
        if patch is not None:  # the prompt ids are the patched prompt's; an unpatched call records nothing here
            attributes.update(patch.record())
        if adapter is not None:  # one adapter per agent: the adapter that served it (absent: the base model)
            attributes[ADAPTER_ATTRIBUTE] = adapter
        if (agent := header_agent(headers)) is not None:  # the agent the agent process saw make the call
            attributes[AGENT_ATTRIBUTE] = agent
        span = self.tracer.start_span(GENERATE_SPAN, context=extract(headers), kind=SpanKind.SERVER,
                                      start_time=started, attributes=attributes)
        span.end(end_time=ended)


def _usage(result: dict) -> dict:
    usage = result.get("usage") or {}
    return {k: usage.get(k, 0) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def _pieces(choice: dict) -> list[str]:
    """The generated text split at token boundaries (for streaming), from the engine's logprobs."""
    return [t.get("token", "") for t in ((choice.get("logprobs") or {}).get("content") or [])]
