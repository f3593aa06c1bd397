"""OpenAI Responses API requests name their LLM span in a W3C `traceparent` header, as chat requests do.

Traceloop's OpenAI instrumentation injects `traceparent` into chat completion requests, so the gateway's token
record is a child of the request's LLM span; it injects none into Responses requests, whose `openai.response`
span it only starts once the answer is back. The LLM span current while such a request is sent is a
framework's (the Agents SDK's `openai.response`, from opentelemetry-instrumentation-openai-agents): this names
it. With no LLM span current nothing is added; the gateway's record then joins the client's spans through the
response id (span_store migration 0006, rule 2). A header the caller set is kept.

Installed by the distro (`install()`), applied when `openai.resources.responses` is first imported; light: no
import of openai here.
"""
from __future__ import annotations

import logging

from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from lightning_otel.capture.hooks import wrap_when_imported

log = logging.getLogger(__name__)
MODULE = "openai.resources.responses"
METHODS = ("Responses.create", "Responses.stream", "Responses.parse", "AsyncResponses.create",
           "AsyncResponses.stream", "AsyncResponses.parse")
LLM_OPERATIONS = ("chat", "text_completion", "completion", "generate_content")  # the store's is_llm_call


def install() -> None:
    """Wrap the Responses methods once openai imports them (now, if it already has)."""
    wrap_when_imported(MODULE, METHODS, _with_traceparent)


def _with_traceparent(wrapped, instance, args, kwargs):
    # A sync wrapper serves the async methods too: the header is set when the call is made, in its context.
    try:
        headers = llm_span_headers()
        if headers:
            kwargs["extra_headers"] = {**headers, **(kwargs.get("extra_headers") or {})}
    except Exception:  # noqa: BLE001 - tracing must never break the agent's call
        log.debug("could not add traceparent to a Responses request", exc_info=True)
    return wrapped(*args, **kwargs)


def llm_span_headers() -> dict[str, str]:
    """{"traceparent": ...} naming the current span when it is an LLM call span, else {}."""
    span = trace.get_current_span()
    attributes = getattr(span, "attributes", None) or {}
    if not span.get_span_context().is_valid or attributes.get("gen_ai.operation.name") not in LLM_OPERATIONS:
        return {}
    headers: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(headers)
    return headers
