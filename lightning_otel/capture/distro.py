"""Our OpenTelemetry distro: what `opentelemetry-instrument python agent.py` does once this package is installed.

Registered through the `opentelemetry_distro`, `opentelemetry_configurator`, `opentelemetry_traces_exporter`
and `opentelemetry_post_instrument` entry points. It fixes the stock distro's defaults (gRPC, metrics and
logs exporters on), sends traces over OTLP/HTTP protobuf to the lightning-otel collector
(`LIGHTNING_OTEL_ENDPOINT`, default http://127.0.0.1:4318) besides any exporter the user configured,
captures message content, copies `lightning.*` baggage onto spans, redacts content by pattern before
anything leaves the process, makes OpenAI Responses API requests carry the traceparent (responses_context.py),
names the agent of every OpenAI request in an `x-lightning-agent` header (agent_header.py),
and says on stderr when an installed instrumentor failed to load.
`LIGHTNING_OTEL_INSTRUMENTATIONS=openai` (comma-separated entry-point names) loads only those
instrumentations: the stock loader imports every installed one and the library it instruments, seconds per
process for LangChain and CrewAI, which an agent on the plain SDK does not need.

Every setting is an environment default: a variable the user set is never overwritten.
This module is imported into agent processes: it must stay light (no duckdb, polars or torch).
"""
from __future__ import annotations

import json
import logging
import os
import re
import sys
from typing import Mapping, MutableMapping, Sequence

from opentelemetry import baggage, context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.instrumentation.distro import BaseDistro
from opentelemetry.sdk._configuration import _OTelSDKConfigurator
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from lightning_otel.capture import agent_header, responses_context

ENDPOINT_ENV = "LIGHTNING_OTEL_ENDPOINT"
TOKEN_ENV = "LIGHTNING_OTEL_TOKEN"
REDACT_ENV = "LIGHTNING_OTEL_REDACT"
ONLY_ENV = "LIGHTNING_OTEL_INSTRUMENTATIONS"
DISABLED_ENV = "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS"
DEFAULT_ENDPOINT = "http://127.0.0.1:4318"
EXPORTER_NAME = "lightning"
REDACTED = "[REDACTED]"
BAGGAGE_PREFIX = "lightning."

# Defaults the stock distro gets wrong or that agents need for RL; each only when unset.
ENV_DEFAULTS = {
    "OTEL_METRICS_EXPORTER": "none",
    "OTEL_LOGS_EXPORTER": "none",
    "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
    "TRACELOOP_TRACE_CONTENT": "true",
    "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "span_only",
    "AUTOGEN_DISABLE_RUNTIME_TRACING": "true",
    "CREWAI_DISABLE_TELEMETRY": "true",
    "CREWAI_DISABLE_TRACKING": "true",
    "CREWAI_TRACING_ENABLED": "false",
    "ENABLE_SENSITIVE_DATA": "true",  # Microsoft Agent Framework: message content on its own spans
}


