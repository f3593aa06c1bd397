"""GEPA's view of the agent: `GatewayAdapter` evaluates candidates by real rollouts (evaluation.py) and builds the
reflective dataset from what the store recorded of them.

`evaluate(batch, candidate, capture_traces)` runs (or reads back) the rollouts of the batch's tasks under the
candidate's patch; each task's score is its mean reward. Its trajectory names the rollouts, and
`make_reflective_dataset` reads their calls back from the run's store: for each component to update, the calls
that sent that component's system message (the store keeps the messages the agent sent, before the gateway
patched them; the candidate's own text is what the reflection sees as the current instruction), each as the
conversation the call was given (user turns, tool calls and results), the answer it produced, and feedback: the
rollout's reward, its final output, how it ended and its errors. Records are cut to a size a small reflection
model can take.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable

from gepa.core.adapter import EvaluationBatch

from lightning_otel.rollouts.runner import Task
from lightning_otel.serve.prompt_export import recorded_system
from lightning_otel.train.apo.candidates import DEMOS, Component, component_of
from lightning_otel.train.apo.evaluation import Evaluator, TaskResult

log = logging.getLogger(__name__)

TEXT_CHARS = 600      # each text of a record, at most
CALLS_PER_TASK = 2    # calls of one component shown per task
SQL_ROLLOUT_CALLS = """
SELECT rollout_id, turn, system_instructions, json_extract(input_messages, '$[0]')::VARCHAR AS first_message,
       input_messages, output_messages, status_code, status_message
FROM llm_calls WHERE rollout_id IN ({ids}) ORDER BY rollout_id, turn
"""


def cut(text: str | None, chars: int = TEXT_CHARS) -> str:
    text = (text or "").strip()
    return text if len(text) <= chars else text[: chars - 15] + " ...[cut]... "


def part_text(part: dict) -> str:
    kind = part.get("type")
    if kind == "text":
        return str(part.get("content") or "")
    if kind == "tool_call":
        arguments = part.get("arguments")
        arguments = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return f"[calls tool {part.get('name')}({arguments})]"
    if kind == "tool_call_response":
        response = part.get("response")
        return f"[tool result: {response if isinstance(response, str) else json.dumps(response)}]"
    return ""


def message_text(message: dict) -> str:
    """A stored message (the GenAI parts schema, or OpenAI's content) as text."""
    parts = message.get("parts")
    if isinstance(parts, list):
        return "\n".join(t for t in (part_text(p) for p in parts if isinstance(p, dict)) if t)
    content = message.get("content")
    return content if isinstance(content, str) else json.dumps(content, ensure_ascii=False) if content else ""


def stored_messages(raw: str | None) -> list[dict]:
    try:
        value = json.loads(raw) if raw else []
    except json.JSONDecodeError:
        return []
    return [m for m in value if isinstance(m, dict)] if isinstance(value, list) else []


def conversation(input_messages: str | None) -> list[dict]:
    """The messages a call was given after its system message(s)."""
    return [m for m in stored_messages(input_messages) if m.get("role") not in ("system", "developer")]


def answer_text(output_messages: str | None) -> str:
    return "\n".join(message_text(m) for m in stored_messages(output_messages))


def read_calls(db: Path, rollout_ids: list[str]) -> list[dict]:
    """The stored LLM calls of these rollouts, in order, each with `system` (the text the agent sent)."""
    from lightning_otel.span_store import client

    if not rollout_ids:
        return []
    ids = ", ".join(client.sql_literal(i) for i in sorted(set(rollout_ids)))
    rows = client.query(SQL_ROLLOUT_CALLS.format(ids=ids), db).to_dicts()
    for row in rows:
        row["system"] = recorded_system(row.pop("system_instructions"), row.pop("first_message"))
    return rows


def feedback(result: TaskResult, index: int) -> str:
    reward = result.rewards[index] if index < len(result.rewards) else None
    lines = [f"Reward: {'none (counted as 0)' if reward is None else f'{reward:g}'} (1 is best). "
             f"The rollout ended {result.statuses[index] if index < len(result.statuses) else 'unknown'}.",
             f"The agent's final output: {cut(result.outputs[index] if index < len(result.outputs) else None, 300)}"]
    if result.errors:
        lines.append(f"Errors: {cut(' | '.join(result.errors), 300)}")
    return "\n".join(lines)


class GatewayAdapter:
    """gepa's GEPAAdapter protocol over real rollouts (module docstring). `batch` items are tasks."""

    propose_new_texts = None  # gepa's reflective proposer, with our reflection model

    def __init__(self, evaluator: Evaluator, calls_of: Callable[[list[str]], list[dict]],
                 val_ids: set[str] = frozenset()):
        self.evaluator, self.calls_of, self.val_ids = evaluator, calls_of, val_ids

    @property
    def components(self) -> list[Component]:
        return self.evaluator.components

    def evaluate(self, batch: list[Task], candidate: dict[str, str], capture_traces: bool = False) -> EvaluationBatch:
        split = "validation" if {t.task_id for t in batch} <= self.val_ids else "train minibatch"
        results = self.evaluator.evaluate(candidate, batch, f"reflection: {split}")
        outputs = [{"task_id": r.task_id, "outputs": r.outputs, "statuses": r.statuses} for r in results]
        trajectories = None
        if capture_traces:
            trajectories = [{"task": t.fields, "result": r} for t, r in zip(batch, results)]
        return EvaluationBatch(outputs=outputs, scores=[r.score for r in results], trajectories=trajectories)

    def make_reflective_dataset(self, candidate: dict[str, str], eval_batch: EvaluationBatch,
                                components_to_update: list[str]) -> dict[str, list[dict[str, Any]]]:
        trajectories = eval_batch.trajectories or []
        calls = self.calls_of([i for t in trajectories for i in t["result"].rollout_ids])
        by_rollout: dict[str, list[dict]] = {}
        for call in calls:
            by_rollout.setdefault(call["rollout_id"], []).append(call)
        known = {c.name: c for c in self.components}
        dataset: dict[str, list[dict[str, Any]]] = {}
        for name in components_to_update:
            component = known[name.removesuffix(DEMOS)]
            records = []
            for trajectory in trajectories:
                result: TaskResult = trajectory["result"]
                for index, rollout_id in enumerate(result.rollout_ids):
                    mine = [c for c in by_rollout.get(rollout_id, [])
                            if component_of(self.components, c["system"]) is component]
                    for call in mine[:CALLS_PER_TASK]:
                        records.append({
                            "Inputs": {"task": cut(json.dumps(trajectory["task"], ensure_ascii=False), 300),
                                       "conversation": cut("\n".join(f"{m.get('role')}: {message_text(m)}"
                                                                     for m in conversation(call["input_messages"])))},
                            "Generated Outputs": cut(answer_text(call["output_messages"])
                                                     or f"(no answer: {call['status_message'] or 'the call failed'})"),
                            "Feedback": feedback(result, index),
                        })
            if not records:
                log.info("no stored call sent the system message of %s in this batch's rollouts", name)
            dataset[name] = records
        return dataset


__all__ = ["GatewayAdapter", "read_calls", "conversation", "answer_text", "message_text"]
