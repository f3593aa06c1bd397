"""Closed models: the gateway forwards chat calls to an outside OpenAI-compatible endpoint and records them as text.

    GatewayConfig(forward_url="https://api.openai.com/v1", forward_api_key_env="OPENAI_API_KEY", prompts=...)

An outside model (a GPT-class API, a vLLM server elsewhere) gives no token ids, so nothing can train on its calls;
what the gateway still does for them is what prompt optimisation and evaluation need: apply the prompt patch,
force the run's temperature and token cap (as request parameters), count calls per rollout, and record each call.
The record is a `lightning.forward` span (not `lightning.generate`: it has no token ids, so the token records,
the `generations` view and the compiler's token join never see it) under the client's LLM span (the request's
`traceparent`), with the rollout id, the patch id and prompt version, the messages the endpoint got (patched),
its answer (text and tool calls), finish reasons, usage, and on failure the error. `lightning.token_source` is
"none": the compiler excludes the rollouts of such calls from training with that reason
(train/transitions/trajectories.py).

The key. The endpoint's key is `forward_api_key_env`'s variable, read at each call, when one is configured; else
the agent's own `Authorization` header goes through (only when the gateway has no key of its own, which that
header would otherwise carry). Keys and headers are never recorded.

Errors. An answer of 4xx/5xx goes back to the agent with its status, in OpenAI's error shape (the endpoint's own
error object when it sent one); a timeout is a 504, a refused or dropped connection a 502. Each is recorded, as
a span with status ERROR, `error.type` and the status.

Streaming passes through: each event of the endpoint goes to the client as it arrives (a usage event the client did
not ask for is held back: the gateway asks for usage to record it); the record is written when the stream ends,
cut short or whole.
"""
from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Callable, Iterator

from lightning_otel.errors import UserError
from lightning_otel.serve.engine import EngineError, EngineStream
from lightning_otel.serve.prompts import PromptPatch

log = logging.getLogger(__name__)
FORWARD_SPAN = "lightning.forward"
TOKEN_SOURCE_ATTRIBUTE = "lightning.token_source"
NO_TOKENS = "none"  # the value of TOKEN_SOURCE_ATTRIBUTE on a forwarded call
ENGINE_NAME = "outside"
MAX_RECORDED_CHARS = 200_000  # one attribute's JSON; longer conversations are cut (and said so)

# Writes the record: (attributes, start ns, end ns, error type or None, error message or None)
RecordFn = Callable[[dict, int, int, str | None, str | None], None]