def apply_env_defaults(env: MutableMapping[str, str]) -> None:
    """Set our defaults in env without overwriting what the user set.

    Traces always go to our collector: when the user configured exporters of their own
    (OTEL_TRACES_EXPORTER=otlp for their backend, say), ours is added beside them.
    """
    for key, value in ENV_DEFAULTS.items():
        env.setdefault(key, value)
    names = [n.strip() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    if "none" in names:
        names.remove("none")
    if EXPORTER_NAME not in names:
        names.append(EXPORTER_NAME)
    env["OTEL_TRACES_EXPORTER"] = ",".join(names)
    only = [n.strip() for n in env.get(ONLY_ENV, "").split(",") if n.strip()]
    if only and not env.get(DISABLED_ENV):
        env[DISABLED_ENV] = ",".join(sorted(set(installed_instrumentations()) - set(only)))


def installed_instrumentations() -> list[str]:
    """Entry-point names of the installed OpenTelemetry instrumentors (what opentelemetry-instrument loads)."""
    from importlib.metadata import entry_points

    return [entry_point.name for entry_point in entry_points(group="opentelemetry_instrumentor")]


def redaction_patterns(env: Mapping[str, str]) -> list[re.Pattern[str]]:
    """LIGHTNING_OTEL_REDACT: one regular expression, or a JSON list of them."""
    raw = env.get(REDACT_ENV, "").strip()
    if not raw:
        return []
    try:
        patterns = json.loads(raw) if raw.startswith("[") else [raw]
        return [re.compile(p) for p in patterns]
    except (ValueError, re.error, TypeError) as exc:
        raise ValueError(f"{REDACT_ENV}={raw!r} is not a regular expression or a JSON list of them: {exc}") from None


def _redact_value(value, patterns: Sequence[re.Pattern[str]]):
    if isinstance(value, str):
        for pattern in patterns:
            value = pattern.sub(REDACTED, value)
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(_redact_value(v, patterns) for v in value)
    return value


def redact_attributes(attributes: Mapping | None, patterns: Sequence[re.Pattern[str]]) -> dict:
    return {k: _redact_value(v, patterns) for k, v in (attributes or {}).items()}


class RedactingExporter(SpanExporter):
    """Rewrites every string attribute (span and event) through the patterns before the wrapped exporter
    sends anything, so redacted content never leaves the process, whichever backend receives it."""

    def __init__(self, inner: SpanExporter, patterns: Sequence[re.Pattern[str]]):
        self.inner = inner
        self.patterns = list(patterns)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return self.inner.export([self._redact(span) for span in spans])

    def _redact(self, span: ReadableSpan) -> ReadableSpan:
        from opentelemetry.sdk.trace import Event
        events = [Event(e.name, redact_attributes(e.attributes, self.patterns), e.timestamp) for e in span.events]
        return ReadableSpan(
            name=span.name, context=span.context, parent=span.parent, resource=span.resource,
            attributes=redact_attributes(span.attributes, self.patterns), events=events, links=span.links,
            kind=span.kind, status=span.status, start_time=span.start_time, end_time=span.end_time,
            instrumentation_scope=span.instrumentation_scope)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class LightningSpanExporter(OTLPSpanExporter):
    """OTLP/HTTP protobuf to the lightning-otel collector (`--traces_exporter lightning`)."""

    def __init__(self, endpoint: str | None = None, token: str | None = None, **kwargs):
        base = (endpoint or os.environ.get(ENDPOINT_ENV) or DEFAULT_ENDPOINT).rstrip("/")
        token = token or os.environ.get(TOKEN_ENV)
        headers = {"Authorization": f"Bearer {token}"} if token else None
        super().__init__(endpoint=f"{base}/v1/traces", headers=headers, **kwargs)


class BaggageToAttributes(SpanProcessor):
    """Copies `lightning.*` baggage (rollout id, task id, attempt) onto every span started under it, so
    in-process loops (`with lightning_otel.rollout(...)`) group their spans like separate processes do."""

    def on_start(self, span, parent_context: context.Context | None = None) -> None:
        for key, value in baggage.get_all(parent_context).items():
            if key.startswith(BAGGAGE_PREFIX) and value is not None:
                span.set_attribute(key, int(value) if key == "lightning.attempt" and str(value).isdigit()
                                   else str(value))

    def on_end(self, span: ReadableSpan) -> None:
        return None

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def _export_processor(exporter: SpanExporter) -> SpanProcessor:
    patterns = redaction_patterns(os.environ)
    return BatchSpanProcessor(RedactingExporter(exporter, patterns) if patterns else exporter)


class LightningDistro(BaseDistro):
    def _configure(self, **kwargs) -> None:
        apply_env_defaults(os.environ)
        responses_context.install()  # Responses API requests carry the traceparent, as chat requests do
        agent_header.install()  # every OpenAI request names its agent (x-lightning-agent) from the live spans


class LightningConfigurator(_OTelSDKConfigurator):
    def _configure(self, **kwargs) -> None:
        kwargs.setdefault("span_processors", [BaggageToAttributes(), agent_header.LiveSpans()])
        kwargs.setdefault("export_span_processor", _export_processor)
        super()._configure(**kwargs)


class _FailureLog(logging.Handler):
    """Keeps what instrumentations say about their own failures while they load; most say it at DEBUG."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.levelno >= logging.WARNING or "fail" in text.lower():
            if record.exc_info and record.exc_info[1] is not None:
                text = f"{text}: {type(record.exc_info[1]).__name__}: {record.exc_info[1]}"
            self.messages.append(f"{record.name}: {text}")


_capture: tuple[_FailureLog, int] | None = None


def capture_instrumentation_log() -> None:
    """opentelemetry_pre_instrument hook: start listening to the instrumentations' own log."""
    global _capture
    logger = logging.getLogger("opentelemetry")
    handler = _FailureLog()
    _capture = (handler, logger.level)
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)


def report_failed_instrumentors() -> None:
    """opentelemetry_post_instrument hook: say on stderr which installed instrumentors did not load and
    what the instrumentations logged about failing (OTel itself says most of it only at DEBUG level)."""
    global _capture
    messages: list[str] = []
    if _capture is not None:
        handler, level = _capture
        logger = logging.getLogger("opentelemetry")
        logger.removeHandler(handler)
        logger.setLevel(level)
        messages, _capture = handler.messages, None
    for name, reason in failed_instrumentors():
        print(f"lightning-otel: instrumentor {name!r} is installed but did not load: {reason}", file=sys.stderr)
    for message in dict.fromkeys(messages):
        print(f"lightning-otel: instrumentation reported a failure: {message}", file=sys.stderr)


def failed_instrumentors() -> list[tuple[str, str]]:
    from importlib.metadata import PackageNotFoundError, distribution, entry_points

    from packaging.requirements import InvalidRequirement, Requirement

    disabled = {n.strip() for n in os.environ.get(DISABLED_ENV, "").split(",")}
    failed = []
    for entry_point in entry_points(group="opentelemetry_instrumentor"):
        if entry_point.name in disabled or "*" in disabled:
            continue
        try:
            instrumentor = entry_point.load()()
        except Exception as exc:  # noqa: BLE001 - the point is to report it
            failed.append((entry_point.name, f"{type(exc).__name__}: {exc}"))
            continue
        if getattr(instrumentor, "_is_instrumented_by_opentelemetry", True):
            continue
        targets = []
        for spec in instrumentor.instrumentation_dependencies():
            try:
                targets.append(Requirement(spec))
            except InvalidRequirement:
                continue
        installed = []
        for requirement in targets:
            try:
                installed.append((requirement, distribution(requirement.name).version))
            except PackageNotFoundError:
                continue
        if not installed:
            continue  # the library it instruments is not installed: nothing to report
        wrong = [f"{r.name} {v} does not satisfy '{r}'" for r, v in installed if not r.specifier.contains(v, True)]
        reason = "; ".join(wrong) or _import_error(entry_point.value) or "it raised no error; run with -v " \
            "(OTEL_LOG_LEVEL=debug) for OTel's own log"
        failed.append((entry_point.name, reason))
    return failed


def _import_error(target: str) -> str | None:
    """Why the instrumentor's own imports fail, if they do (e.g. a framework package it needs)."""
    import importlib
    module = target.split(":")[0]
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return None
