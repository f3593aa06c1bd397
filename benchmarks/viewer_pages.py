"""Viewer pages on a store of a million spans: each page's server response against the same page's data as raw
DuckDB SQL.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/viewer_pages.py --spans 1000000 --runs 5

Store (built once, kept in .bench/viewer-<spans>.duckdb): synthesised by bulk SQL inserts following the schema in
span_store/migrations (not through HTTP, which benchmarks/ingest_throughput.py measures): rollouts of 50 spans each
(a lightning.rollout root, an invoke_agent span, 16 turns of chat call + lightning.generate token record + tool
call, the chat spans with ~400 bytes of messages, the records with 64 prompt and 16 completion token ids), every
other rollout split over two traces (as AutoGen splits them); 5 policy versions x 4 samples per task; one reward
per rollout; rollout_runs rows; token_records filled by the store's own macro, as ingest fills them.

Contenders, per page, warm (one untimed request first), median of --runs:
  viewer   GET of the page from `lightning-otel view` on the file (read-only connection), HTML and all
  raw      the page's main SQL statement run directly on a read-only DuckDB connection to the same file, fetched
           as Arrow (what any page must at least pay)
Ratio = viewer / raw. Target: every page under 1 s.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import urllib.request
from pathlib import Path


from lightning_otel.span_store import store
from lightning_otel.view import queries
from lightning_otel.view.server import ViewConfig, Viewer

SPANS_PER_ROLLOUT = 50
TURNS = 16
SAMPLES, VERSIONS = 4, 5

SQL_SPANS = """
INSERT INTO spans (trace_id, span_id, parent_span_id, name, kind, start_ns, end_ns, status_code, status_message,
                   attributes, resource, scope_name, service_name, rollout_id, task_id, attempt, operation_name,
                   request_model, input_tokens, output_tokens, received_ns)
