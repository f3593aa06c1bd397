"""Evaluation metrics, computed from the trace store with SQL over the rollouts, rewards, tasks,
llm_calls and generations views (never from the runner's in-memory results).

Every query is scoped to one evaluation's rollouts (their ids), so a store shared with training rounds
or other evaluations gives the same numbers.

Execution accuracy is the share of scored rollouts whose `spider_exec` reward is 1 (the final SQL
returns the gold query's result on the task's database). Rollouts without a reward (a task without a
gold query) are counted apart, never as wrong. The 95% interval is Wilson's score interval over
rollouts; with -n > 1 the samples of one task are not independent, so it is then narrower than the
interval over tasks would be.

Failure classes, one per rollout, checked in this order:
- `unscored`: no spider_exec reward was stored (the task has no gold query or database).
- `correct`: reward 1.
- `timeout`: the agent ran past the runner's timeout and was killed.
- `agent_error`: the agent exited non-zero or could not start.
- `no_sql`: the final output line is missing, or, once a code fence is removed, does not begin with
  SELECT or WITH (the model answered in prose).
- `sql_error`: the final SQL fails on the task's database (syntax, unknown column, time limit).
- `wrong_result`: the SQL runs but returns other rows than the gold query.
"""
from __future__ import annotations

import logging
import math
import re
import sqlite3
from pathlib import Path

from lightning_otel.rollouts.rewards import QueryTimeout, database_path, extract_sql, run_query
from lightning_otel.span_store import client

log = logging.getLogger(__name__)

REWARD = "spider_exec"
HARDNESS_ORDER = ("easy", "medium", "hard", "extra")
FAILURE_CLASSES = {  # name -> meaning, in report order
    "correct": "the final SQL returns the gold result",
    "wrong_result": "the final SQL runs but returns other rows",
    "sql_error": "the final SQL fails on the database (error or time limit)",
    "no_sql": "no final query: empty, prose, or not a SELECT/WITH statement",
    "agent_error": "the agent exited non-zero or could not start",
    "timeout": "the agent ran past the rollout timeout",
    "unscored": "no spider_exec reward (task without gold query)",
}
SQL_RAN = ("correct", "wrong_result")  # the classes whose final SQL runs on its database
SQL_START = re.compile(r"^\s*(SELECT|WITH)\b", re.IGNORECASE)
Z95 = 1.959963984540054

# One row per rollout of the evaluation: outcome, task fields, reward, LLM calls and gateway token counts.
# {ids} is a SQL list of rollout id literals. LLM calls are requests (trajectory_calls): one request that two
# instrumentations both recorded (the Agents SDK's response span around the OpenAI SDK's chat span) counts once.
EPISODES_SQL = """
WITH requests AS (
    SELECT rollout_id, count(*) AS calls FROM trajectory_calls WHERE rollout_id IN ({ids}) GROUP BY rollout_id
), scored AS (
    SELECT rollout_id, any_value(value) AS reward FROM rewards
    WHERE name = '{reward}' AND span_id IS NULL AND rollout_id IN ({ids}) GROUP BY rollout_id
), tokens AS (
    SELECT rollout_id, count(*) AS generations, sum(len(prompt_ids))::BIGINT AS prompt_tokens,
           sum(len(completion_ids))::BIGINT AS completion_tokens
    FROM generations WHERE rollout_id IN ({ids}) GROUP BY rollout_id
)
SELECT r.rollout_id, r.task_id, r.attempt, r.policy_version, r.status, r.error_class, r.duration_s,
       r.final_output, coalesce(q.calls, 0) AS llm_calls, coalesce(k.generations, 0) AS generations,
       coalesce(k.prompt_tokens, 0) AS prompt_tokens, coalesce(k.completion_tokens, 0) AS completion_tokens,
       coalesce(t.fields->>'hardness', 'unknown') AS hardness, t.fields->>'db_id' AS db_id, s.reward
FROM rollouts r
LEFT JOIN tasks t ON t.task_id = r.task_id
LEFT JOIN scored s ON s.rollout_id = r.rollout_id
LEFT JOIN tokens k ON k.rollout_id = r.rollout_id
LEFT JOIN requests q ON q.rollout_id = r.rollout_id
WHERE r.rollout_id IN ({ids})
ORDER BY r.task_id, r.attempt
"""

ACCURACY_SQL = """
WITH episodes AS ({episodes})
SELECT coalesce(hardness, 'all') AS hardness, grouping(hardness) AS is_total, count(*) AS rollouts,
       count(reward) AS scored, count(*) FILTER (WHERE reward = 1.0) AS correct
FROM episodes GROUP BY ROLLUP (hardness)
"""

EPISODE_STATS_SQL = """
WITH episodes AS ({episodes})
SELECT count(*) AS rollouts,
       avg(llm_calls) AS transitions_mean, quantile_cont(llm_calls, 0.5) AS transitions_p50,
       max(llm_calls) AS transitions_max,
       avg(prompt_tokens) AS prompt_tokens_mean, avg(completion_tokens) AS completion_tokens_mean,
       avg(prompt_tokens + completion_tokens) AS tokens_mean,
       avg(duration_s) AS rollout_s_mean, quantile_cont(duration_s, 0.5) AS rollout_s_p50,
       quantile_cont(duration_s, 0.9) AS rollout_s_p90, max(duration_s) AS rollout_s_max
FROM episodes
"""

TRANSITIONS_HISTOGRAM_SQL = """
WITH episodes AS ({episodes})
SELECT llm_calls AS transitions, count(*) AS rollouts FROM episodes GROUP BY llm_calls ORDER BY llm_calls
"""

