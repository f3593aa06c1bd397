"""A store of scored rollouts made the way real runs make them: spans from the real OTel SDK over OTLP/HTTP to a
collector (the gateway's lightning.generate token records among them), runner records and computed rewards through
the collector's admin route."""
from __future__ import annotations

from pathlib import Path

from opentelemetry import trace
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from lightning_otel.span_store import client
from tests.helpers.sdk import tracer_provider


def store_rollouts(url: str, db: Path, rollouts: dict[str, tuple[str, float | None, int]],
                   policy_version: int = 3, reward_name: str = "exec", token: str | None = None) -> None:
    """rollouts: id -> (task id, reward or None, LLM calls). Each LLM call has a token record, an event and a link;
    the first fails with an error status; the rollout span carries a W3C tracestate."""
    provider = tracer_provider(url, resource={"service.name": "scored-agent", "deployment.replicas": 2,
                                              "host.arch": ["x86_64", "arm64"]}, token=token)
    tracer = provider.get_tracer("agent", "1.2.3")
    linked = SpanContext(trace_id=0xABC, span_id=0xDEF, is_remote=True, trace_flags=TraceFlags(1),
                         trace_state=TraceState([("vendor", "x1")]))
    for rollout_id, (task, reward, calls) in rollouts.items():
        ids = {"lightning.rollout.id": rollout_id, "lightning.task.id": task}
        parent = trace.set_span_in_context(trace.NonRecordingSpan(SpanContext(
            trace_id=int.from_bytes(rollout_id.encode().ljust(16, b"x")[:16], "big"), span_id=0x1234, is_remote=True,
            trace_flags=TraceFlags(1), trace_state=TraceState([("congo", "t61rcWkgMzE")]))))
        with tracer.start_as_current_span("lightning.rollout", context=parent, attributes=ids):
            for turn in range(calls):
                with tracer.start_as_current_span("invoke_agent solver", attributes={
                        **ids, "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "solver"}):
                    with tracer.start_as_current_span("openai.chat", kind=SpanKind.CLIENT, links=[
                            Link(linked, {"link.reason": "retry", "link.try": turn})], attributes={
                            **ids, "gen_ai.operation.name": "chat", "gen_ai.request.temperature": 0.5,
                            "gen_ai.usage.input_tokens": 12, "gen_ai.response.finish_reasons": ["stop"],
                            "llm.is_streaming": False, "gen_ai.request.top_p": 1.0}) as span:
                        span.add_event("gen_ai.choice", {"index": turn, "finish": "stop", "scores": [0.25, 1.0]})
                        if turn == 0:
                            span.set_status(Status(StatusCode.ERROR, "rate limited once"))
                        with tracer.start_as_current_span("lightning.generate", attributes={
                                **ids, "lightning.choice.index": 0, "lightning.policy.version": policy_version,
                                "lightning.prompt.token_ids": [1, 2, 3 + turn],
                                "lightning.completion.token_ids": [10 + turn, 11],
                                "lightning.completion.logprobs": [-0.5, -0.25]}):
                            pass
        client.write_records(db, "rollout_runs", [{"rollout_id": rollout_id, "task_id": task, "attempt": 0,
                                                   "policy_version": policy_version, "status": "ok"}])
        if reward is not None:
            client.write_records(db, "rewards", [{"rollout_id": rollout_id, "name": reward_name, "value": reward,
                                                  "source": "function"}])
    provider.shutdown()
