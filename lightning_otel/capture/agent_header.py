"""Each LLM request names the agent that makes it, in an `x-lightning-agent` header, derived from the agent
process's live span tree at the moment the request is sent.

The store names a call's agent after the fact, from the spans above it (the nearest agent, task or graph node
span: `agent_name`, the one definition in Python; span_store/otlp.py and migration 0006 use the same rule). The
gateway sees a request before any of those spans is exported (a span is exported when it ends), so it cannot
look them up; the agent process has them all, open. `LiveSpans` (a span processor the distro installs) keeps
the open spans of the process; when the OpenAI client builds a request, the span its `traceparent` names (the
LLM span, else the current span) is walked up through them to the nearest agent/task/node, whose name goes in
the header (percent-encoded: names may hold any text). The gateway routes by it (one adapter per agent:
serve/adapters.py). No agent above the call: no
header. A header the caller set is kept.

Installed by the distro (`install()`): the wrap applies when `openai._base_client` is first imported; light: no
import of openai here.
"""
from __future__ import annotations

import logging
import os
import re
import threading
from typing import Any
from urllib.parse import quote

from opentelemetry import context, trace
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor

from lightning_otel.capture.hooks import wrap_when_imported

log = logging.getLogger(__name__)
HEADER = "x-lightning-agent"
OFF_ENV = "LIGHTNING_OTEL_AGENT_HEADER"  # "0" / "false": send no agent header (e.g. to a third-party endpoint)
MODULE = "openai._base_client"
METHODS = ("SyncAPIClient._build_request", "AsyncAPIClient._build_request")
_LLM_OR_TOOL_OPS = ("chat", "text_completion", "generate_content", "execute_tool")
_AGENT_OPS = ("invoke_agent", "create_agent", "execute_task")
_AGENT_NAME_PREFIX = re.compile(r"(invoke.agent|execute.task) ", re.DOTALL)  # SQL LIKE: '_' is any character
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}")


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def agent_name(name: str, operation: str | None, attrs: Any) -> str | None:
    """The agent, task or graph node a span stands for (None: none), from its name, gen_ai operation and
    attributes: the store's agent_name_of (migration 0003/0006), which the C decoder mirrors."""
    agent, kind = _text(attrs.get("gen_ai.agent.name")), _text(attrs.get("traceloop.span.kind"))
    if agent is not None and operation not in _LLM_OR_TOOL_OPS:
        return agent
    if kind in ("agent", "task"):
        for value in (agent, _text(attrs.get("crewai.agent.role")), _text(attrs.get("traceloop.entity.name")),
                      _text(attrs.get("gen_ai.task.name"))):
            if value is not None:
                return value
        return re.sub(r"\.(agent|task)\Z", "", name, count=1)
    if operation in _AGENT_OPS or _AGENT_NAME_PREFIX.match(name):
        for value in (agent, _text(attrs.get("gen_ai.task.name")), _text(attrs.get("traceloop.entity.name"))):
            if value is not None:
                return value
        return re.sub(r"^(invoke_agent|execute_task|create_agent) ", "", name, count=1)
    return None


def _operation(attrs: Any) -> str | None:
    return _text(attrs.get("gen_ai.operation.name", attrs.get("llm.request.type")))


class LiveSpans(SpanProcessor):
    """The process's open spans by (trace id, span id), so a request can name its agent before they end."""

    current: "LiveSpans | None" = None  # the one the distro installed

    def __init__(self) -> None:
        self._spans: dict[tuple[int, int], Any] = {}
        self._lock = threading.Lock()
        LiveSpans.current = self

    def on_start(self, span, parent_context: context.Context | None = None) -> None:
        ctx = span.get_span_context()
        with self._lock:
            self._spans[(ctx.trace_id, ctx.span_id)] = span

    def on_end(self, span: ReadableSpan) -> None:
        ctx = span.get_span_context()
        with self._lock:
            self._spans.pop((ctx.trace_id, ctx.span_id), None)

    def shutdown(self) -> None:
        with self._lock:
            self._spans.clear()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

    def agent_of(self, trace_id: int, span_id: int) -> str | None:
        """The nearest agent/task/node at or above the open span (trace_id, span_id); None when there is none
        (or the span is not open in this process)."""
        with self._lock:
            spans = dict(self._spans)
        seen = 0
        span = spans.get((trace_id, span_id))
        while span is not None and seen < 64:
            found = agent_name(span.name, _operation(span.attributes or {}), span.attributes or {})
            if found is not None:
                return found
            parent = span.parent
            span = spans.get((parent.trace_id, parent.span_id)) if parent is not None else None
            seen += 1
        return None


def request_agent(headers: Any) -> str | None:
    """The agent of a request about to be sent: from the span its traceparent header names, else the current
    span; None without a LiveSpans installed or an agent above."""
    live = LiveSpans.current
    if live is None:
        return None
    found = _TRACEPARENT.fullmatch(str((headers or {}).get("traceparent") or "").strip())
    if found:
        return live.agent_of(int(found.group(1), 16), int(found.group(2), 16))
    ctx = trace.get_current_span().get_span_context()
    return live.agent_of(ctx.trace_id, ctx.span_id) if ctx.is_valid else None


def install() -> None:
    """Wrap the OpenAI client's request building once openai imports it (now, if it already has)."""
    if os.environ.get(OFF_ENV, "").strip().lower() in ("0", "false", "no", "off"):
        return
    wrap_when_imported(MODULE, METHODS, _with_agent)


def _with_agent(wrapped, instance, args, kwargs):
    # Request options carry the headers the caller and the instrumentations set (traceparent among them).
    options = args[0] if args else kwargs.get("options")
    try:
        headers = getattr(options, "headers", None)
        headers = dict(headers) if headers else {}
        if HEADER not in {str(k).lower() for k in headers}:
            agent = request_agent({str(k).lower(): v for k, v in headers.items()})
            if agent is not None:
                options.headers = {**headers, HEADER: quote(agent, safe="")}  # any text, as ASCII
    except Exception:  # noqa: BLE001 - naming the agent must never break the agent's call
        log.debug("could not add the agent header to a request", exc_info=True)
    return wrapped(*args, **kwargs)


__all__ = ["HEADER", "LiveSpans", "agent_name", "install", "request_agent"]
