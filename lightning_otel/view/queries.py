"""The viewer's SQL, and the rollouts table's filters read from a page's query string.

The query endpoint takes SQL text without parameters, so values enter as escaped literals (strings) or as
numbers parsed here first; sort columns come from a fixed list. Every statement reads aggregates over indexed
or scanned columns of `spans` (no recursive views), so pages stay fast on a store of a million spans.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from lightning_otel.span_store.client import sql_literal

PAGE_SIZE = 50
MAX_PAGE = 100_000
MAX_TEXT = 500
PLACEHOLDER = re.compile(r"\$([a-z_]+)")
SORTS = ("started_ns", "task_id", "attempt", "policy_version", "status", "reward", "spans", "traces",
         "llm_calls", "error_spans", "duration_s", "rollout_id")

SQL_REWARD_NAMES = "SELECT name, count(*) AS n FROM rewards WHERE span_id IS NULL GROUP BY name ORDER BY n DESC, name"
SQL_STATUSES = """SELECT DISTINCT coalesce(status, '') AS status, coalesce(error_class, '') AS error_class
FROM rollout_runs ORDER BY 1, 2"""
SQL_VERSIONS = "SELECT DISTINCT policy_version FROM rollout_runs WHERE policy_version IS NOT NULL ORDER BY 1"

# One row per rollout: the runner's record joined with its spans' counts and its episode reward of one name.
SQL_ROLLOUTS = """
WITH stats AS (
    SELECT rollout_id, any_value(task_id) AS task_id, any_value(attempt) AS attempt, count(*) AS spans,
           count(DISTINCT trace_id) AS traces,
           count(*) FILTER (WHERE operation_name IN ('chat', 'text_completion', 'completion', 'generate_content')
                                  AND name <> 'lightning.generate') AS llm_calls,
           count(*) FILTER (WHERE status_code = 'ERROR') AS error_spans,
           min(start_ns) AS first_ns, max(end_ns) AS last_ns
    FROM spans WHERE rollout_id IS NOT NULL GROUP BY rollout_id
),
runs AS (
    SELECT coalesce(r.rollout_id, s.rollout_id) AS rollout_id, coalesce(r.task_id, s.task_id) AS task_id,
           coalesce(r.attempt, s.attempt) AS attempt, r.policy_version, r.status, r.error_class,
           coalesce(s.spans, 0) AS spans, coalesce(s.traces, 0) AS traces, coalesce(s.llm_calls, 0) AS llm_calls,
           coalesce(s.error_spans, 0) AS error_spans, coalesce(r.started_ns, s.first_ns) AS started_ns,
           (coalesce(r.ended_ns, s.last_ns) - coalesce(r.started_ns, s.first_ns)) / 1e9 AS duration_s
    FROM rollout_runs r FULL OUTER JOIN stats s ON s.rollout_id = r.rollout_id
),
scored AS (
    SELECT rollout_id,
           arg_max(value, (CASE source WHEN 'human' THEN 2 WHEN 'emitted' THEN 0 ELSE 1 END,
                           coalesce(created_ns, 0), value)) AS reward
    FROM rewards WHERE span_id IS NULL AND name = $reward GROUP BY rollout_id
)
SELECT runs.*, scored.reward, count(*) OVER () AS total
FROM runs LEFT JOIN scored ON scored.rollout_id = runs.rollout_id
WHERE $where
ORDER BY $sort NULLS LAST, runs.rollout_id
LIMIT $limit OFFSET $offset
"""
# Rollouts with a span that stands for the named agent (agent_name_of, migrations 0003/0006), searched only among
# spans that can stand for one.
SQL_AGENT_ROLLOUTS = """
SELECT DISTINCT rollout_id FROM spans
WHERE rollout_id IS NOT NULL
  AND (operation_name IN ('invoke_agent', 'create_agent', 'execute_task') OR name LIKE 'invoke_agent %'
       OR name LIKE 'execute_task %' OR name LIKE '%.agent' OR name LIKE '%.task')
  AND agent_name_of(name, attributes, operation_name) = $agent
