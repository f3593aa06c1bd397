"""Peer benchmark: Microsoft Agent Lightning's span-to-triplet adapter (TracerTraceToTriplet) over our spans.

Run with the Agent Lightning venv's python (see README.md in this folder), never the project's; the
project's benchmarks/compile_throughput.py starts it and exports its input:

    /work/venvs/agl/bin/python benchmarks/peers/agentlightning_triplets.py --spans DIR --rewards FILE --out DIR

Input: the store's spans as Parquet files (DIR/*.parquet, each holding whole rollouts, rows ordered by
rollout and start time; attributes and resource as JSON text) and the episode rewards (rollout_id, name,
reward). Timed, file by file: reading the Parquet, converting every span to Agent Lightning's `Span`
type (pydantic), and per rollout `TracerTraceToTriplet().adapt(spans)` plus the final reward as its
training daemon takes it (the last triplet reward found, searching backwards), given to every triplet.

What the conversion must add, because Agent Lightning reads these from other places than we record them:
- token ids: its adapter reads `prompt_token_ids` / `response_token_ids` attributes of the LLM call span
  (its own instrumentation puts them there); our gateway records them in a `lightning.generate` child
  span, so they are copied onto the parent LLM span (choice 0) and the record itself is dropped;
- the episode reward: its adapter reads reward spans (`emit_reward` makes `agentlightning.annotation`
  spans with `agentlightning.reward.0.name/value`); our rewards are rows, so each becomes one such span,
  placed after the rollout's last span, as an agent emitting its reward at the end would.
LLM call spans are matched by name (`openai.chat`, `ChatOpenAI.chat`, `chat <model>`): the names the real
instrumentations give them (its default pattern matches AgentOps' `openai.chat.completion`).

Writes one Parquet row per triplet (rollout_id, index, prompt_ids, completion_ids, reward), a file per input
file and off the clock, and prints one JSON line with the timing. Self-contained: it does not import lightning_otel.
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging
import time
from importlib.metadata import version as pkg_version
from operator import itemgetter
from pathlib import Path

import orjson
import polars as pl
from agentlightning.adapter.triplet import TracerTraceToTriplet
from agentlightning.types import OtelResource, Span, TraceStatus

LLM_CALL_MATCH = r"^(openai\.chat|ChatOpenAI\.chat|chat .+)$"
GENERATE = "lightning.generate"
STATUS = {"OK": "OK", "ERROR": "ERROR"}
SCHEMA = {"rollout_id": pl.String, "index": pl.Int32, "prompt_ids": pl.List(pl.Int32),
          "completion_ids": pl.List(pl.Int32), "reward": pl.Float64}


def to_spans(rollout_id: str, rows: list[dict], reward: tuple[str, float] | None) -> list[Span]:
    """Our span rows of one rollout -> Agent Lightning spans, token ids and the reward where it reads them."""
    attributes = [orjson.loads(r["attributes"]) if r["attributes"] else {} for r in rows]
    by_id = {r["span_id"]: a for r, a in zip(rows, attributes)}
    keep = []
    for row, attrs in zip(rows, attributes):
        if row["name"] == GENERATE:
            parent = by_id.get(row["parent_span_id"])
            if parent is not None and int(attrs.get("lightning.choice.index", 0)) == 0:
                parent["prompt_token_ids"] = attrs.get("lightning.prompt.token_ids")
                parent["response_token_ids"] = attrs.get("lightning.completion.token_ids")
            continue
        keep.append((row, attrs))
    spans = []
    for sequence, (row, attrs) in enumerate(keep):
        resource = orjson.loads(row["resource"]) if row["resource"] else {}
        spans.append(Span.from_attributes(
            attributes=attrs, rollout_id=rollout_id, attempt_id="at-0", sequence_id=sequence, name=row["name"],
            trace_id=row["trace_id"], span_id=row["span_id"], parent_id=row["parent_span_id"],
            start_time=row["start_ns"] / 1e9, end_time=row["end_ns"] / 1e9,
            resource=OtelResource(attributes=resource, schema_url=""),
            status=TraceStatus(status_code=STATUS.get(row["status_code"] or "", "UNSET"),
                               description=row["status_message"])))
    if reward is not None:
        end = max(r["end_ns"] for r in rows) / 1e9
        spans.append(Span.from_attributes(
            attributes={"agentlightning.reward.0.name": reward[0], "agentlightning.reward.0.value": reward[1]},
            rollout_id=rollout_id, attempt_id="at-0", sequence_id=len(spans), name="agentlightning.annotation",
            trace_id=rows[-1]["trace_id"], start_time=end, end_time=end))
    return spans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spans", type=Path, required=True, help="folder of Parquet files of span rows")
    parser.add_argument("--rewards", type=Path, required=True, help="Parquet file: rollout_id, name, reward")
    parser.add_argument("--out", type=Path, required=True, help="folder for the triplets (Parquet)")
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # the adapter warns per span without token ids; printing is not the work
    rewards = {r["rollout_id"]: (r["name"], r["reward"]) for r in pl.read_parquet(args.rewards).to_dicts()}
    adapter = TracerTraceToTriplet(llm_call_match=LLM_CALL_MATCH)
    args.out.mkdir(parents=True, exist_ok=True)
    spans_seen = rollouts = triplets_total = 0
    read_s = convert_s = adapt_s = write_s = write_cpu_s = 0.0
    started, cpu_started = time.perf_counter(), time.process_time()
    for number, path in enumerate(sorted(args.spans.glob("*.parquet"))):
        t0 = time.perf_counter()
        rows = pl.read_parquet(path).to_dicts()
        read_s += time.perf_counter() - t0
        spans_seen += len(rows)
        out: dict[str, list] = {"rollout_id": [], "index": [], "prompt_ids": [], "completion_ids": [], "reward": []}
        for rollout_id, group in itertools.groupby(rows, key=itemgetter("rollout_id")):
            t0 = time.perf_counter()
            spans = to_spans(rollout_id, list(group), rewards.get(rollout_id))
            t1 = time.perf_counter()
            triplets = adapter.adapt(spans)
            final = next((t.reward for t in reversed(triplets) if t.reward is not None), None)
            adapt_s += time.perf_counter() - t1
            convert_s += t1 - t0
            rollouts += 1
            for index, triplet in enumerate(triplets):
                out["rollout_id"].append(rollout_id)
                out["index"].append(index)
                out["prompt_ids"].append(triplet.prompt.get("token_ids") or [])
                out["completion_ids"].append(triplet.response.get("token_ids") or [])
                out["reward"].append(final)
        del rows
        # Saving the triplets for the comparison is not the peer's work: off the clock.
        t0, c0 = time.perf_counter(), time.process_time()
        triplets_total += len(out["index"])
        pl.DataFrame(out, schema=SCHEMA).write_parquet(args.out / f"part-{number:03d}.parquet")
        write_s += time.perf_counter() - t0
        write_cpu_s += time.process_time() - c0
    seconds = time.perf_counter() - started - write_s
    cpu_seconds = time.process_time() - cpu_started - write_cpu_s
    print(json.dumps({"peer": "agentlightning", "version": pkg_version("agentlightning"), "spans": spans_seen,
                      "rollouts": rollouts, "triplets": triplets_total, "seconds": round(seconds, 3),
                      "cpu_seconds": round(cpu_seconds, 3),
                      "read_s": round(read_s, 3), "convert_s": round(convert_s, 3), "adapt_s": round(adapt_s, 3),
                      "triplets_per_s": round(triplets_total / seconds, 1)}))


if __name__ == "__main__":
    main()
