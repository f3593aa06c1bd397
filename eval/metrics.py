"""Evaluation metrics, computed from the trace store with SQL over the rollouts, rewards, tasks,
llm_calls and generations views (never from the runner's in-memory results).

Every query is scoped to one evaluation's rollouts (their ids), so a store shared with training rounds
or other evaluations gives the same numbers.

Accuracy is the share of scored rollouts whose reward (the one the evaluation ran, e.g. spider_exec or
number_match) is 1. Rollouts without a reward (a task with nothing to score against) are counted apart,
never as wrong. The 95% interval is Wilson's score interval over rollouts; with -n > 1 the samples of one
task are not independent, so it is then narrower than the interval over tasks would be. When the task pack
names a group field (Spider: hardness), accuracy is also given per value of that task field.

Outcome classes, one per rollout (TaskPack.outcome): correct, then the task pack's own classes for scored
answers that are not right (Spider: wrong_result, sql_error, no_sql; math: wrong_number, no_number; a
reward without a pack: wrong), agent_error, timeout and unscored.
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from lightning_otel.rollouts.packs import TaskPack, bare_pack
from lightning_otel.span_store import client

log = logging.getLogger(__name__)

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
       {group} AS grp, t.fields AS task_fields, s.reward
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
SELECT coalesce(grp, 'all') AS grp, grouping(grp) AS is_total, count(*) AS rollouts,
       count(reward) AS scored, count(*) FILTER (WHERE reward = 1.0) AS correct
FROM episodes GROUP BY ROLLUP (grp)
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


EPISODE_KEYS = ("rollout_id", "task_id", "attempt", "policy_version", "status", "reward", "failure_class",
                "llm_calls", "prompt_tokens", "completion_tokens", "duration_s", "final_output")


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


def outcomes_by_version(db: Path, task_ids: set[str] | list[str]) -> dict[int, dict[str, float]]:
    """Per policy version in the store `db`, each of `task_ids`' outcome: 1.0 when an episode reward of one of
    its rollouts by that version reached 1 (right), else 0.0. A task has an entry for a version only where a
    rollout of it by that version was rewarded; comparing two versions task by task (sign_test_p on the tasks
    whose outcome changed) is the paired test of a validation set scored every few rounds."""
    listed = ", ".join(client.sql_literal(i) for i in sorted(task_ids)) or "NULL"
    rows = client.query(f"""
        SELECT r.policy_version AS version, r.task_id, max(w.value) AS reward
        FROM rollouts r JOIN rewards w ON w.rollout_id = r.rollout_id AND w.span_id IS NULL
        WHERE r.task_id IN ({listed}) GROUP BY ALL""", db).to_dicts()
    by_version: dict[int, dict[str, float]] = {}
    for row in rows:
        by_version.setdefault(int(row["version"]), {})[row["task_id"]] = float(row["reward"] >= 1.0)
    return by_version


def group_key(order: list[str] | tuple[str, ...]):
    """Sort key for group values: the task pack's order first, then the rest by name."""
    return lambda name: (order.index(name), name) if name in order else (len(order), name)


def accuracy_groups(accuracy: dict) -> dict[str, dict]:
    """Group value -> accuracy entry of a summary's accuracy (summaries written before task packs said
    by_hardness)."""
    return accuracy.get("by_group") or accuracy.get("by_hardness") or {}


def group_field(accuracy: dict) -> str:
    return accuracy.get("group_field") or ("hardness" if "by_hardness" in accuracy else "group")


def merged_groups(*accuracies: dict) -> list[str]:
    """The group values of several summaries, in the first one's order, then the others' new ones."""
    return list(dict.fromkeys(level for acc in accuracies for level in accuracy_groups(acc)))


def accuracy_entry(rollouts: int, scored: int, correct: int) -> dict:
    interval = wilson_interval(correct, scored)
    return {"rollouts": rollouts, "scored": scored, "correct": correct,
            "accuracy": correct / scored if scored else None, "ci95": list(interval) if interval else None}


def _percentiles(frame_row: dict, prefix: str) -> dict:
    return {key[len(prefix):]: frame_row[key] for key in frame_row if key.startswith(prefix)}


def compute_metrics(db: Path, rollout_ids: list[str], reward: str, pack: TaskPack | None = None,
                    data_dir: Path | None = None) -> dict:
    """Every number of the report, from the store at `db`, over the given rollouts, scored by the stored
    rewards named `reward` and classified by the task pack (the generic classes without one)."""
    pack = pack or bare_pack(reward, lambda task, rollout: None)
    ids = id_list(rollout_ids)
    group = f"coalesce(t.fields->>'{pack.group_field}', 'unknown')" if pack.group_field else "'all'"
    episodes_sql = EPISODES_SQL.format(reward=client.sql_literal(reward)[1:-1], ids=ids, group=group)
    episodes = client.query(episodes_sql, db).to_dicts()
    if len(episodes) != len(rollout_ids):
        log.warning("the store holds %d of the %d rollouts run", len(episodes), len(rollout_ids))

    by_group, overall = {}, None
    for row in client.query(ACCURACY_SQL.format(episodes=episodes_sql), db).to_dicts():
        entry = accuracy_entry(row["rollouts"], row["scored"], row["correct"])
        if row["is_total"]:
            overall = entry
        elif pack.group_field:
            by_group[row["grp"]] = entry
    stats = client.query(EPISODE_STATS_SQL.format(episodes=episodes_sql), db).to_dicts()[0]
    histogram = client.query(TRANSITIONS_HISTOGRAM_SQL.format(episodes=episodes_sql), db).to_dicts()
    calls = {row.pop("what"): row for row in client.query(CALL_LATENCY_SQL.format(ids=ids), db).to_dicts()}

    meanings = pack.report_classes()
    classes = {name: 0 for name in meanings}
    for row in episodes:
        task = json.loads(row.pop("task_fields") or "{}")
        row["failure_class"] = pack.outcome({**task, **row}, data_dir)
        classes[row["failure_class"]] += 1
    order = list(pack.group_order)
    return {
        "rollouts": stats["rollouts"],
        "reward": reward,
        "task_pack": pack.name,
        "accuracy": {"overall": overall or accuracy_entry(0, 0, 0), "group_field": pack.group_field,
                     "by_group": {k: by_group[k] for k in sorted(by_group, key=group_key(order))}},
        "transitions_per_episode": {"mean": stats["transitions_mean"], "p50": stats["transitions_p50"],
                                    "max": stats["transitions_max"],
                                    "histogram": {str(r["transitions"]): r["rollouts"] for r in histogram}},
        "tokens_per_episode": {"prompt": stats["prompt_tokens_mean"], "completion": stats["completion_tokens_mean"],
                               "total": stats["tokens_mean"]},
        "failure_classes": classes,
        "outcome_classes": meanings,
        "latency": {"rollout_s": _percentiles(stats, "rollout_s_"), "llm_call_ms": calls.get("llm_call_ms"),
                    "engine_ms": calls.get("engine_ms")},
        "episodes": [{**{k: row[k] for k in EPISODE_KEYS}, "group": row["grp"]} for row in episodes],
    }