def public_url(url: str) -> str:
    """`url` without user, password and query (the place a key could hide), for records and messages."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


@dataclass
class Outside:
    """The outside endpoint: where calls go, which key they carry, which model they name."""
    url: str                          # its base URL, ending in /v1 as OpenAI clients take it
    api_key_env: str | None = None    # the environment variable with its key (None: the agent's Authorization)
    model: str | None = None          # the model name every call is sent with (None: the one the agent names)
    timeout_s: float = 300.0          # one read of its answer (a stream: between two events)
    name: str = field(init=False, default=ENGINE_NAME)
    policy_version: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        self.shown = public_url(self.url)

    @property
    def model_name(self) -> str:
        return self.model or ENGINE_NAME

    def headers(self, client_headers: dict[str, str]) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key_env:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise EngineError(500, _error(f"the gateway forwards to {self.shown} with the key in the environment "
                                              f"variable {self.api_key_env}, which is not set: set it where the "
                                              f"gateway runs", "configuration_error", 500))
            headers["Authorization"] = f"Bearer {key}"
        elif client_headers.get("authorization"):
            headers["Authorization"] = client_headers["authorization"]
        return headers

    def open(self, path: str, body: dict, client_headers: dict[str, str]) -> http.client.HTTPResponse:
        """POST `body` to the endpoint; its open answer when it is 2xx, else EngineError in OpenAI's shape."""
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers=self.headers(client_headers), method="POST")
        try:
            return urllib.request.urlopen(request, timeout=self.timeout_s)
        except urllib.error.HTTPError as exc:
            raise EngineError(exc.code, self._http_error(exc)) from None
        except (TimeoutError, socket.timeout):
            raise self.timed_out() from None
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, (TimeoutError, socket.timeout)):
                raise self.timed_out() from None
            raise EngineError(502, _error(f"the outside endpoint {self.shown} could not be reached: {exc.reason}",
                                          "upstream_unreachable", 502)) from None
        except (OSError, http.client.HTTPException) as exc:  # reset, closed before the status line
            raise self.dropped(exc) from None

    def post(self, path: str, body: dict, client_headers: dict[str, str]) -> dict:
        with self.open(path, body, client_headers) as response:
            try:
                raw = response.read()
            except (TimeoutError, socket.timeout):
                raise self.timed_out() from None
            except (OSError, http.client.HTTPException) as exc:
                raise self.dropped(exc) from None
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = None
        if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list):
            raise EngineError(502, _error(f"the outside endpoint {self.shown} answered with something that is not a "
                                          f"chat completion: {raw[:200]!r}", "upstream_error", 502))
        return answer

    def timed_out(self) -> EngineError:
        return EngineError(504, _error(f"the outside endpoint {self.shown} did not answer within "
                                       f"{self.timeout_s:g} s", "upstream_timeout", 504))

    def dropped(self, exc: BaseException) -> EngineError:
        return EngineError(502, _error(f"the outside endpoint {self.shown} closed the connection before its answer "
                                       f"was whole ({exc or type(exc).__name__})", "upstream_error", 502))

    def _http_error(self, exc: urllib.error.HTTPError) -> dict:
        try:
            raw = exc.read()
        except (OSError, http.client.HTTPException):
            raw = b""
        try:
            payload = json.loads(raw)
        except ValueError:
            payload = None
        if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
            return {"error": {**payload["error"], "code": payload["error"].get("code") or exc.code}}
        text = raw.decode(errors="replace").strip()[:500] or exc.reason
        return _error(f"the outside endpoint {self.shown} answered {exc.code}: {text}", "upstream_error", exc.code)

    def models(self, client_headers: dict[str, str]) -> dict:
        """GET /models of the endpoint (what an agent that lists models gets)."""
        request = urllib.request.Request(self.url + "/models", headers=self.headers(client_headers))
        try:
            with urllib.request.urlopen(request, timeout=min(self.timeout_s, 30)) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            raise EngineError(exc.code, self._http_error(exc)) from None
        except (OSError, ValueError, http.client.HTTPException) as exc:
            raise EngineError(502, _error(f"the outside endpoint {self.shown} did not list its models: {exc}",
                                          "upstream_unreachable", 502)) from None


def check_config(url: object, chat_template: object, timeout_s: object, api_key_env: str | None,
                 gateway_key: str | None) -> None:
    """A forwarding gateway's settings (GatewayConfig's forward_* fields and the ones they exclude)."""
    if not (isinstance(url, str) and url.startswith(("http://", "https://"))):
        raise UserError(f"forward_url {url!r}: give the outside endpoint's base URL, like "
                        "https://api.openai.com/v1")
    if chat_template is not None:
        raise UserError("chat_template is the engine's: an outside endpoint renders prompts its own way; leave it "
                        "out when forwarding")
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise UserError(f"forward_timeout_s={timeout_s!r}: give a positive number of seconds")
    if api_key_env is not None and not os.environ.get(api_key_env):
        raise UserError(f"the environment variable {api_key_env} (the outside endpoint's key) is not "
                        f"set: set it, or name another (api_key_env)")
    if gateway_key is not None and api_key_env is None:
        raise UserError("this gateway has its own API key, which agents send as their Authorization header: name "
                        "the environment variable with the outside endpoint's key (api_key_env) so that the "
                        "gateway's key is never sent on")


