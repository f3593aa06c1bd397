"""Streamed chat answers: chunks go to the client as the engine samples them, and each choice's exact token
ids, logprobs and finish reason are recorded whole when the stream ends.

The gateway opens the engine's stream (`Engine.stream`) and wraps it in a ChatStream, which the HTTP side
iterates and writes out chunk by chunk:
- Content deltas are forwarded as they come, under the gateway's id and the model name the client asked for.
- With tools offered, text that may begin a call is held back (`HeldText`): the format's `call_start` and any
  end of the text that could be its beginning, and whitespace that may turn out to sit before a call (the
  parsers strip it from the content). Once a call starts, the rest of the choice waits for its end; the whole
  text is then parsed (OpenAI's rules, toolcalls.py) and the calls go out as one `tool_calls` delta, or the
  held text goes out as content when it was not a call.
- With n > 1 the choices come interleaved, as the engine sends them, each chunk naming its index.
- The record of each choice (`lightning.generate`, as for a whole answer) is written when the stream ends.
  A stream that stops early is recorded as far as it got: a client that left (or stopped reading past the
  send timeout) closes it, the engine's request is dropped (vLLM aborts it) and the choices still open are
  recorded with finish reason `client_disconnected`; an engine that fails mid-stream gives `error` (and the
  client an error event). A client that leaves before the engine's first chunk leaves no record: the prompt
  ids come with that chunk.

Answers that are not sampled as they stream (a forced tool call, which shows nothing until it is parsed; a
scripted rollout) are made whole first and replayed as chunks (`FinishedStream`).
"""
from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

from lightning_otel.serve.engine import ChunkStream, EngineError
from lightning_otel.serve.toolcalls import ToolFormat

log = logging.getLogger(__name__)
DISCONNECTED = "client_disconnected"  # the finish reason recorded for choices a departed client cut short
FAILED = "error"                      # ... and for those the engine broke off

# (choice index, prompt ids, completion ids, logprobs, start ns, end ns, finish reason): writes the record
Recorder = Callable[[int, list[int], list[int], list[float | None], int, int, str | None], None]


class AnswerStream(Protocol):
    """What the HTTP side streams: lists of chat.completion.chunk objects (an empty list when the engine's
    chunk gave the client nothing: a moment to see whether it is still there), then `completion`, the whole
    answer as a chat completion. close() ends it early (the client is gone) and is safe to call after the end."""
    model: str  # the name the client asked for
    completion: dict | None

    def __iter__(self) -> Iterator[list[dict]]: ...
    def close(self) -> None: ...


def held_back(text: str, call_start: str) -> int:
    """How many characters at the end of `text` could be the beginning of `call_start`."""
    for size in range(min(len(text), len(call_start) - 1), 0, -1):
        if text.endswith(call_start[:size]):
            return size
    return 0


class HeldText:
    """A choice's text as it grows, and how much of it the client may have yet. Without a call_start (no
    tools offered) everything goes out at once; with one, text stops going out where a call may begin."""

    def __init__(self, call_start: str | None):
        self.call_start = call_start
        self.text = ""
        self.sent = 0  # characters of `text` the client has
        self.in_call = False

    def feed(self, delta: str) -> str:
        """Add `delta`; the text that may go to the client now."""
        self.text += delta
        if not self.call_start:
            return self._release(len(self.text))
        if self.in_call:
            return ""
        start = self.text.find(self.call_start, self.sent)  # anything sent holds no beginning of a call
        if start >= 0:
            self.in_call = True
            end = start
        else:
            end = len(self.text) - held_back(self.text, self.call_start)
        # Whitespace waits for what follows it: before a call it is not content.
        return self._release(self.sent + len(self.text[self.sent:end].rstrip()))

    def _release(self, end: int) -> str:
        out = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return out

    def rest(self, content: str) -> str:
        """What the client is still owed of the answer's final `content` (the parsed content before a call,
        or the whole text). Text sent never needs taking back, but for leading whitespace the parser strips."""
        sent = self.text[:self.sent]
        for given in (sent, sent.lstrip()):
            if content.startswith(given):
                return content[len(given):]
        log.warning("a streamed answer's content %r does not continue the text already sent %r", content[:80],
                    sent[:80])
        return ""


