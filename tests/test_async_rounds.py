"""Async rounds (`max_staleness`, train/async_rounds.py) and the engine's pause/drain/swap (serve/gate.py).

The gate on its own with real threads; the gate wired into the real gateway server (real HTTP on 127.0.0.1)
in front of a stand-in engine whose generation the test holds open, so a swap can be caught with a request in
flight (the real engine cannot be held mid-request); the background rounds and the staleness filter on
hand-built cases; then, on the real engine, a k=1 run (and a k=1 run killed while the next round's rollouts
run in the background, then resumed) that must draw the same tasks in the same order as k=0, with every
record at most one policy version behind."""
from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import polars as pl
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from lightning_otel.errors import UserError
from lightning_otel.rollouts.runner import load_tasks
from lightning_otel.serve.gate import SwapGate
from lightning_otel.serve.gateway import GENERATE_SPAN, Gateway, GatewayConfig
from lightning_otel.train.async_rounds import RoundsAhead, drop_stale_groups, staleness
from lightning_otel.train.config import TrainConfig
from lightning_otel.train.pool import round_tasks
from test_train import BIN, BY_KIND, ONE_CALL, REPO, kind_tasks, killed_once

pytestmark = pytest.mark.usefixtures("plain_sdk_agents")  # its agents use the plain OpenAI SDK (conftest.py)

BOUND_S = 20.0  # far above what any wait here takes