def outside_request(outside: Outside, request: dict, max_tokens_cap: int | None) -> dict:
    """The request as the outside endpoint gets it: not streamed yet (the caller asks), its model named when
    the run names one, the run's token cap where the agent set none."""
    request = {k: v for k, v in request.items() if k not in ("stream", "stream_options")}
    if outside.model:
        request["model"] = outside.model
    if max_tokens_cap is not None and request.get("max_tokens") is None \
            and request.get("max_completion_tokens") is None:
        request["max_tokens"] = max_tokens_cap
    return request


def _error(message: str, kind: str, code: int) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def _json(value: object) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= MAX_RECORDED_CHARS else text[:MAX_RECORDED_CHARS] + "...(cut)"


def call_attributes(outside: Outside, request: dict, requested_model: str, rollout_id: str | None,
                    patch: PromptPatch | None, stripped: list[str] = ()) -> dict:
    """What every record of a forwarded call carries, before its answer."""
    attributes = {
        "lightning.engine": ENGINE_NAME, "lightning.policy.version": 0, TOKEN_SOURCE_ATTRIBUTE: NO_TOKENS,
        "lightning.outside.url": outside.shown, "gen_ai.request.model": requested_model,
        "gen_ai.input.messages": _json(request.get("messages") or []),
        "lightning.stream": bool(request.get("stream")),
    }
    if request.get("tools"):
        attributes["gen_ai.tool.definitions"] = _json(request["tools"])
    if rollout_id:
        attributes["lightning.rollout.id"] = rollout_id
    if patch is not None:
        attributes.update(patch.record())
    return attributes


def answer_attributes(answer: dict) -> dict:
    """The answer's part of a record: output messages, finish reasons, usage, response id and model."""
    choices = answer.get("choices") or []
    attributes = {
        "gen_ai.output.messages": _json([{**(c.get("message") or {}), "finish_reason": c.get("finish_reason")}
                                         for c in choices]),
        "gen_ai.response.finish_reasons": [str(c.get("finish_reason")) for c in choices],
    }
    usage = answer.get("usage") or {}
    for key, name in (("prompt_tokens", "gen_ai.usage.input_tokens"),
                      ("completion_tokens", "gen_ai.usage.output_tokens")):
        if isinstance(usage.get(key), int):
            attributes[name] = usage[key]
    if answer.get("id"):
        attributes["gen_ai.response.id"] = str(answer["id"])
    if answer.get("model"):
        attributes["gen_ai.response.model"] = str(answer["model"])
    return attributes


def forward_whole(outside: Outside, request: dict, headers: dict[str, str], base: dict, record: RecordFn,
                  response_id: str | None) -> dict:
    """A chat call answered whole by the endpoint, recorded; EngineError (recorded too) when it fails."""
    started = time.time_ns()
    try:
        answer = outside.post("/chat/completions", request, headers)
    except EngineError as exc:
        record(base, started, time.time_ns(), f"http_{exc.status}", str(exc))
        raise
    if response_id:  # a Responses call is recorded (and answered) under its own id
        answer = {**answer, "id": response_id}
    record({**base, **answer_attributes(answer)}, started, time.time_ns(), None, None)
    return answer


