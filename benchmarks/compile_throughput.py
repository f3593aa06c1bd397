"""Compile throughput: spans -> transitions, side by side with Agent Lightning's TracerTraceToTriplet.

    .venv/bin/python benchmarks/compile_throughput.py --spans 1000000 --runs 5 --via-collector \
        --agl-python /work/venvs/agl/bin/python

Store: the real rollouts recorded through the token-recording gateway (tests/fixtures/rollouts/: the four
example agents, unchanged, under opentelemetry-instrument, vLLM serving the bundled model; recorded by
tests/recorder/record_gateway_rollouts.py), replayed K times with fresh trace, span and rollout ids until
the store holds at least --spans spans. Copy k of a rollout of task T belongs to task T#k, so every copy
is a round of its own and the group statistics stay those of the recording.

Contenders, each timed from the stored spans to per-call transitions in memory:
  lightning-otel   compile_transitions() on the DuckDB file: the store's views (duplicates, agent paths,
                   token records) and Polars (rewards, advantages), default credit
  agentlightning   benchmarks/peers/agentlightning_triplets.py in Agent Lightning's own venv: reads the same
                   spans (a Parquet export of the store, written before its clock starts), converts them to
                   its Span type, runs TracerTraceToTriplet per rollout (see that file)
Check: every rollout ours compiles is compared with Agent Lightning's triplets of that rollout: the same
calls with the same prompt ids, completion ids and reward. Wall and CPU seconds are both reported: on a
machine shared with other jobs the CPU time is the steadier of the two (ours runs on every core, the peer
on one).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import duckdb
import polars as pl
import psutil

from lightning_otel.span_store import discovery, store
from lightning_otel.train.transitions.compile import CompileConfig, compile_transitions

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "rollouts"
PEER = REPO / "benchmarks" / "peers" / "agentlightning_triplets.py"
COPIES_PER_INSERT = 100


def fresh(column: str, length: int) -> str:
    """A new hex id for copy k, the same for every row that had the same id in the same trace."""
    return (f"CASE WHEN {column} IS NULL THEN NULL "
            f"ELSE substr(md5(trace_id || '/' || {column} || '/' || k), 1, {length}) END")


def build_store(db: Path, fixture: Path, target_spans: int) -> dict:
    """Copies of the recorded rollouts with fresh ids, stored through store.insert_batch (the collector's
    insert, which also fills the typed token records and the columns extracted at insert)."""
    source = duckdb.connect()
    template = f"read_parquet('{fixture}/spans.parquet')"
    per_copy = source.execute(f"SELECT count(*) FROM {template}").fetchall()[0][0]
    copies = math.ceil(target_spans / per_copy)
    con = store.connect(db, memory_limit="2GB")  # a shared machine
    started = time.perf_counter()
    for first in range(0, copies, COPIES_PER_INSERT):
        last = min(copies, first + COPIES_PER_INSERT)
        batch = source.sql(f"""
            SELECT * EXCLUDE (k) REPLACE (substr(md5(trace_id || '/' || k), 1, 32) AS trace_id,
                   {fresh('span_id', 16)} AS span_id, {fresh('parent_span_id', 16)} AS parent_span_id,
                   rollout_id || '-' || k AS rollout_id, task_id || '#' || k AS task_id)
            FROM {template}, range({first}, {last}) copies(k)""").to_arrow_table()
        con.execute("BEGIN TRANSACTION")
        store.insert_batch(con, "traces", batch, skip_duplicates=False)
        con.execute("COMMIT")
    trace = "CASE WHEN trace_id IS NULL THEN NULL ELSE substr(md5(trace_id || '/' || k), 1, 32) END"
    for table, replace in [("rewards", f"{trace} AS trace_id, {fresh('span_id', 16)} AS span_id, "
                                       f"rollout_id || '-' || k AS rollout_id"),
                           ("rollout_runs", "rollout_id || '-' || k AS rollout_id, task_id || '#' || k AS task_id")]:
        rows = source.sql(f"SELECT * EXCLUDE (k) REPLACE ({replace}) FROM read_parquet('{fixture}/{table}.parquet'), "
                          f"range({copies}) copies(k)").to_arrow_table()
        con.register("rows", rows)
        con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM rows")
    con.execute("CHECKPOINT")
    spans = con.execute("SELECT count(*) FROM spans").fetchone()[0]
    con.close()
    return {"spans": spans, "copies": copies, "template_spans": per_copy,
            "build_s": round(time.perf_counter() - started, 1), "file_mb": round(db.stat().st_size / 2**20)}


def run_ours(db: Path, reward: str) -> tuple[pl.DataFrame, dict]:
    process = psutil.Process()
    before = process.memory_info().rss
    started, cpu_started = time.perf_counter(), time.process_time()
    out, account = compile_transitions(CompileConfig(db=db, reward=reward))
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    return out, {"contender": "lightning-otel", "seconds": round(seconds, 3), "cpu_seconds": round(cpu_seconds, 3),
                 "transitions": out.height, "transitions_per_s": round(out.height / seconds, 1),
                 "llm_calls": account.llm_calls, "rollouts": account.rollouts,
                 "compiled_rollouts": account.compiled_rollouts, "excluded": dict(account.excluded),
                 "rss_growth_mb": round((process.memory_info().rss - before) / 2**20),
                 "load_average": round(os.getloadavg()[0], 1)}


def run_ours_via_collector(db: Path, reward: str) -> dict:
    """The same compile with a live collector holding the file: every query goes through its Arrow IPC
    endpoint over HTTP (DESIGN §7), as a trainer's would while agents keep sending spans."""
    proc = subprocess.Popen([sys.executable, "-m", "lightning_otel.cli", "collect", "--db", str(db), "--port", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while discovery.find_collector(db) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the collector did not start")
            time.sleep(0.2)
        _, stats = run_ours(db, reward)
        return {**stats, "contender": "lightning-otel via collector"}
    finally:
        proc.terminate()
        proc.wait(60)


def export_for_peer(db: Path, folder: Path, reward: str, files: int) -> None:
    """Whole rollouts per file, rows in rollout and start order (what the peer's store would hand it)."""
    folder.mkdir(parents=True, exist_ok=True)
    con = duckdb.connect(str(db), read_only=True)
    columns = "trace_id, span_id, parent_span_id, name, kind, start_ns, end_ns, status_code, status_message, " \
              "attributes::VARCHAR AS attributes, resource::VARCHAR AS resource, rollout_id"
    for i in range(files):
        con.execute(f"COPY (SELECT {columns} FROM spans WHERE rollout_id IS NOT NULL "
                    f"AND hash(rollout_id) % {files} = {i} ORDER BY rollout_id, start_ns, span_id) "
                    f"TO '{folder}/part-{i:03d}.parquet' (FORMAT parquet)")
    con.execute(f"COPY (SELECT rollout_id, reward_name AS name, reward FROM episode_rewards WHERE reward_name = "
                f"'{reward}') TO '{folder.parent}/rewards.parquet' (FORMAT parquet)")
    con.close()


def run_peer(python: str, folder: Path) -> tuple[pl.DataFrame, dict]:
    out = folder.parent / "agl-triplets"
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}  # its import would try the network
    result = subprocess.run([python, str(PEER), "--spans", str(folder), "--rewards",
                             str(folder.parent / "rewards.parquet"), "--out", str(out)],
                            capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"peer failed:\n{result.stderr[-4000:]}")
    return pl.read_parquet(out / "*.parquet"), {**json.loads(result.stdout.strip().splitlines()[-1]),
                                                 "load_average_after": round(os.getloadavg()[0], 1)}


def compare(ours: pl.DataFrame, theirs: pl.DataFrame) -> dict:
    """Per rollout ours compiled: the same multiset of calls (prompt ids, completion ids, reward). Compared
    on 64-bit hashes of the id lists, so that a million calls need megabytes, not a copy as Python objects."""
    def calls(frame: pl.DataFrame) -> pl.DataFrame:
        return frame.select("rollout_id", pl.col("prompt_ids").hash().alias("prompt"),
                            pl.col("completion_ids").hash().alias("completion"), "reward") \
            .sort(["rollout_id", "prompt", "completion", "reward"])

    mine = calls(ours)
    peer = calls(theirs.join(ours.select("rollout_id").unique(), on="rollout_id", how="semi"))
    same = mine.height == peer.height and mine.equals(peer)
    differ = [] if same else mine.join(peer, on=mine.columns, how="anti")["rollout_id"].unique().to_list()
    return {"rollouts_compared": ours["rollout_id"].n_unique(), "calls_compared": ours.height,
            "peer_calls_for_them": peer.height, "rollouts_that_differ": len(differ) if not same else 0,
            "example": differ[:3]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spans", type=int, default=1_000_000, help="spans in the store (at least)")
    parser.add_argument("--reward", default="sql_form", help="reward name to compile (default: sql_form)")
    parser.add_argument("--agl-python", help="Agent Lightning venv's python (omit to run ours only)")
    parser.add_argument("--runs", type=int, default=3, help="timed runs of ours (default: 3)")
    parser.add_argument("--work", type=Path, help="folder for the store and exports (default: a temp folder)")
    parser.add_argument("--peer-files", type=int, default=64, help="Parquet files the peer's spans are split into")
    parser.add_argument("--via-collector", action="store_true",
                        help="also time ours once with a live collector holding the store (queries over HTTP)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="compile-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    db = work / "traces.duckdb"
    if db.exists():
        con = duckdb.connect(str(db), read_only=True)
        built = {"spans": con.execute("SELECT count(*) FROM spans").fetchone()[0], "reused": str(db)}
        con.close()
    else:
        built = build_store(db, FIXTURE, args.spans)
    print(json.dumps({"store": built}), flush=True)
    ours, runs = None, []
    for _ in range(args.runs):
        ours, stats = run_ours(db, args.reward)
        runs.append(stats)
        print(json.dumps(stats), flush=True)
    best = min(runs, key=lambda r: r["seconds"])
    if args.via_collector:
        print(json.dumps(run_ours_via_collector(db, args.reward)), flush=True)
    summary = {"ours_best_s": best["seconds"], "ours_cpu_s": best["cpu_seconds"],
               "ours_transitions_per_s": best["transitions_per_s"]}
    if args.agl_python:
        export_for_peer(db, work / "peer-spans", args.reward, args.peer_files)
        theirs, peer = run_peer(args.agl_python, work / "peer-spans")
        print(json.dumps(peer), flush=True)
        check = compare(ours, theirs)
        print(json.dumps({"check": check}), flush=True)
        summary.update(agl_s=peer["seconds"], agl_cpu_s=peer["cpu_seconds"], agl_triplets_per_s=peer["triplets_per_s"],
                       speedup_wall=round(peer["seconds"] / best["seconds"], 1),
                       speedup_cpu=round(peer["cpu_seconds"] / best["cpu_seconds"], 1),
                       same_transitions=check["rollouts_that_differ"] == 0)
    print(json.dumps({"summary": summary}), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("POLARS_MAX_THREADS", str(os.cpu_count()))
    sys.exit(main())