def until(condition, timeout: float = BOUND_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


# ---- the gate ------------------------------------------------------------------------------------------


def test_a_swap_waits_for_the_requests_in_flight_and_holds_the_new_ones():
    gate, events, version = SwapGate(), [], [0]
    release = threading.Event()

    def request(name: str, hold: threading.Event | None = None) -> None:
        with gate.request():
            seen = version[0]
            events.append(f"{name} starts")
            if hold is not None:
                hold.wait(BOUND_S)
            events.append(f"{name} ends on v{seen}, v{version[0]} now")

    def swap() -> None:
        with gate.swap():
            events.append("swap")
            version[0] = 1

    first = threading.Thread(target=request, args=("a", release))
    first.start()
    until(lambda: gate.in_flight == 1)
    swapper = threading.Thread(target=swap)
    swapper.start()
    until(lambda: gate._swapping)
    second = threading.Thread(target=request, args=("b",))
    second.start()
    time.sleep(0.2)
    assert events == ["a starts"]  # the swap waits for a; b waits for the swap (queued, not refused)
    release.set()
    for thread in (first, swapper, second):
        thread.join(BOUND_S)
    assert events == ["a starts", "a ends on v0, v0 now", "swap", "b starts", "b ends on v1, v1 now"]
    assert (gate.swaps, gate.drained, gate.held, gate.in_flight) == (1, 1, 1, 0)


def test_under_load_every_request_runs_on_one_version():
    gate, version, seen, lock = SwapGate(), [0], [], threading.Lock()

    def requests() -> None:
        for i in range(40):
            with gate.request():
                start = version[0]
                time.sleep(0.001 * (i % 3))
                with lock:
                    seen.append((start, version[0]))

    workers = [threading.Thread(target=requests) for _ in range(6)]
    for worker in workers:
        worker.start()
    for v in range(1, 11):
        with gate.swap():
            version[0] = v
        time.sleep(0.003)
    for worker in workers:
        worker.join(BOUND_S)
    assert len(seen) == 240 and all(start == end for start, end in seen)
    assert gate.swaps == 10


class HeldEngine:
    """A stand-in engine whose generation waits for the test's `release`; `policy_version` is what a swap sets."""
    name, policy_version, model_name = "stand-in", 0, "policy"

    def __init__(self):
        self.release, self.entered = threading.Event(), threading.Event()

    def generate(self, path: str, body: dict, timeout: float = 600) -> dict:
        self.entered.set()
        self.release.wait(BOUND_S)
        text = body["messages"][-1]["content"]
        return {"id": f"chatcmpl-{text}", "prompt_token_ids": [1, 2],
                "choices": [{"index": 0, "message": {"content": text}, "finish_reason": "stop", "token_ids": [7],
                             "logprobs": {"content": [{"token": text, "logprob": -0.5}]}}]}


def post_chat(url: str, text: str, out: dict) -> None:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()
    request = urllib.request.Request(url + "/chat/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=BOUND_S) as response:
        out[text] = (json.loads(response.read()), time.monotonic())


def test_the_gateway_drains_before_a_swap_and_records_each_call_under_the_version_that_served_it():
    engine, gate = HeldEngine(), SwapGate()
    gateway = Gateway(engine, GatewayConfig(), gate)
    spans = InMemorySpanExporter()
    gateway.provider.add_span_processor(SimpleSpanProcessor(spans))
    gateway.start()
    try:
        answers: dict = {}
        first = threading.Thread(target=post_chat, args=(gateway.base_url("ro-a"), "old", answers))
        first.start()
        assert engine.entered.wait(BOUND_S)
        swapped = {}

        def swap() -> None:
            with gate.swap():
                swapped["at"] = time.time_ns()
                engine.policy_version = 1

        swapper = threading.Thread(target=swap)
        swapper.start()
        until(lambda: gate._swapping)
        second = threading.Thread(target=post_chat, args=(gateway.base_url("ro-b"), "new", answers))
        second.start()
        until(lambda: gate.held == 1)  # the new request waits at the gate, its connection open
        assert "at" not in swapped and not answers
        engine.release.set()
        for thread in (first, swapper, second):
            thread.join(BOUND_S)
        assert answers["new"][0]["choices"][0]["message"]["content"] == "new"
        gateway.flush()
        records = {s.attributes["lightning.rollout.id"]: s for s in spans.get_finished_spans()
                   if s.name == GENERATE_SPAN}
        assert {k: s.attributes["lightning.policy.version"] for k, s in records.items()} == {"ro-a": 0, "ro-b": 1}
        # the old call was generated and recorded before the swap, the new one after it
        assert records["ro-a"].end_time <= swapped["at"] <= records["ro-b"].start_time
    finally:
        engine.release.set()
        gateway.close()


# ---- the background rounds and the staleness filter ----------------------------------------------------


def test_rounds_run_ahead_in_order_and_an_error_there_surfaces_with_its_round():
    ran, stops = [], []

    def run_round(r: int, stop: threading.Event) -> str:
        ran.append(r)
        stops.append(stop)
        if r == 2:
            raise ValueError("the agent broke")
        return f"summary {r}"

    ahead = RoundsAhead(run_round)
    ahead.schedule([1, 2, 3])
    assert ahead.take(1).summary == "summary 1" and ahead.take(0) is None
    with pytest.raises(RuntimeError, match=r"the rollouts of round 3, run in the background \(max_staleness\) "
                                           r"failed: ValueError: the agent broke"):
        ahead.take(2)
    ahead.close()
    assert ran == [1, 2] and stops[0].is_set()  # round 3 never ran after round 2's error


def test_closing_skips_the_rounds_not_begun_and_waits_for_the_running_one():
    started, finish = threading.Event(), threading.Event()

    def run_round(r: int, stop: threading.Event) -> int:
        started.set()
        finish.wait(BOUND_S)
        return r

    ahead = RoundsAhead(run_round)
    ahead.schedule([1, 2])
    assert started.wait(BOUND_S) and ahead.busy
    threading.Timer(0.2, finish.set).start()
    ahead.close()
    assert not ahead.busy and not ahead._thread.is_alive()


def test_staleness_and_the_groups_too_old_to_train_on():
    versions = pl.DataFrame({"rollout_id": ["a", "a", "b", "c", "d"], "policy_version": [3, 2, 3, 1, 3],
                             "tokens": [5, 7, 4, 6, 2]})
    assert staleness(versions, 3) == {"staleness": {"0": 3, "1": 1, "2": 1},
                                      "staleness_tokens": {"0": 11, "1": 7, "2": 6}}
    frame = pl.DataFrame({"rollout_id": ["a", "a", "b", "c", "d"], "task_id": ["t1", "t1", "t1", "t2", "t2"],
                          "policy_version": [2, 2, 2, 2, 2]})
    kept, dropped = drop_stale_groups(frame, versions, current=3, max_staleness=1)
    assert dropped == 1 and kept["rollout_id"].to_list() == ["a", "a", "b"]  # c is 2 behind: t2's group goes
    kept, dropped = drop_stale_groups(frame, versions, current=3, max_staleness=2)
    assert dropped == 0 and kept.height == 5


def test_async_rounds_need_tis_cap_and_no_sleep_mode():
    assert TrainConfig(max_staleness=1, tis_cap=2.0).max_staleness == 1
    with pytest.raises(UserError, match="max_staleness = 2: .* set tis_cap .*e.g. tis_cap = 2.0"):
        TrainConfig(max_staleness=2)
    with pytest.raises(UserError, match="max_staleness = 1 with sleep_mode: .* choose one"):
        TrainConfig(max_staleness=1, tis_cap=2.0, sleep_mode=True)


# ---- on the real engine --------------------------------------------------------------------------------


def check_async_run(run: Path, tasks: Path, seed: int, per_round: int, n: int, rounds: int) -> list[dict]:
    """Each round drew the tasks k=0 draws, in its order, ran each n times, and no record is more than one
    version behind the policy its round trained; the rounds after the first ran their rollouts in the
    background (but for a round resumed after a kill, which runs its own)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == list(range(1, rounds + 1))
    for r, record in enumerate(records):
        expected = [t.task_id for t in round_tasks(load_tasks(tasks), r, per_round, seed)]
        drawn = [json.loads(line)["id"] for line in
                 (run / "rounds" / f"round-{r + 1:04d}" / "tasks.jsonl").read_text().splitlines()]
        assert drawn == expected
        assert record["rollouts"] == per_round * n  # the killed run's partial rollouts are not counted
        assert set(record["staleness"]) <= {"0", "1"} and sum(record["staleness"].values()) >= per_round * n
        assert record["stale_dropped_groups"] == 0 and "tis_truncated_fraction" in record
        assert set(record["served_policy_versions"]) <= {record["policy_version"] - 1, record["policy_version"]}
    assert set(records[0]["staleness"]) == {"0"} and not records[0]["rollouts_in_background"]  # it runs alone
    assert records[-1]["rollouts_in_background"] and records[0]["swap_seconds"] is not None
    return records


@pytest.mark.needs_engine
def test_a_k1_run_killed_while_the_next_rounds_rollouts_run_resumes(engine, tmp_path):
    # One run for both checks the issue asks of k=1 (a run costs minutes of CI): every round draws the tasks
    # k=0 draws, in its order, with records at most one version behind (check_async_run), and a kill while the
    # next round's rollouts run in the background resumes at the round it had not committed.
    tasks = kind_tasks(tmp_path / "tasks.jsonl", ["half"] * 4)  # every group varies: each round takes a step
    run = tmp_path / "run"
    command = [str(BIN / "lightning-otel"), "train", f"tasks={tasks}", f"agent={ONE_CALL}", f"reward={BY_KIND}",
               "n=2", "tasks_per_round=2", "rounds=3", "batch_size=16", "micro_batch=4",
               "max_tokens=8", "lora_rank=8", "max_staleness=1", "tis_cap=2.0",
               f"output_dir={run}", f"engine_url={engine.url}", "seed=3", "concurrency=4"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # round 3's task file appears when its rollouts start in the background, as round 2 starts training
    killed_once(command, run / "rounds" / "round-0003" / "tasks.jsonl", env)
    killed_at = json.loads((run / "run.json").read_text())
    assert killed_at["rounds_completed"] == 1 and killed_at["policy_version"] == 1
    second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    assert "resuming" in second.stdout and "at round 2 of 3" in second.stdout, second.stdout[-2000:]
    state = json.loads((run / "run.json").read_text())
    assert state["rounds_completed"] == 3 and state["policy_version"] == 3
    records = check_async_run(run, tasks, 3, 2, 2, rounds=3)
    assert not records[1]["rollouts_in_background"]  # the resumed round ran its rollouts again, itself
    assert records[2]["optimizer_steps_total"] == records[0]["steps"] + records[1]["steps"] + records[2]["steps"]
