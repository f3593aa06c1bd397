"""The viewer (`lightning-otel view`): its pages over real stores (spans from the real OTel SDK through a real
collector, real DuckDB files), its token rules and refusals over real HTTP on 127.0.0.1, and, in a real browser
(Debian's chromium, headless, driven by selenium), a store made by real rollouts of the bundled model through the
gateway, with its transitions compiled to Parquet."""
from __future__ import annotations

import json
import re
import shutil
import socket
import sys
import threading
from types import SimpleNamespace
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import polars as pl
import pytest

from lightning_otel.cli import main
from lightning_otel.rollouts.runner import RolloutConfig, run_rollouts
from lightning_otel.span_store import client
from lightning_otel.span_store.collector import Collector, CollectorConfig
from lightning_otel.train.transitions.compile import CompileConfig, compile_transitions
from lightning_otel.view.server import MAX_FORM_BYTES, ViewConfig, Viewer, link_to
from tests.helpers.rollout_store import store_rollouts
from tests.helpers.sdk import tracer_provider

TOKENS = {"ingest_token": "in-token", "query_token": "query-token", "admin_token": "admin-token"}
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
COLOUR = re.compile(r"rgba?\((\d+), (\d+), (\d+)(?:, ([\d.]+))?\)")


def fetch(url: str, method: str = "GET", body: bytes | None = None, headers: dict | None = None,
          follow: bool = True) -> tuple[int, dict, str]:
    """(status, headers, text) without raising on 4xx/5xx; redirects are not followed unless `follow`."""
    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None
    opener = urllib.request.build_opener() if follow else urllib.request.build_opener(NoRedirect)
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with opener.open(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


def form(**fields: str) -> bytes:
    return urllib.parse.urlencode(fields).encode()


def expected_colour(advantage: float) -> tuple[int, int, int, float]:
    """docs/viewer.md: green for A >= 0, red below, opacity 0.1 + 0.6 * min(|A| / 2, 1)."""
    alpha = round(0.1 + 0.6 * min(abs(advantage) / 2.0, 1.0), 3)
    return (0, 160, 60, alpha) if advantage >= 0 else (220, 40, 40, alpha)


def parse_colour(text: str) -> tuple[int, int, int, float]:
    match = COLOUR.search(text)
    assert match, text
    r, g, b, a = match.groups()
    return int(r), int(g), int(b), float(a) if a is not None else 1.0


def store_conversation(url: str, rollout_id: str, token: str | None = None) -> None:
    """A rollout split over two traces (as AutoGen splits one): a chat call with its messages and a tool call with
    arguments and a failing result in the first, a second agent turn in another trace with only the rollout id."""
    provider = tracer_provider(url, resource={"service.name": "chat-agent"}, token=token)
    tracer = provider.get_tracer("agent")
    ids = {"lightning.rollout.id": rollout_id, "lightning.task.id": "chat-task"}
    with tracer.start_as_current_span("invoke_agent planner", attributes={
            **ids, "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "planner"}):
        with tracer.start_as_current_span("chat gpt-4o", attributes={
                **ids, "gen_ai.operation.name": "chat",
                "gen_ai.input.messages": json.dumps([{"role": "user", "parts": [
                    {"type": "text", "content": "How many singers <b>are</b> there?"}]}]),
                "gen_ai.output.messages": json.dumps([{"role": "assistant", "parts": [
                    {"type": "tool_call", "name": "run_sql",
                     "arguments": {"query": "SELECT count(*) FROM singer"}}]}])}):
            pass
        with tracer.start_as_current_span("execute_tool run_sql", attributes={
                **ids, "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "run_sql",
                "gen_ai.tool.call.arguments": '{"query": "SELECT count(*) FROM singer"}',
                "gen_ai.tool.call.result": "no such table: singer"}) as tool:
            tool.set_status(trace_status_error("no such table: singer"))
    with tracer.start_as_current_span("invoke_agent critic", attributes={
            **ids, "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "critic"}, context=fresh_context()):
        pass
    provider.shutdown()


def trace_status_error(message: str):
    from opentelemetry.trace import Status, StatusCode
    return Status(StatusCode.ERROR, message)


def fresh_context():
    from opentelemetry import context
    return context.Context()  # no parent: the second agent turn starts a trace of its own


# ---- HTTP-level pages on stores made through a real collector ----------------------------------------------------

def test_rollouts_page_filters_sorts_and_pages(collector, db_path):
    rollouts = {f"r{i:02d}": (f"t{i % 3}", float(i % 2), 1) for i in range(55)}
    rollouts["r-none"] = ("t0", None, 1)
    store_rollouts(collector.url, db_path, rollouts)
    collector.close()  # the viewer reads the file itself now
    with Viewer(ViewConfig(db=db_path, port=0)) as viewer:
        status, headers, text = fetch(viewer.url + "/")
        assert status == 200 and "1–50 of 56 rollouts" in text and 'rel="next"' in text
        assert headers["Content-Security-Policy"].startswith("default-src 'self'")
        assert text.count('href="/rollout/') == 50
        _, _, second = fetch(viewer.url + "/?page=1")
        assert "51–56 of 56 rollouts" in second and second.count('href="/rollout/') == 6
        _, _, task = fetch(viewer.url + "/?task=t1")
        assert "of 18 rollouts" in task and 'href="/rollout/r01"' in task and 'href="/rollout/r00"' not in task
        _, _, high = fetch(viewer.url + "/?reward_min=0.5&reward_max=1")
        assert "of 27 rollouts" in high and 'href="/rollout/r01"' in high and 'href="/rollout/r02"' not in high
        _, _, ordered = fetch(viewer.url + "/?sort=reward&order=asc")
        listed = re.findall(r'href="/rollout/([^"/]+)"', ordered)
        assert listed[0] == "r00" and "r-none" not in listed[:28]  # no reward sorts last
        _, _, by_agent = fetch(viewer.url + "/?agent=solver&version=3")
        assert "of 56 rollouts" in by_agent
        _, _, nobody = fetch(viewer.url + "/?agent=nobody")
        assert "0–0 of 0 rollouts" in nobody


@pytest.mark.heavy
def test_rollout_page_shows_its_tree_across_traces_messages_tools_rewards_and_errors(collector, db_path):
    store_conversation(collector.url, "conv-1")
    store_rollouts(collector.url, db_path, {"r1": ("t1", 1.0, 2)})
    client.write_records(db_path, "rewards", [{"rollout_id": "conv-1", "name": "exec", "value": 0.0,
                                               "source": "function"}])
    collector.close()
    with Viewer(ViewConfig(db=db_path, port=0)) as viewer:
        status, _, text = fetch(viewer.url + "/rollout/conv-1")
        assert status == 200
        assert "4 spans in 2 trace(s)" in text  # the planner, its chat and tool call; the critic in a trace of its own
        assert text.count('class="trace-head"') == 2
        assert "How many singers &lt;b&gt;are&lt;/b&gt; there?" in text  # escaped, never markup
        assert "→ run_sql" in text and "no such table: singer" in text
        assert 'class="err">ERROR' in text and "reward <strong>exec = 0" in text
        assert 'id="feedback"' in text and 'name="admin_token"' in text
        tree = text[text.index('id="tree"'):]
        assert tree.index("invoke_agent planner") < tree.index("chat gpt-4o") < tree.index("invoke_agent critic")
        _, _, scored = fetch(viewer.url + "/rollout/r1")
        assert "rate limited once" in scored and "token record: 3 prompt, 2 completion tokens" in scored
        assert fetch(viewer.url + "/rollout/nope")[0] == 404


def test_transitions_page_colours_each_token_by_the_compiled_advantage(collector, db_path, tmp_path):
    store_rollouts(collector.url, db_path, {"a": ("t1", 1.0, 2), "b": ("t1", 0.0, 1), "c": ("t1", 0.0, 1)})
    collector.close()
    frame, _ = compile_transitions(CompileConfig(db=db_path, reward="exec"))
    parquet = tmp_path / "transitions.parquet"
    frame.write_parquet(parquet)
    with Viewer(ViewConfig(db=db_path, port=0, transitions=parquet)) as viewer:
        for rollout_id in ("a", "b"):
            status, _, text = fetch(viewer.url + f"/rollout/{rollout_id}/transitions")
            assert status == 200
            rows = frame.filter(pl.col("rollout_id") == rollout_id).sort("turn").to_dicts()
            cells = re.findall(r'<span class="tok completion" title="([^"]*)" style="background-color:([^"]*)" '
                               r'data-index="(\d+)" data-token-id="(\d+)" data-advantage="([^"]*)"', text)
            assert len(cells) == sum(len(r["completion_ids"]) for r in rows)
            expected = [(r, i) for r in rows for i in range(len(r["completion_ids"]))]
            for (title, colour, index, token_id, advantage), (row, i) in zip(cells, expected):
                assert int(token_id) == row["completion_ids"][i] and float(advantage) == pytest.approx(row["advantage"])
                assert parse_colour(colour) == expected_colour(row["advantage"])
                assert f"logprob {row['completion_logprobs'][i]:.4g}" in title.replace("&#x27;", "'")
                assert "loss mask 1" in title
            assert 'class="tok prompt"' in text
    # A run folder: each training round wrote its own Parquet (train/trainer.py); rollout a is in round 2's.
    run = tmp_path / "run"
    for r, ids in ((1, ["b", "c"]), (2, ["a"])):
        (run / "rounds" / f"round-{r:04d}").mkdir(parents=True)
        frame.filter(pl.col("rollout_id").is_in(ids)).write_parquet(
            run / "rounds" / f"round-{r:04d}" / "transitions.parquet")
    shutil.copy(db_path, run / "traces.duckdb")
    with Viewer(ViewConfig(run=run, port=0)) as viewer:
        _, _, text = fetch(viewer.url + "/rollout/a/transitions")
        assert "compiled transitions of the run&#x27;s 2 rounds" in text
        shown = [float(v) for v in re.findall(r'data-advantage="([^"]+)"', text)]
        assert shown and set(shown) == {frame.filter(pl.col("rollout_id") == "a")["advantage"][0]}
    # Without a Parquet, the store's transitions view gives the same advantages.
    with Viewer(ViewConfig(db=db_path, port=0)) as viewer:
        _, _, text = fetch(viewer.url + "/rollout/a/transitions")
        shown = sorted({float(v) for v in re.findall(r'data-advantage="([^"]+)"', text)})
        assert shown == pytest.approx([frame.filter(pl.col("rollout_id") == "a")["advantage"][0]])


def test_group_runs_and_compare_pages(collector, db_path, tmp_path):
    store_rollouts(collector.url, db_path, {"g1": ("t1", 1.0, 1), "g2": ("t1", 0.0, 1), "g3": ("t2", 0.0, 1)})
    store_rollouts(collector.url, db_path, {"h1": ("t1", 1.0, 1), "h2": ("t2", 1.0, 1)}, policy_version=4)
    collector.close()
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(db_path, run / "traces.duckdb")
    # Round records as the trainer writes them to metrics.jsonl (train/metrics.py); no training runs here.
    records = [{"phase": "validation", "round": 0, "val_reward_mean": 0.2, "val_accuracy": 0.2}] + [
        {"phase": "grpo", "round": r, "reward_mean": 0.1 * r, "success_rate": 0.1 * r, "policy_version": r - 1,
         "served_policy_versions": [r - 1], "steps": 1, "first_ratio_mean": 1.0, "clip_fraction": 0.01 * r,
         "zero_variance_groups": 3 - r, "rollout_seconds": 10.0 + r, "train_seconds": 5.0} for r in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    with Viewer(ViewConfig(run=run, port=0)) as viewer:
        status, _, group = fetch(viewer.url + "/group?task=t1&version=3")
        assert status == 200 and group.count('class="sample ') == 2
        advantage = 0.5 / (0.5 ** 0.5 + 1e-6)  # rewards 1 and 0: sample std sqrt(1/2)
        assert f'class="adv">{advantage:.4g}' in group and f'class="adv">{-advantage:.4g}' in group
        assert "sample up" in group and "sample down" in group
        _, _, flat = fetch(viewer.url + "/group?task=t2&version=3")
        assert "fewer than two scored samples" in flat
        status, _, rounds = fetch(viewer.url + "/runs")
        assert status == 200 and rounds.count("<svg") == 6 and rounds.count("<polyline") >= 8
        assert "every round was served the checkpoint of the round before" in rounds
        assert re.search(r'<table id="rounds">.*?<td>3</td><td>0.3</td>', rounds, re.S)
        status, _, compare = fetch(viewer.url + "/compare?a=3&b=4")
        assert status == 200
        assert "Paired on the 2 tasks both scored: better on 2, worse on 0, the same on 0" in compare
        assert "<td>0.5</td><td>1</td>" in compare  # t1: one of two right by version 3, one of one by 4
        assert fetch(viewer.url + "/compare")[0] == 200
        assert fetch(viewer.url + "/group?task=t9&version=3")[0] == 404


def test_a_live_store_needs_the_query_token_and_a_score_needs_the_admin_token(make_collector, db_path):
    collector = make_collector(**TOKENS)
    store_rollouts(collector.url, db_path, {"r1": ("t1", 1.0, 1), "r2": ("t1", 0.0, 1)}, token=TOKENS["ingest_token"])
    with Viewer(ViewConfig(db=db_path, port=0)) as viewer:
        assert fetch(viewer.url + "/")[0] == 401
        assert fetch(viewer.url + "/rollout/r1", headers={"Authorization": "Bearer in-token"})[0] == 403
        status, headers, _ = fetch(link_to(viewer, "r1"), follow=False)
        assert status == 303 and headers["Location"] == "/rollout/r1"
        assert "HttpOnly" in headers["Set-Cookie"] and "query-token" in headers["Set-Cookie"]
        cookie = {"Cookie": headers["Set-Cookie"].split(";")[0]}
        status, _, text = fetch(viewer.url + "/", headers=cookie)
        assert status == 200 and "of 2 rollouts" in text
        assert fetch(viewer.url + "/static/viewer.css")[0] == 200  # assets need no token

        def rewards() -> list[dict]:
            return client.query("SELECT rollout_id, span_id, name, value, author, comment FROM rewards "
                                "WHERE source = 'human'", db_path).to_dicts()

        score = dict(name="helpful", value="0.5", comment="clear answer", author="ana", span_id="")
        post = viewer.url + "/rollout/r1/feedback"
        content = {"Content-Type": "application/x-www-form-urlencoded", **cookie}
        status, _, text = fetch(post, "POST", form(**score), content)
        assert status == 401 and "admin token" in text
        status, _, text = fetch(post, "POST", form(**score, admin_token="query-token"), content)
        assert status == 403 and "admin token" in text
        assert fetch(post, "POST", form(**score, admin_token="admin-token"))[0] == 200  # the admin token also reads
        assert rewards() == [{"rollout_id": "r1", "span_id": None, "name": "helpful", "value": 0.5, "author": "ana",
                              "comment": "clear answer"}]
        status, _, text = fetch(post, "POST", form(**{**score, "value": "good"}, admin_token="admin-token"), content)
        assert status == 400 and "is not a number" in text
        status, _, text = fetch(viewer.url + "/rollout/r9/feedback", "POST", form(**score, admin_token="admin-token"),
                                content)
        assert status == 400 and "no rollout" in text
        assert len(rewards()) == 1
        span = client.query("SELECT span_id FROM spans WHERE rollout_id = 'r2' AND name = 'openai.chat'",
                            db_path)["span_id"][0]
        status, _, text = fetch(viewer.url + "/rollout/r2/feedback", "POST",
                                form(**{**score, "span_id": span}, admin_token="admin-token"), content)
        assert status == 200 and f"stored helpful = 0.5 for span {span}" in text
        assert fetch(viewer.url + "/", "POST", b"x=1", content)[0] == 405
        collector.close()  # the viewer now reads the file, and still asks for the token it was opened with
        assert fetch(viewer.url + "/")[0] == 401
        assert "of 2 rollouts" in fetch(viewer.url + "/", headers=cookie)[2]
    with Viewer(ViewConfig(db=db_path, port=0)) as viewer:  # the file, read-only: no scores at all
        status, _, text = fetch(viewer.url + "/rollout/r1/feedback", "POST", form(**score, admin_token="admin-token"))
        assert status == 403 and "read-only" in text
        assert fetch(viewer.url + "/")[0] == 200  # no collector, no token to ask for


def test_malformed_oversized_and_concurrent_requests(collector, db_path):
    store_rollouts(collector.url, db_path, {f"r{i}": ("t1", float(i % 2), 1) for i in range(6)})
    collector.close()
    with Viewer(ViewConfig(db=db_path, port=0)) as viewer:
        for query, needle in [("sort=drop%20table", "sort by one of"), ("order=sideways", "asc or desc"),
                              ("page=-1", "page must be"), ("reward_min=abc", "is not a number"),
                              ("reward_max=nan", "finite"), ("version=1.5", "whole number"),
                              ("task=" + "x" * 600, "over 500 characters")]:
            status, _, text = fetch(viewer.url + "/?" + query)
            assert status == 400 and needle in text, (query, text[-300:])
        _, _, injected = fetch(viewer.url + "/?task=" + urllib.parse.quote("x' OR '1'='1"))
        assert "0–0 of 0 rollouts" in injected
        _, _, placeholder = fetch(viewer.url + "/?task=%24limit")  # a value that looks like the SQL's placeholders
        assert "0–0 of 0 rollouts" in placeholder
        assert fetch(viewer.url + "/nowhere")[0] == 404
        assert fetch(viewer.url + "/static/..%2Fserver.py")[0] == 404
        assert fetch(viewer.url + "/static/server.py")[0] == 404
        assert fetch(viewer.url + "/rollout/r1", "PUT", b"")[0] == 501
        status, _, text = fetch(viewer.url + "/rollout/r1/feedback", "POST", b"x" * (MAX_FORM_BYTES + 1))
        assert status == 413 and "over" in text
        status, _, _ = fetch(viewer.url + "/rollout/r1/feedback", "POST", b"\xff\xfe=\x00",
                             {"Content-Type": "application/x-www-form-urlencoded"})
        assert status in (400, 403)
        with socket.create_connection(viewer.server.server_address[:2], timeout=10) as raw:
            raw.sendall(b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
            assert raw.recv(100).startswith(b"HTTP/1.1 414")
        results: list[int] = []
        paths = ["/", "/rollout/r1", "/rollout/r2/transitions", "/group?task=t1&version=3", "/?sort=reward"] * 4

        def get(path: str) -> None:
            results.append(fetch(viewer.url + path)[0])

        threads = [threading.Thread(target=get, args=(p,)) for p in paths]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results == [200] * len(paths)
        # DNS rebinding: a page of another site whose name resolves to 127.0.0.1 sends its own name as Host
        port = viewer.server.server_address[1]
        for host in (f"evil.example:{port}", "127.0.0.1.nip.io", ""):
            status, _, text = fetch(viewer.url + "/", headers={"Host": host})
            assert status == 403 and "answers requests for localhost or 127.0.0.1 only" in text, host
        assert fetch(viewer.url + "/rollout/r1/feedback", "POST", form(name="x", value="1"),
                     {"Host": "evil.example"})[0] == 403
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "app.localhost"):
            assert fetch(viewer.url + "/", headers={"Host": host})[0] == 200, host


def test_the_view_command_refuses_what_it_cannot_serve(tmp_path, db_path, collector, capsys):
    assert main(["view", "--db", str(tmp_path / "missing.duckdb")]) == 2
    assert "no trace store at" in capsys.readouterr().err
    assert main(["view", "--run", str(tmp_path / "no-run")]) == 2
    assert "no such folder" in capsys.readouterr().err
    store_rollouts(collector.url, db_path, {"r1": ("t1", 1.0, 1)})
    assert main(["view", "--db", str(db_path), "--host", "0.0.0.0", "--port", "0"]) == 2
    assert "reachable from other machines" in capsys.readouterr().err
    assert main(["view", "--db", str(db_path), "--transitions", str(tmp_path / "x.parquet")]) == 2
    assert "no such file" in capsys.readouterr().err


# ---- in a real browser, over a store made by real rollouts of the bundled model -------------------------------

AGENT = Path(__file__).resolve().parent.parent / "examples" / "openai_sql" / "agent.py"
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")


@pytest.fixture(scope="module")
def real_store(engine, tmp_path_factory):
    """Two Spider tasks x 2 samples through the gateway (token records from vLLM), scored by spider_exec and by a
    judge's reward that tells the samples of each task apart (1 for the first, 0 for the second), compiled to
    Parquet on the judge's reward; a live collector with a token per role holds the store."""
    from lightning_otel.tasks.spider.rewards import bundled_data_dir

    folder = tmp_path_factory.mktemp("viewer-real")
    db = folder / "traces.duckdb"
    tasks = folder / "tasks.jsonl"
    rows = [json.loads(line) for line in (bundled_data_dir() / "dev.jsonl").read_text().splitlines()
            if json.loads(line)["db_id"] == "singer"][:2]
    tasks.write_text("".join(json.dumps(r) + "\n" for r in rows))
    collector = Collector(CollectorConfig(db=db, port=0, **TOKENS))
    collector.start()
    try:
        engine.use_base()
        summary = run_rollouts(RolloutConfig(
            tasks=tasks, agent=f"{sys.executable} {AGENT} --question {{question}} --db {{db_path}}", n=2,
            concurrency=4, db=db, reward="spider_exec", rollout_timeout_s=120, max_tokens=24), engine=engine)
        assert [r.status for r in summary.results] == ["ok"] * 4
        client.write_records(db, "rewards", [{"rollout_id": r.rollout_id, "name": "judge", "source": "function",
                                              "value": 1.0 if r.attempt == 0 else 0.0} for r in summary.results])
        frame, _ = compile_transitions(CompileConfig(db=db, reward="judge"))
        assert frame.height >= 4 and set(frame["advantage"].round(3)) == {0.707, -0.707}
        parquet = folder / "transitions.parquet"
        frame.write_parquet(parquet)
        with Viewer(ViewConfig(db=db, port=0, transitions=parquet, reward="judge")) as viewer:
            yield SimpleNamespace(db=db, viewer=viewer, frame=frame, results=summary.results,
                                  task_questions=[r["question"] for r in rows])
    finally:
        collector.close()


@pytest.fixture(scope="module")
def browser():
    """One headless Debian chromium for the module (`make browser` installs it with its driver)."""
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.fail("chromium and chromedriver are missing: run `make browser` (apt-get install chromium "
                    "chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     "--window-size=1400,1000", "--disable-extensions"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(60)
    ARTIFACTS.mkdir(exist_ok=True)
    yield driver
    driver.quit()


def test_browser_the_rollouts_page_lists_the_real_rollouts(real_store, browser):
    from selenium.webdriver.common.by import By

    browser.get(link_to(real_store.viewer))  # carries the query token once; the page keeps it in a cookie
    assert "token=" not in browser.current_url
    rows = browser.find_elements(By.CSS_SELECTOR, "#rollouts tbody tr")
    listed = {row.find_element(By.CSS_SELECTOR, "td a").text for row in rows}
    assert listed == {r.rollout_id for r in real_store.results}
    assert "of 4 rollouts" in browser.find_element(By.CSS_SELECTOR, ".pager").text
    browser.save_screenshot(str(ARTIFACTS / "viewer-rollouts.png"))
    header = browser.find_element(By.LINK_TEXT, "reward (judge)")
    header.click()  # sort by the judge's reward, then filter to the rewarded ones
    browser.get(real_store.viewer.url + "/?reward=judge&reward_min=1")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#rollouts tbody tr")) == 2


def test_browser_a_rollout_page_shows_its_tree_and_messages(real_store, browser):
    from selenium.webdriver.common.by import By

    rollout = real_store.results[0]
    browser.get(real_store.viewer.url + f"/rollout/{rollout.rollout_id}")
    spans = client.query(f"SELECT count(*) AS n FROM spans WHERE rollout_id = '{rollout.rollout_id}'",
                         real_store.db)["n"][0]
    assert len(browser.find_elements(By.CSS_SELECTOR, "#tree details.span")) >= spans
    assert browser.find_elements(By.CSS_SELECTOR, "#tree details.span.llm")
    messages = " ".join(m.text for m in browser.find_elements(By.CSS_SELECTOR, ".messages .msg"))
    assert any(question in messages for question in real_store.task_questions), messages[:500]
    assert "ASSISTANT" in messages.upper()
    browser.find_element(By.XPATH, "//button[text()='collapse all']").click()
    assert not any(d.get_attribute("open") for d in browser.find_elements(By.CSS_SELECTOR, "#tree details.span"))
    browser.find_element(By.XPATH, "//button[text()='expand all']").click()
    browser.save_screenshot(str(ARTIFACTS / "viewer-rollout.png"))


def test_browser_the_transitions_page_colours_tokens_by_the_stored_advantage(real_store, browser):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    for result in [next(r for r in real_store.results if r.attempt == a) for a in (0, 1)]:  # pushed up, down
        rows = real_store.frame.filter(pl.col("rollout_id") == result.rollout_id).sort("turn").to_dicts()
        browser.get(real_store.viewer.url + f"/rollout/{result.rollout_id}/transitions")
        cells = browser.find_elements(By.CSS_SELECTOR, "#transitions .transition")[0].find_elements(
            By.CSS_SELECTOR, ".tok.completion")
        first = rows[0]
        assert len(cells) == len(first["completion_ids"])
        for index in (0, len(cells) // 2, len(cells) - 1):
            shown = parse_colour(cells[index].value_of_css_property("background-color"))
            want = expected_colour(first["advantage"])
            assert shown[:3] == want[:3] and shown[3] == pytest.approx(want[3], abs=0.01)
            assert int(cells[index].get_attribute("data-token-id")) == first["completion_ids"][index]
            assert f"logprob {first['completion_logprobs'][index]:.4g}" in cells[index].get_attribute("title")
        ActionChains(browser).move_to_element(cells[0]).perform()
        assert "loss mask 1" in browser.find_element(By.ID, "token-info").text
        assert browser.find_elements(By.CSS_SELECTOR, ".tok.prompt")
        browser.save_screenshot(str(ARTIFACTS / f"viewer-transitions-{result.attempt}.png"))