@dataclass
class Choice:
    held: HeldText
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)  # the engine's logprobs.content entries
    unsent: list[dict] = field(default_factory=list)    # ... not yet given to the client
    message: dict | None = None
    finish: str | None = None         # the client's finish reason (tool_calls when calls were parsed)
    engine_finish: str | None = None  # what the generation did: stop, length, client_disconnected, error
    ended_ns: int = 0


class ChatStream:
    """One streamed chat completion over an engine stream; see the module docstring."""

    def __init__(self, chunks: ChunkStream, record: Recorder, tool_format: ToolFormat, offered: frozenset[str],
                 model: str, response_id: str | None, logprobs: bool, include_usage: bool, started_ns: int):
        self._chunks, self._record, self._format, self._offered = chunks, record, tool_format, offered
        self._call_start = tool_format.call_start if offered else None
        self.model, self.id, self._logprobs, self._include_usage = model, response_id, logprobs, include_usage
        self.created = int(time.time())
        self._started_ns = started_ns
        self._prompt_ids: list[int] | None = None
        self._usage: dict | None = None
        self._choices: dict[int, Choice] = {}
        self.completion: dict | None = None

    def __iter__(self) -> Iterator[list[dict]]:
        try:
            for chunk in self._chunks:
                yield self._take(chunk)
        except EngineError as exc:
            log.warning("the engine broke off a streamed answer: %s", exc)
            self._finish(FAILED)
            error = exc.body.get("error") if isinstance(exc.body.get("error"), dict) else {"message": str(exc)}
            yield [{"error": {**error, "code": exc.status}}]
            return
        except Exception:  # a failure of ours: the record still says what the engine made
            self._finish(FAILED)
            raise
        yield self._finish(None)

    def close(self) -> None:
        self._chunks.close()
        if self.completion is None:
            self._finish(DISCONNECTED)

    def _chunk(self, index: int, delta: dict, finish: str | None = None, logprobs: list[dict] | None = None) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": index, "delta": delta, "finish_reason": finish,
                             "logprobs": {"content": logprobs} if self._logprobs and logprobs is not None else None}]}

    def _take(self, chunk: dict) -> list[dict]:
        """The client's chunks for one engine chunk."""
        self.id = self.id or chunk.get("id") or f"chatcmpl-{uuid.uuid4().hex}"
        if chunk.get("prompt_token_ids") is not None and self._prompt_ids is None:
            self._prompt_ids = list(chunk["prompt_token_ids"])
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        out: list[dict] = []
        for engine_choice in chunk.get("choices") or []:
            index = engine_choice.get("index", 0)
            choice = self._choices.get(index)
            if choice is None:
                choice = self._choices[index] = Choice(HeldText(self._call_start))
                out.append(self._chunk(index, {"role": "assistant", "content": ""}))
            if choice.engine_finish is not None:
                continue
            choice.token_ids += engine_choice.get("token_ids") or []
            entries = (engine_choice.get("logprobs") or {}).get("content") or []
            choice.logprobs += entries
            choice.unsent += entries
            text = choice.held.feed((engine_choice.get("delta") or {}).get("content") or "")
            if text:
                out.append(self._chunk(index, {"content": text}, logprobs=_take_all(choice.unsent)))
            if engine_choice.get("finish_reason") is not None:
                out += self._end_choice(index, choice, engine_choice["finish_reason"])
        return out

    def _end_choice(self, index: int, choice: Choice, finish: str) -> list[dict]:
        """The rest of a finished choice: content still held, its calls, its finish."""
        parsed = self._format.parse(choice.held.text, self._offered)
        message: dict = {"role": "assistant", "content": parsed.content}
        out = []
        rest = choice.held.rest((parsed.content or "") if parsed.tool_calls else choice.held.text)
        if rest:
            out.append(self._chunk(index, {"content": rest}, logprobs=_take_all(choice.unsent)))
        if parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
            calls = [{"index": i, **call} for i, call in enumerate(parsed.tool_calls)]
            out.append(self._chunk(index, {"tool_calls": calls}, logprobs=_take_all(choice.unsent)))
        choice.message, choice.engine_finish, choice.ended_ns = message, finish, time.time_ns()
        choice.finish = "tool_calls" if parsed.tool_calls else finish
        out.append(self._chunk(index, {}, choice.finish, logprobs=_take_all(choice.unsent) or None))
        return out

    def _finish(self, stopped: str | None) -> list[dict]:
        """Record every choice, make the whole answer; the usage chunk when the client asked for it. `stopped`:
        why the stream ended early (the finish reason of the choices still open), None when it ended whole."""
        if self.completion is not None:
            return []
        now = time.time_ns()
        choices = []
        for index in sorted(self._choices):
            choice = self._choices[index]
            if choice.engine_finish is None:  # cut short: what was generated, as it was generated
                choice.engine_finish = choice.finish = stopped or FAILED
                choice.message, choice.ended_ns = {"role": "assistant", "content": choice.held.text}, now
            if self._prompt_ids is not None:
                self._record(index, self._prompt_ids, choice.token_ids, [t.get("logprob") for t in choice.logprobs],
                             self._started_ns, choice.ended_ns, choice.engine_finish)
            choices.append({"index": index, "message": choice.message, "finish_reason": choice.finish,
                            "logprobs": {"content": choice.logprobs} if self._logprobs else None})
        completion_tokens = sum(len(c.token_ids) for c in self._choices.values())
        prompt_tokens = len(self._prompt_ids or [])
        usage = {k: (self._usage or {}).get(k, v) for k, v in (
            ("prompt_tokens", prompt_tokens), ("completion_tokens", completion_tokens),
            ("total_tokens", prompt_tokens + completion_tokens))}
        self.completion = {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                           "choices": choices, "usage": usage}
        if stopped is None and self._include_usage:
            return [{"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                     "choices": [], "usage": usage}]
        return []


def _take_all(items: list) -> list:
    taken = list(items)
    items.clear()
    return taken


class FinishedStream:
    """A whole chat completion replayed as stream chunks: role, content token by token (when the engine's
    token pieces rebuild it exactly), tool calls in one chunk, finish; usage when asked."""

    def __init__(self, response: dict, include_usage: bool):
        self._pieces = response.pop("_token_pieces", None) or [[] for _ in response["choices"]]
        self.completion: dict | None = response
        self.model = response["model"]
        self._include_usage = include_usage

    def close(self) -> None:
        pass

    def __iter__(self) -> Iterator[list[dict]]:
        response = self.completion
        base = {"id": response["id"], "object": "chat.completion.chunk", "created": response["created"],
                "model": response["model"]}

        def chunk(index: int, delta: dict, finish: str | None = None) -> list[dict]:
            return [{**base, "choices": [{"index": index, "delta": delta, "finish_reason": finish}]}]

        for choice, pieces in zip(response["choices"], self._pieces):
            index, message = choice["index"], choice["message"]
            yield chunk(index, {"role": "assistant", "content": ""})
            content = message.get("content") or ""
            if message.get("tool_calls"):
                if content:
                    yield chunk(index, {"content": content})
                calls = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
                yield chunk(index, {"tool_calls": calls})
            else:
                for part in (pieces if "".join(pieces) == content else [content]):
                    if part:
                        yield chunk(index, {"content": part})
            yield chunk(index, {}, choice["finish_reason"])
        if self._include_usage:
            yield [{**base, "choices": [], "usage": response["usage"]}]