class ForwardStream:
    """A streamed chat call passed through event by event (gateway_http writes them out), its record written when
    it ends. Implements streaming.AnswerStream: the Responses API streams over it like over the engine's."""

    def __init__(self, events: EngineStream, base: dict, record: RecordFn, model: str, include_usage: bool,
                 response_id: str | None, started_ns: int):
        self._events, self._base, self._record = events, base, record
        self.model, self._include_usage, self._id, self._started = model, include_usage, response_id, started_ns
        self._choices: dict[int, dict] = {}
        self._usage: dict | None = None
        self._answer_id: str | None = None
        self._answer_model: str | None = None
        self.completion: dict | None = None

    def __iter__(self) -> Iterator[list[dict]]:
        try:
            for event in self._events:
                yield self._take(event)
        except EngineError as exc:
            log.warning("the outside endpoint broke off a streamed answer: %s", exc)
            self._finish("error", f"http_{exc.status}", str(exc))
            yield [{"error": {**(exc.body.get("error") or {"message": str(exc)}), "code": exc.status}}]
            return
        except Exception as exc:  # a failure of ours: the record still says what came
            self._finish("error", type(exc).__name__, str(exc))
            raise
        self._finish(None)

    def close(self) -> None:
        self._events.close()
        if self.completion is None:
            self._finish("client_disconnected")

    def _take(self, event: dict) -> list[dict]:
        self._answer_id = self._answer_id or event.get("id")
        self._answer_model = self._answer_model or event.get("model")
        if self._id:
            event = {**event, "id": self._id}
        if event.get("usage"):
            self._usage = event["usage"]
        for delta_choice in event.get("choices") or []:
            choice = self._choices.setdefault(delta_choice.get("index", 0),
                                              {"content": "", "calls": {}, "finish_reason": None})
            delta = delta_choice.get("delta") or {}
            choice["content"] += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                kept = choice["calls"].setdefault(call.get("index", len(choice["calls"])),
                                                  {"id": None, "type": "function",
                                                   "function": {"name": "", "arguments": ""}})
                kept["id"] = call.get("id") or kept["id"]
                function = call.get("function") or {}
                kept["function"]["name"] += function.get("name") or ""
                kept["function"]["arguments"] += function.get("arguments") or ""
            if delta_choice.get("finish_reason") is not None:
                choice["finish_reason"] = delta_choice["finish_reason"]
        if not event.get("choices") and event.get("usage") and not self._include_usage:
            return []  # the usage the gateway asked for, to record: not the client's
        return [event]

    def _finish(self, stopped: str | None, error_type: str | None = None, message: str | None = None) -> None:
        if self.completion is not None:
            return
        choices = []
        for index in sorted(self._choices):
            choice = self._choices[index]
            message_out: dict = {"role": "assistant", "content": choice["content"] or None}
            if choice["calls"]:
                message_out["tool_calls"] = [choice["calls"][i] for i in sorted(choice["calls"])]
            choices.append({"index": index, "message": message_out,
                            "finish_reason": choice["finish_reason"] or stopped or "error"})
        self.completion = {"id": self._id or self._answer_id, "object": "chat.completion", "created": int(time.time()),
                           "model": self.model, "choices": choices, "usage": self._usage or {}}
        attributes = {**self._base, **answer_attributes(
            {**self.completion, "id": self._answer_id or self._id, "model": self._answer_model})}
        if stopped is not None and error_type is None and stopped != "client_disconnected":
            error_type = stopped
        if stopped == "client_disconnected":
            attributes["gen_ai.response.finish_reasons"] = [stopped]
        self._record(attributes, self._started, time.time_ns(), error_type, message)


def forward_stream(outside: Outside, request: dict, headers: dict[str, str], base: dict, record: RecordFn,
                   requested_model: str, include_usage: bool, response_id: str | None) -> ForwardStream:
    """Open the endpoint's stream (a refusal raises EngineError here, recorded, before any event)."""
    started = time.time_ns()
    upstream = {**request, "stream": True, "stream_options": {"include_usage": True}}
    try:
        response = outside.open("/chat/completions", upstream, headers)
    except EngineError as exc:
        record(base, started, time.time_ns(), f"http_{exc.status}", str(exc))
        raise
    return ForwardStream(EngineStream(response), base, record, requested_model, include_usage, response_id, started)


__all__ = ["Outside", "ForwardStream", "FORWARD_SPAN", "TOKEN_SOURCE_ATTRIBUTE", "NO_TOKENS", "forward_whole",
           "forward_stream", "call_attributes", "public_url"]