# Latency as the agent saw it (client LLM spans, each request once: trajectory_calls keeps the innermost span of
# a wrapped call) and as the engine took (gateway token records).
CALL_LATENCY_SQL = """
SELECT 'llm_call_ms' AS what, count(*) AS calls, avg(duration_ms) AS mean,
       quantile_cont(duration_ms, 0.5) AS p50, quantile_cont(duration_ms, 0.9) AS p90
FROM (SELECT (end_ns - start_ns) / 1e6 AS duration_ms FROM trajectory_calls WHERE rollout_id IN ({ids}))
UNION ALL
SELECT 'engine_ms', count(*), avg((end_ns - start_ns) / 1e6), quantile_cont((end_ns - start_ns) / 1e6, 0.5),
       quantile_cont((end_ns - start_ns) / 1e6, 0.9)
FROM generations WHERE rollout_id IN ({ids})
"""


def id_list(rollout_ids: list[str]) -> str:
    return ", ".join(client.sql_literal(i) for i in sorted(rollout_ids))


def wilson_interval(correct: int, n: int, z: float = Z95) -> tuple[float, float] | None:
    """Wilson's score interval for a binomial proportion; None when n = 0."""
    if n == 0:
        return None
    p = correct / n
    denominator = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    # Exact at the ends (0 of n, n of n): rounding would leave the interval a hair off its own estimate.
    return (0.0 if correct == 0 else max(0.0, center - half)), (1.0 if correct == n else min(1.0, center + half))


def sign_test_p(better: int, worse: int) -> float:
    """Two-sided exact sign test: the chance of a split at least this uneven between `better` and `worse` if
    either were equally likely (ties left out). With one sample a task this is McNemar's exact test."""
    m = better + worse
    tail = sum(math.comb(m, k) for k in range(min(better, worse) + 1)) / 2 ** m
    return min(1.0, 2 * tail)


def hardness_key(name: str) -> tuple[int, str]:
    return (HARDNESS_ORDER.index(name), name) if name in HARDNESS_ORDER else (len(HARDNESS_ORDER), name)


def accuracy_entry(rollouts: int, scored: int, correct: int) -> dict:
    interval = wilson_interval(correct, scored)
    return {"rollouts": rollouts, "scored": scored, "correct": correct,
            "accuracy": correct / scored if scored else None, "ci95": list(interval) if interval else None}


def classify(row: dict, data_dir: Path, timeout_s: float = 10.0) -> str:
    """The failure class of one rollout row (see the module docstring), re-running its SQL when needed."""
    if row["reward"] is None:
        return "unscored"
    if row["reward"] == 1.0:
        return "correct"
    if row["status"] == "timeout":
        return "timeout"
    if row["status"] in ("failed", "error"):
        return "agent_error"
    sql = extract_sql(row["final_output"])
    if sql is None or not SQL_START.match(sql):
        return "no_sql"
    try:
        run_query(database_path(data_dir, str(row["db_id"])), sql, timeout_s)
    except (sqlite3.Error, sqlite3.Warning, QueryTimeout, ValueError):
        return "sql_error"
    return "wrong_result"


def _percentiles(frame_row: dict, prefix: str) -> dict:
    return {key[len(prefix):]: frame_row[key] for key in frame_row if key.startswith(prefix)}


def compute_metrics(db: Path, rollout_ids: list[str], data_dir: Path) -> dict:
    """Every number of the report, from the store at `db`, over the given rollouts."""
    ids = id_list(rollout_ids)
    episodes_sql = EPISODES_SQL.format(reward=REWARD, ids=ids)
    episodes = client.query(episodes_sql, db).to_dicts()
    if len(episodes) != len(rollout_ids):
        log.warning("the store holds %d of the %d rollouts run", len(episodes), len(rollout_ids))

    by_hardness, overall = {}, None
    for row in client.query(ACCURACY_SQL.format(episodes=episodes_sql), db).to_dicts():
        entry = accuracy_entry(row["rollouts"], row["scored"], row["correct"])
        if row["is_total"]:
            overall = entry
        else:
            by_hardness[row["hardness"]] = entry
    stats = client.query(EPISODE_STATS_SQL.format(episodes=episodes_sql), db).to_dicts()[0]
    histogram = client.query(TRANSITIONS_HISTOGRAM_SQL.format(episodes=episodes_sql), db).to_dicts()
    calls = {row.pop("what"): row for row in client.query(CALL_LATENCY_SQL.format(ids=ids), db).to_dicts()}

    classes = {name: 0 for name in FAILURE_CLASSES}
    for row in episodes:
        row["failure_class"] = classify(row, data_dir)
        classes[row["failure_class"]] += 1
    return {
        "rollouts": stats["rollouts"],
        "accuracy": {"overall": overall or accuracy_entry(0, 0, 0),
                     "by_hardness": {k: by_hardness[k] for k in sorted(by_hardness, key=hardness_key)}},
        "transitions_per_episode": {"mean": stats["transitions_mean"], "p50": stats["transitions_p50"],
                                    "max": stats["transitions_max"],
                                    "histogram": {str(r["transitions"]): r["rollouts"] for r in histogram}},
        "tokens_per_episode": {"prompt": stats["prompt_tokens_mean"], "completion": stats["completion_tokens_mean"],
                               "total": stats["tokens_mean"]},
        "failure_classes": classes,
        "latency": {"rollout_s": _percentiles(stats, "rollout_s_"), "llm_call_ms": calls.get("llm_call_ms"),
                    "engine_ms": calls.get("engine_ms")},
        "episodes": [{k: row[k] for k in ("rollout_id", "task_id", "attempt", "policy_version", "status",
                                          "hardness", "reward", "failure_class", "llm_calls", "prompt_tokens",
                                          "completion_tokens", "duration_s", "final_output")} for row in episodes],
    }
