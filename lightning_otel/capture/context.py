"""In-process rollouts and rewards: the two calls an agent may make (neither is needed for zero-code capture).

    with lightning_otel.rollout(task_id="spider-dev-12"):
        answer = agent.run(question)
        lightning_otel.emit_reward(1.0 if answer_ok(answer) else 0.0, name="exec_match")

`rollout()` puts the rollout id, task id and attempt in OTel baggage and on a `lightning.rollout` span;
the distro's span processor copies them onto every span started inside, so the store groups them as it
groups the spans of a separate agent process. `emit_reward()` records a `lightning.reward` span under the
current span; the collector turns it into a row of the `rewards` table whose target is that current span.
"""
from __future__ import annotations

import math
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from opentelemetry import baggage, context, trace

ROLLOUT_SPAN = "lightning.rollout"
REWARD_SPAN = "lightning.reward"
ROLLOUT_ID = "lightning.rollout.id"
TASK_ID = "lightning.task.id"
ATTEMPT = "lightning.attempt"
REWARD_NAME = "lightning.reward.name"
REWARD_VALUE = "lightning.reward.value"

_tracer = trace.get_tracer("lightning_otel")


@dataclass(frozen=True)
class Rollout:
    rollout_id: str
    task_id: str | None
    attempt: int | None


def new_rollout_id() -> str:
    return f"ro-{uuid.uuid4().hex[:16]}"


def _ensure_baggage_processor() -> None:
    """When the app set up its own SDK TracerProvider (no opentelemetry-instrument), add our processors (and
    name each OpenAI request's agent, as the distro does)."""
    from lightning_otel.capture import agent_header
    from lightning_otel.capture.distro import BaggageToAttributes
    provider = trace.get_tracer_provider()
    add = getattr(provider, "add_span_processor", None)
    active = getattr(getattr(provider, "_active_span_processor", None), "_span_processors", ())
    if add is not None and not any(isinstance(p, BaggageToAttributes) for p in active):
        add(BaggageToAttributes())
    if add is not None and not any(isinstance(p, agent_header.LiveSpans) for p in active):
        add(agent_header.LiveSpans())
        agent_header.install()


@contextmanager
def rollout(task_id: str | None = None, rollout_id: str | None = None, attempt: int | None = None) -> Iterator[Rollout]:
    """Group every span started inside as one rollout of `task_id`."""
    if attempt is not None and (not isinstance(attempt, int) or attempt < 0):
        raise ValueError(f"attempt must be a non-negative int (the sample index), got {attempt!r}")
    _ensure_baggage_processor()
    current = Rollout(rollout_id or new_rollout_id(), None if task_id is None else str(task_id), attempt)
    ctx = baggage.set_baggage(ROLLOUT_ID, current.rollout_id)
    if current.task_id is not None:
        ctx = baggage.set_baggage(TASK_ID, current.task_id, ctx)
    if attempt is not None:
        ctx = baggage.set_baggage(ATTEMPT, str(attempt), ctx)
    token = context.attach(ctx)
    try:
        with _tracer.start_as_current_span(ROLLOUT_SPAN):
            yield current
    finally:
        context.detach(token)


def emit_reward(value: float, name: str = "reward") -> None:
    """Record a reward about the current span (the episode, when called directly inside `rollout()`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"reward value must be a finite number, got {value!r}")
    if not name:
        raise ValueError("reward name must not be empty")
    with _tracer.start_as_current_span(REWARD_SPAN, attributes={REWARD_NAME: name, REWARD_VALUE: float(value)}):
        pass
