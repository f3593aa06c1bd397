"""Human feedback as rewards: a person's score for a rollout, or for one span of it, with a name, a value, a
comment and an author, stored as a row of `rewards` with source 'human' (migration 0008).

It reaches training like any other reward of its name: a score for the rollout (no span, or its root or
`lightning.rollout` span) is an episode reward and outranks a computed one of the same name (`episode_rewards`);
a score on an inner span is a reward on that span, which the compiler's `--intermediate NAME` credits to the
transitions of its scope. Written through the collector's admin route POST /v1/feedback (client.write_feedback),
or into the file when no collector holds it. Every check runs before the one INSERT, so a refused score writes
nothing.
"""
from __future__ import annotations

import math
import re
import time
from dataclasses import asdict, dataclass
from typing import Any

import duckdb

from lightning_otel.errors import UserError

SOURCE = "human"
MAX_NAME = 200
MAX_TEXT = 10_000
SPAN_ID = re.compile(r"[0-9a-fA-F]{16}")
FIELDS = ("rollout_id", "span_id", "name", "value", "comment", "author")
SQL_ROLLOUT_KNOWN = """
SELECT EXISTS (SELECT 1 FROM rollout_runs WHERE rollout_id = $rollout)
    OR EXISTS (SELECT 1 FROM spans WHERE rollout_id = $rollout)
"""
# The span, where its own rollout id or another span of its trace says it belongs to the rollout.
SQL_SPAN_OWNER = """
SELECT s.trace_id, s.rollout_id,
       EXISTS (SELECT 1 FROM spans o WHERE o.trace_id = s.trace_id AND o.rollout_id = $rollout) AS in_trace
FROM spans s WHERE s.span_id = $span
"""
SQL_INSERT = """
INSERT INTO rewards (rollout_id, trace_id, span_id, name, value, source, created_ns, author, comment)
VALUES ($rollout_id, $trace_id, $span_id, $name, $value, $source, $created_ns, $author, $comment)
"""


@dataclass(frozen=True)
class Feedback:
    rollout_id: str
    name: str
    value: float
    span_id: str | None = None  # None: the score is about the whole rollout
    comment: str | None = None
    author: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rollout_id, str) or not self.rollout_id.strip():
            raise UserError("feedback needs a rollout id (rollout_id; `SELECT rollout_id FROM rollouts` lists them)")
        if not isinstance(self.name, str) or not self.name.strip():
            raise UserError("feedback needs a name: the reward name the score is stored under, e.g. helpful or "
                            "the name of the reward function it corrects")
        if len(self.name) > MAX_NAME or any(ord(c) < 32 for c in self.name):
            raise UserError(f"feedback name {self.name[:40]!r}: at most {MAX_NAME} characters, no control characters")
        object.__setattr__(self, "name", self.name.strip())
        object.__setattr__(self, "value", _number(self.value))
        if self.span_id is not None:
            if not isinstance(self.span_id, str) or not SPAN_ID.fullmatch(self.span_id):
                raise UserError(f"feedback span id {self.span_id!r} is not a span id (16 hex digits, as in "
                                f"spans.span_id); leave it out to score the whole rollout")
            object.__setattr__(self, "span_id", self.span_id.lower())
        for what in ("comment", "author"):
            text = getattr(self, what)
            if text is not None and (not isinstance(text, str) or len(text) > MAX_TEXT):
                raise UserError(f"feedback {what} must be text of at most {MAX_TEXT} characters")

    @classmethod
    def from_json(cls, doc: Any) -> Feedback:
        """From a request body: {"rollout_id", "name", "value", and optionally "span_id", "comment", "author"}."""
        if not isinstance(doc, dict):
            raise UserError('feedback body must be a JSON object: {"rollout_id": ..., "name": ..., "value": ...}')
        unknown = sorted(set(doc) - set(FIELDS))
        if unknown:
            raise UserError(f"feedback has no field(s) {unknown}; fields: {', '.join(FIELDS)}")
        missing = [key for key in ("rollout_id", "name", "value") if doc.get(key) is None]
        if missing:
            raise UserError(f"feedback needs {', '.join(missing)}")
        return cls(**doc)


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise UserError(f"feedback value {value!r} is not a number: give the score as a number, e.g. 1, 0 or 0.5")
    try:
        number = float(value)
    except ValueError:
        raise UserError(f"feedback value {value!r} is not a number: give the score as a number, e.g. 1, 0 or "
                        f"0.5") from None
    if not math.isfinite(number):
        raise UserError(f"feedback value {value!r} must be a finite number")
    return number


def write_feedback(con: duckdb.DuckDBPyConnection, feedback: Feedback) -> dict[str, Any]:
    """Check the rollout (and span) exist, then store the score as one rewards row; returns that row."""
    con.execute("BEGIN TRANSACTION")
    try:
        row = _row(con, feedback)
        con.execute(SQL_INSERT, row)
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise
    return row


def _row(con: duckdb.DuckDBPyConnection, feedback: Feedback) -> dict[str, Any]:
    rollout = feedback.rollout_id
    if not con.execute(SQL_ROLLOUT_KNOWN, {"rollout": rollout}).fetchone()[0]:
        raise UserError(f"no rollout {rollout!r} in this store (neither a runner record nor spans): `lightning-otel "
                        f"sql \"SELECT rollout_id, task_id FROM rollouts\"` lists them")
    trace_id = None
    if feedback.span_id is not None:
        owners = con.execute(SQL_SPAN_OWNER, {"rollout": rollout, "span": feedback.span_id}).fetchall()
        mine = [trace for trace, owner, in_trace in owners if owner == rollout or (owner is None and in_trace)]
        if not mine:
            elsewhere = sorted({str(owner) for _, owner, _ in owners})
            raise UserError(f"span {feedback.span_id} is not a span of rollout {rollout!r}"
                            + (f" (it belongs to {', '.join(elsewhere)})" if elsewhere else " (no such span)")
                            + "; leave --span out to score the whole rollout")
        trace_id = mine[0]
    return {**asdict(feedback), "trace_id": trace_id, "source": SOURCE, "created_ns": time.time_ns()}
