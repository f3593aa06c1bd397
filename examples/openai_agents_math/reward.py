"""Rewards for the calculator agent, read from the rollout's final output and its OpenTelemetry spans.

    --reward number_match                                 # 1 for the right number, else 0 (registered)
    --reward examples/openai_agents_math/reward.py:shaped  # partial credit on the way there

`shaped`: 1.0 for the right final number; 0.6 when the calculator returned the right number and the reply
did not say it; for an expression the calculator could evaluate (a wrong one), 0.1 plus up to 0.3 for the
share of the question's numbers it used; 0.0 otherwise. The tool's arguments and result come from the tool
spans the Agents SDK instrumentation records (gen_ai.tool.call.arguments / .result, read by
lightning_otel.rollouts.trace_view), so the agent is not changed to report them.
"""
from __future__ import annotations

import json
from collections import Counter

from lightning_otel.rollouts import trace_view
from lightning_otel.tasks.math import NUMBER, last_number, number_match


def tool_calls(rollout: dict) -> list[tuple[str, str]]:
    """(arguments, result) of the rollout's tool calls as text, in order, from its spans."""
    calls = []
    for call in trace_view.tool_calls(rollout):
        text = json.dumps(call.arguments) if isinstance(call.arguments, dict) else (call.arguments or "")
        calls.append((text, call.result or ""))
    return calls


def numbers_used(question: str, arguments: str) -> float:
    """Share of the question's numbers (with repeats) that the tool call's arguments contain."""
    asked = Counter(NUMBER.findall(question))
    if not asked:
        return 0.0
    given = Counter(NUMBER.findall(arguments))
    return sum((asked & given).values()) / sum(asked.values())


def shaped(task: dict, rollout: dict) -> float | None:
    exact = number_match(task, rollout)
    if exact is None or exact == 1.0:
        return exact
    evaluated = [(arguments, result) for arguments, result in tool_calls(rollout)
                 if result and not result.startswith("error") and last_number(result) is not None]
    if any(number_match(task, {"final_output": result}) == 1.0 for _, result in evaluated):
        return 0.6
    if not evaluated:
        return 0.0
    return 0.1 + 0.3 * max(numbers_used(task.get("question") or "", arguments) for arguments, _ in evaluated)
