"""Real OpenTelemetry SDK pipelines pointed at a collector (no in-memory exporters)."""
from __future__ import annotations

from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind


def tracer_provider(url: str, resource: dict | None = None, token: str | None = None, gzip: bool = False,
                    max_batch: int = 512, timeout: float = 30.0, **processor_kw) -> TracerProvider:
    headers = {"Authorization": f"Bearer {token}"} if token else None
    exporter = OTLPSpanExporter(endpoint=f"{url}/v1/traces", headers=headers, timeout=timeout,
                                compression=Compression.Gzip if gzip else Compression.NoCompression)
    provider = TracerProvider(resource=Resource.create(resource or {"service.name": "test-agent"}))
    provider.add_span_processor(BatchSpanProcessor(exporter, max_export_batch_size=max_batch, **processor_kw))
    return provider


def logger_provider(url: str, resource: dict | None = None) -> LoggerProvider:
    provider = LoggerProvider(resource=Resource.create(resource or {"service.name": "test-agent"}))
    provider.add_log_record_processor(BatchLogRecordProcessor(OTLPLogExporter(endpoint=f"{url}/v1/logs")))
    return provider


def chat_span(tracer, rollout_id: str = "ro-1", tokens: int = 10, question: str = "How many singers?"):
    """One span shaped like Traceloop's openai.chat span."""
    with tracer.start_as_current_span("openai.chat", kind=SpanKind.CLIENT) as span:
        span.set_attributes({
            "gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai",
            "gen_ai.request.model": "gpt-4o", "gen_ai.response.model": "smollm2",
            "gen_ai.usage.input_tokens": tokens, "gen_ai.usage.output_tokens": tokens // 2,
            "gen_ai.input.messages": f'[{{"role": "user", "parts": [{{"type": "text", "content": "{question}"}}]}}]',
            "lightning.rollout.id": rollout_id,
        })
        return span
