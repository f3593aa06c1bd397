"""Record real rollouts through the token-recording gateway: the example agents (examples/*), unchanged,
under `opentelemetry-instrument`, against vLLM serving the bundled SmolLM2-135M, scored by `spider_exec`
and by `sql_form` (a format reward: 1 when the final output is a query, 0.5 when it holds one, else 0;
the bundled model almost never gets an execution match, so this is the reward that varies within groups).
The store's rows are saved as Parquet for the compiler's tests and benchmark (tests/fixtures/rollouts/).

    .venv/bin/python tests/recorder/record_gateway_rollouts.py --out tests/fixtures/rollouts [--tasks 3 -n 4]

Needs the environments `make test` builds (.venv, .venv-engine, .venv-crewai). Takes several minutes on
a 2-core CPU (one engine start, then every rollout).
"""
from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

from lightning_otel.serve.engine import EngineConfig, VLLMEngine, default_engine_python
from lightning_otel.serve.model import bundled_model_dir
from lightning_otel.tasks.spider.rewards import bundled_data_dir
from lightning_otel.rollouts.runner import RolloutConfig, run_rollouts
from lightning_otel.span_store import client

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = {  # example -> python of the environment that has its framework
    "openai_sql": REPO / ".venv" / "bin" / "python",
    "sql_agent": REPO / ".venv" / "bin" / "python",
    "autogen_sql": REPO / ".venv" / "bin" / "python",
    "crewai_sql": REPO / ".venv-crewai" / "bin" / "python",
}
TABLES = ("spans", "rewards", "rollout_runs", "tasks")


def pick_tasks(count: int, folder: Path) -> Path:
    """The first `count` easy dev questions on distinct databases, as a task file."""
    chosen, seen = [], set()
    for line in (bundled_data_dir() / "dev.jsonl").read_text().splitlines():
        task = json.loads(line)
        if task.get("hardness") == "easy" and task["db_id"] not in seen:
            chosen.append(task)
            seen.add(task["db_id"])
        if len(chosen) == count:
            break
    path = folder / "tasks.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in chosen))
    return path


def sql_form(final_output: str | None) -> float:
    text = (final_output or "").strip().upper()
    if text.startswith(("SELECT", "WITH")):
        return 1.0
    return 0.5 if "SELECT" in text else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tasks", type=int, default=3)
    parser.add_argument("-n", type=int, default=4)
    parser.add_argument("--only", nargs="*", choices=sorted(EXAMPLES))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    work = Path(tempfile.mkdtemp(prefix="record-rollouts-"))
    db = work / "traces.duckdb"
    tasks = pick_tasks(args.tasks, work)
    python = default_engine_python(REPO)
    engine = VLLMEngine(EngineConfig(model_dir=bundled_model_dir(python=python), python=python,
                                     log_path=work / "vllm.log", max_model_len=4096))
    engine.start()
    try:
        for name in args.only or EXAMPLES:
            started = time.monotonic()
            agent = f"{EXAMPLES[name]} {REPO / 'examples' / name / 'agent.py'} --question {{question}} --db {{db_path}}"
            summary = run_rollouts(RolloutConfig(tasks=tasks, agent=agent, n=args.n, concurrency=2, db=db,
                                                 reward="spider_exec", rollout_timeout_s=300), engine=engine)
            logging.info("%s: %d rollouts, %s ok, %.0f s", name, len(summary.results), summary.count("ok"),
                         time.monotonic() - started)
    finally:
        engine.stop()
    runs = client.query("SELECT rollout_id, final_output FROM rollout_runs", db)
    client.write_records(db, "rewards", [{"rollout_id": r["rollout_id"], "name": "sql_form", "source": "function",
                                          "value": sql_form(r["final_output"]), "created_ns": time.time_ns()}
                                         for r in runs.to_dicts()])
    args.out.mkdir(parents=True, exist_ok=True)
    for table in TABLES:
        client.query(f"SELECT * FROM {table}", db).write_parquet(args.out / f"{table}.parquet",
                                                                 compression="zstd", compression_level=19)
    print(client.query("SELECT service_name, count(*) AS spans, count(DISTINCT rollout_id) AS rollouts "
                       "FROM spans GROUP BY ALL ORDER BY 1", db))


if __name__ == "__main__":
    main()