"""

SQL_RUN = "SELECT * FROM rollout_runs WHERE rollout_id = $id"
SQL_SPANS = """
SELECT trace_id, span_id, parent_span_id, name, kind, start_ns, end_ns, status_code, status_message,
       attributes::VARCHAR AS attributes, events::VARCHAR AS events, operation_name, rollout_id, service_name
FROM spans WHERE trace_id IN (SELECT DISTINCT trace_id FROM spans WHERE rollout_id = $id)
ORDER BY start_ns, span_id
"""
SQL_REWARDS = """
SELECT trace_id, span_id, name, value, source, created_ns, author, comment FROM rewards
WHERE rollout_id = $id ORDER BY created_ns
"""
SQL_TASK = "SELECT fields::VARCHAR AS fields FROM tasks WHERE task_id = $id"
# One rollout's transitions with the compiler's defaults (gamma 1, the episode reward, A over its (task, policy
# version) group of runner records that ended ok), computed for its group only: the store's `transitions` view
# computes every group first, seconds on a large store.
SQL_STORE_TRANSITIONS = """
WITH me AS (SELECT task_id, policy_version FROM rollout_runs WHERE rollout_id = $id),
members AS (
    SELECT r.rollout_id FROM rollout_runs r, me
    WHERE r.task_id = me.task_id AND r.policy_version IS NOT DISTINCT FROM me.policy_version
      AND coalesce(r.status, 'ok') = 'ok'
),
scored AS (
    SELECT w.rollout_id,
           arg_max(w.value, (CASE w.source WHEN 'human' THEN 2 WHEN 'emitted' THEN 0 ELSE 1 END,
                             coalesce(w.created_ns, 0), w.value)) AS reward
    FROM rewards w JOIN members m ON m.rollout_id = w.rollout_id
    WHERE w.span_id IS NULL AND w.name = $reward GROUP BY w.rollout_id
),
stats AS (SELECT avg(reward) AS mean, stddev_samp(reward) AS spread FROM scored)
SELECT t.rollout_id, me.task_id, me.policy_version, NULL AS agent,
       row_number() OVER (ORDER BY t.start_ns, t.span_id) - 1 AS turn, t.prompt_ids, t.completion_ids,
       t.completion_logprobs::FLOAT[] AS completion_logprobs, s.reward, s.reward AS "return",
       (s.reward - stats.mean) / (stats.spread + 1e-6) AS advantage
FROM token_records t JOIN scored s ON s.rollout_id = t.rollout_id, me, stats
WHERE t.rollout_id = $id AND stats.spread > 0 AND len(t.completion_ids) > 0
ORDER BY turn
"""
# A task's group: its rollouts by one policy version, each with its episode reward and last answer.
SQL_GROUP = """
WITH scored AS (
    SELECT rollout_id,
           arg_max(value, (CASE source WHEN 'human' THEN 2 WHEN 'emitted' THEN 0 ELSE 1 END,
                           coalesce(created_ns, 0), value)) AS reward
    FROM rewards WHERE span_id IS NULL AND name = $reward GROUP BY rollout_id
)
SELECT r.rollout_id, r.task_id, r.attempt, r.policy_version, r.status, r.error_class, r.final_output,
       (r.ended_ns - r.started_ns) / 1e9 AS duration_s, s.reward
FROM rollout_runs r LEFT JOIN scored s ON s.rollout_id = r.rollout_id
WHERE r.task_id = $task AND $version_test ORDER BY r.attempt, r.rollout_id
"""
SQL_LAST_OUTPUTS = """
SELECT rollout_id, arg_max(attr(attributes, 'gen_ai.output.messages'), start_ns) AS output_messages
FROM spans WHERE rollout_id IN ($ids) AND operation_name IN ('chat', 'text_completion', 'completion')
  AND name <> 'lightning.generate' GROUP BY rollout_id