WITH base AS (
    SELECT i, i // 50 AS r, i % 50 AS k, (i % 50 - 2) // 3 AS turn, (i % 50 - 2) % 3 AS role FROM range($spans) t(i)
),
named AS (
    SELECT *, printf('ro-%07d', r) AS rid, printf('task-%05d', r // ($samples * $versions)) AS task,
           r % $samples AS attempt, (r // $samples) % $versions AS version,
           1700000000000000000 + r * 60000000000 + k * 1000000000 AS t0
    FROM base
)
SELECT printf('%016x%016x', r, CASE WHEN r % 2 = 1 AND turn >= 8 THEN 1 ELSE 0 END) AS trace_id,
       printf('%016x', i) AS span_id,
       CASE WHEN k = 0 THEN NULL
            WHEN k = 1 THEN printf('%016x', i - 1)
            WHEN r % 2 = 1 AND turn >= 8 AND role = 0 THEN NULL
            WHEN role = 1 THEN printf('%016x', i - 1)
            ELSE printf('%016x', i - k + 1) END AS parent_span_id,
       CASE WHEN k = 0 THEN 'lightning.rollout' WHEN k = 1 THEN 'invoke_agent solver'
            WHEN role = 0 THEN 'openai.chat' WHEN role = 1 THEN 'lightning.generate' ELSE 'execute_tool run_sql' END,
       'INTERNAL', t0, t0 + 800000000,
       CASE WHEN role = 2 AND i % 7 = 0 THEN 'ERROR' ELSE 'UNSET' END,
       CASE WHEN role = 2 AND i % 7 = 0 THEN 'no such column: nme' END,
       CASE WHEN k = 0 THEN json_object('lightning.rollout.id', rid, 'lightning.task.id', task)
            WHEN k = 1 THEN json_object('gen_ai.operation.name', 'invoke_agent', 'gen_ai.agent.name', 'solver')
            WHEN role = 0 THEN json_object('gen_ai.operation.name', 'chat', 'gen_ai.request.model', 'gpt-4o',
                 'gen_ai.input.messages', json_array(json_object('role', 'user', 'parts', json_array(json_object(
                     'type', 'text', 'content', 'How many singers are there in the database, grouped by country '
                     || 'and ordered by their average net worth? Answer with one SQL query. Turn ' || turn)))),
                 'gen_ai.output.messages', json_array(json_object('role', 'assistant', 'parts', json_array(
                     json_object('type', 'text', 'content', 'SELECT country, count(*) FROM singer GROUP BY 1'))))
                 )::VARCHAR
            WHEN role = 1 THEN json_object('lightning.rollout.id', rid, 'lightning.policy.version', version,
                 'lightning.engine', 'vllm', 'lightning.choice.index', 0,
                 'lightning.prompt.token_ids', range(turn, turn + 64),
                 'lightning.completion.token_ids', range(100 + turn, 116 + turn),
                 'lightning.completion.logprobs', list_transform(range(16), lambda x: -0.05 * x))
            ELSE json_object('gen_ai.operation.name', 'execute_tool', 'gen_ai.tool.name', 'run_sql',
                 'gen_ai.tool.call.arguments', '{"query": "SELECT country FROM singer"}',
                 'gen_ai.tool.call.result', '[["France"], ["Netherlands"]]') END,
       '{"service.name": "bench-agent"}', 'bench', 'bench-agent', rid, task, attempt,
       CASE WHEN k = 1 THEN 'invoke_agent' WHEN k > 1 AND role = 0 THEN 'chat'
            WHEN k > 1 AND role = 2 THEN 'execute_tool' END,
       CASE WHEN k > 1 AND role = 0 THEN 'gpt-4o' END,
       CASE WHEN k > 1 AND role = 0 THEN 64 END, CASE WHEN k > 1 AND role = 0 THEN 16 END, t0
FROM named
"""
SQL_RUNS = """
INSERT INTO rollout_runs (rollout_id, task_id, attempt, policy_version, status, error_class, exit_code, started_ns,
                          ended_ns, final_output)
SELECT printf('ro-%07d', r), printf('task-%05d', r // ($samples * $versions)), r % $samples,
       (r // $samples) % $versions, CASE WHEN r % 50 = 0 THEN 'failed' ELSE 'ok' END,
       CASE WHEN r % 50 = 0 THEN 'NonZeroExit' END, CASE WHEN r % 50 = 0 THEN 1 ELSE 0 END,
       1700000000000000000 + r * 60000000000, 1700000000000000000 + r * 60000000000 + 50000000000,
       'SELECT country, count(*) FROM singer GROUP BY 1'
FROM range($rollouts) t(r)
"""
SQL_REWARDS = """
INSERT INTO rewards (rollout_id, name, value, source, created_ns)
SELECT printf('ro-%07d', r), 'exec', CASE WHEN hash(r) % 3 = 0 THEN 1.0 ELSE 0.0 END, 'function', r
FROM range($rollouts) t(r)
"""
SQL_TASKS = """
INSERT INTO tasks (task_id, fields) SELECT printf('task-%05d', t), json_object('question', 'How many singers?')
FROM range($tasks) x(t)
"""


def build(path: Path, spans: int) -> None:
    rollouts = spans // SPANS_PER_ROLLOUT
    con = store.connect(path)  # creates and migrates it
    values = {"$spans": str(rollouts * SPANS_PER_ROLLOUT), "$rollouts": str(rollouts), "$samples": str(SAMPLES),
              "$versions": str(VERSIONS), "$tasks": str(rollouts // (SAMPLES * VERSIONS) + 1)}
    for sql in (SQL_SPANS, SQL_RUNS, SQL_REWARDS, SQL_TASKS,
                "INSERT OR IGNORE INTO token_records SELECT * FROM token_records_of('spans')", "CHECKPOINT"):
        for key, value in values.items():
            sql = sql.replace(key, value)
        started = time.perf_counter()
        con.execute(sql)
        print(f"  {sql.split()[0]} {sql.split()[2] if len(sql.split()) > 2 else ''}: "
              f"{time.perf_counter() - started:.1f} s", file=sys.stderr)
    con.close()


def timed(fn, runs: int) -> float:
    fn()
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spans", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(".bench"))
    args = parser.parse_args()
    args.out.mkdir(exist_ok=True)
    db = args.out / f"viewer-{args.spans}.duckdb"
    if not db.exists():
        print(f"building {db}", file=sys.stderr)
        build(db, args.spans)
    rollouts = args.spans // SPANS_PER_ROLLOUT
    one, split = "ro-0000002", "ro-0000003"  # a rollout in one trace, and one split over two
    task, version = "task-00000", 0
    from lightning_otel.span_store.client import sql_literal as lit
    filters = queries.RolloutFilter
    pages = [
        ("rollouts, first page (newest first)", "/", filters().sql("exec")),
        ("rollouts, page 200", "/?page=200", filters(page=200).sql("exec")),
        ("rollouts, task filter", f"/?task={task}", filters(task=task).sql("exec")),
        ("rollouts, reward 1 by reward", "/?reward_min=1&sort=reward&order=asc",
         filters(reward_min=1.0, sort="reward", descending=False).sql("exec")),
        ("rollouts, agent filter", "/?agent=solver&version=2", filters(agent="solver", version=2).sql("exec")),
        ("one rollout (one trace)", f"/rollout/{one}", queries.fill(queries.SQL_SPANS, id=lit(one))),
        ("one rollout (two traces)", f"/rollout/{split}", queries.fill(queries.SQL_SPANS, id=lit(split))),
        ("its transitions (from the store)", f"/rollout/{one}/transitions?reward=exec",
         queries.fill(queries.SQL_STORE_TRANSITIONS, id=lit(one), reward=lit("exec"))),
        ("a task's group", f"/group?task={task}&version={version}&reward=exec",
         queries.fill(queries.SQL_GROUP, task=lit(task), version_test=f"r.policy_version = {version}",
                      reward=lit("exec"))),
        ("compare versions 0 and 4", "/compare?a=0&b=4&reward=exec",
         queries.fill(queries.SQL_VERSION_OUTCOMES, a="0", b="4", reward=lit("exec"))),
    ]
    # One process may not hold the file twice with different settings: the raw side first, on its own connection.
    raw = store.connect(db, read_only=True)
    raw_times = [timed(lambda sql=sql: raw.sql(sql).to_arrow_table(), args.runs) for _, _, sql in pages]
    raw.close()
    print(f"| page ({args.spans:,} spans, {rollouts:,} rollouts) | viewer (s) | raw SQL (s) | viewer / raw |")
    print("|---|---|---|---|")
    with Viewer(ViewConfig(db=db, port=0, model=None)) as viewer:
        for (label, path, _), raw_s in zip(pages, raw_times):
            def get(path: str = path) -> None:
                with urllib.request.urlopen(viewer.url + path, timeout=120) as response:
                    assert response.status == 200
                    response.read()
            page_s = timed(get, args.runs)
            print(f"| {label} | {page_s:.3f} | {raw_s:.3f} | {page_s / raw_s:.1f} |", flush=True)

if __name__ == "__main__":
    main()