"""
# Per (version, task): the best episode reward of its rollouts (the eval report's outcome per task).
SQL_VERSION_OUTCOMES = """
WITH scored AS (
    SELECT rollout_id,
           arg_max(value, (CASE source WHEN 'human' THEN 2 WHEN 'emitted' THEN 0 ELSE 1 END,
                           coalesce(created_ns, 0), value)) AS reward
    FROM rewards WHERE span_id IS NULL AND name = $reward GROUP BY rollout_id
)
SELECT r.policy_version, r.task_id, r.rollout_id, s.reward FROM rollout_runs r
JOIN scored s ON s.rollout_id = r.rollout_id WHERE r.policy_version IN ($a, $b)
ORDER BY r.task_id, r.policy_version, r.attempt
"""


def fill(sql: str, **values: str) -> str:
    """Put already-safe SQL fragments (literals from sql_literal, validated numbers) in place of $names."""
    # One pass, so a value that itself contains "$name" is never substituted again.
    return PLACEHOLDER.sub(lambda match: values.get(match.group(1), match.group(0)), sql)


class BadRequest(ValueError):
    """A query string value the page cannot use (answered 400 with this message)."""


def _text(params: dict[str, str], key: str) -> str | None:
    value = params.get(key, "").strip()
    if len(value) > MAX_TEXT:
        raise BadRequest(f"{key} is over {MAX_TEXT} characters")
    return value or None


def number(params: dict[str, str], key: str, integer: bool = False) -> float | int | None:
    raw = params.get(key, "").strip()
    if not raw:
        return None
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        raise BadRequest(f"{key}={raw[:40]!r} is not {'a whole number' if integer else 'a number'}") from None
    if not math.isfinite(value):
        raise BadRequest(f"{key} must be a finite number")
    return value


@dataclass(frozen=True)
class RolloutFilter:
    task: str | None = None
    status: str | None = None
    error_class: str | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    version: int | None = None
    agent: str | None = None
    sort: str = "started_ns"
    descending: bool = True
    page: int = 0

    @classmethod
    def from_params(cls, params: dict[str, str]) -> RolloutFilter:
        sort = params.get("sort") or "started_ns"
        if sort not in SORTS:
            raise BadRequest(f"sort={sort[:40]!r}: sort by one of {', '.join(SORTS)}")
        order = params.get("order") or "desc"
        if order not in ("asc", "desc"):
            raise BadRequest("order is asc or desc")
        page = number(params, "page", integer=True) or 0
        if not 0 <= page <= MAX_PAGE:
            raise BadRequest(f"page must be between 0 and {MAX_PAGE}")
        version = number(params, "version", integer=True)
        return cls(task=_text(params, "task"), status=_text(params, "status"),
                   error_class=_text(params, "error_class"), reward_min=number(params, "reward_min"),
                   reward_max=number(params, "reward_max"), version=version, agent=_text(params, "agent"),
                   sort=sort, descending=order == "desc", page=int(page))

    def sql(self, reward: str | None) -> str:
        tests = ["true"]
        for column, value in (("task_id", self.task), ("status", self.status), ("error_class", self.error_class)):
            if value is not None:
                tests.append(f"runs.{column} = {sql_literal(value)}")
        if self.version is not None:
            tests.append(f"runs.policy_version = {int(self.version)}")
        if self.reward_min is not None:
            tests.append(f"scored.reward >= {float(self.reward_min)!r}")
        if self.reward_max is not None:
            tests.append(f"scored.reward <= {float(self.reward_max)!r}")
        if self.agent is not None:
            tests.append(f"runs.rollout_id IN ({fill(SQL_AGENT_ROLLOUTS, agent=sql_literal(self.agent))})")
        column = "scored.reward" if self.sort == "reward" else f"runs.{self.sort}"
        return fill(SQL_ROLLOUTS, reward=sql_literal(reward or ""), where=" AND ".join(tests),
                    sort=f"{column} {'DESC' if self.descending else 'ASC'}", limit=str(PAGE_SIZE),
                    offset=str(self.page * PAGE_SIZE))
