"""A task's group (its samples side by side, their rewards and the group's advantage), a run's rounds (curves
from the run folder's metrics.jsonl, the loop checks, zero-variance groups, time per phase) and two policy
versions compared on the same tasks (the eval report's paired outcome)."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from lightning_otel.eval.loop_check import round_curve, served_each_round
from lightning_otel.eval.report import paired_comparison, paired_line
from lightning_otel.train.transitions.credit import EPS
from lightning_otel.view import queries
from lightning_otel.view.html import esc, fmt, line_chart, link, rollout_url, table, url
from lightning_otel.view.pages import NotFound, chosen_reward, render_messages
from lightning_otel.view.source import StoreSource, literal


def group_advantages(rewards: dict[str, float | None]) -> tuple[dict[str, float | None], float | None]:
    """Per rollout A = (R - mean) / (sample std + eps) over the scored members (credit.py's per-rollout
    advantage); None for all when fewer than two are scored or their rewards are all equal (no gradient)."""
    scored = {k: v for k, v in rewards.items() if v is not None}
    if len(scored) < 2:
        return dict.fromkeys(rewards), None
    mean, spread = statistics.fmean(scored.values()), statistics.stdev(scored.values())
    if spread == 0:
        return dict.fromkeys(rewards), 0.0
    return {k: (None if v is None else (v - mean) / (spread + EPS)) for k, v in rewards.items()}, spread


def group_page(source: StoreSource, params: dict[str, str], default_reward: str | None) -> str:
    task = params.get("task")
    if not task:
        raise queries.BadRequest("give the task: /group?task=ID (and version=N)")
    version = queries.number(params, "version", integer=True)
    reward, names = chosen_reward(source, params, default_reward)
    test = "r.policy_version IS NULL" if version is None else f"r.policy_version = {int(version)}"
    frame = source.query(queries.fill(queries.SQL_GROUP, task=literal(task), version_test=test,
                                      reward=literal(reward or "")))
    if not frame.height:
        raise NotFound(f"no rollouts of task {task!r} by policy version {version} in this store")
    rows = frame.to_dicts()
    advantages, spread = group_advantages({r["rollout_id"]: r["reward"] for r in rows})
    ids = ", ".join(literal(r["rollout_id"]) for r in rows)
    outputs = dict(source.query(queries.fill(queries.SQL_LAST_OUTPUTS, ids=ids)).iter_rows())
    verdict = ("zero reward variance: this group gives no gradient" if spread == 0 else
               "fewer than two scored samples: no advantage" if spread is None else
               f"reward std {spread:.3g}: samples above the group mean are pushed up, below it down")
    cards = []
    for r in rows:
        a = advantages[r["rollout_id"]]
        tone = "up" if a is not None and a > 0 else "down" if a is not None and a < 0 else "flat"
        answer = outputs.get(r["rollout_id"])
        cards.append(
            f'<article class="sample {tone}" data-rollout-id="{esc(r["rollout_id"])}"><h3>sample {esc(r["attempt"])}'
            f' · {link(rollout_url(r["rollout_id"]), r["rollout_id"])}</h3>'
            f'<p>reward <strong>{esc(fmt(r["reward"]))}</strong> · '
            f'advantage <strong class="adv">{esc(fmt(a, 4))}</strong>'
            f' · {esc(r["status"] or "–")} · {esc(fmt(r["duration_s"]))} s</p>'
            f'<p class="final">final output: <code>{esc(r["final_output"] or "–")}</code></p>'
            f'{render_messages(answer, "output") if answer else ""}'
            f'<p>{link(rollout_url(r["rollout_id"], "/transitions"), "tokens")}</p></article>')
    task_row = source.query(queries.fill(queries.SQL_TASK, id=literal(task)))
    fields = f'<details><summary>task fields</summary><pre>{esc(task_row["fields"][0])}</pre></details>' \
        if task_row.height else ""
    picker = " ".join(link(url("/group", task=task, version=version, reward=n), n) for n in names)
    return (f'<p>task <strong>{esc(task)}</strong> · policy version {esc(fmt(version))} · reward {esc(reward)} '
            f'<span class="muted">(other rewards: {picker or "none"})</span></p>{fields}'
            f'<p class="verdict">{esc(verdict)}</p><div class="samples">{"".join(cards)}</div>')


# ---- runs and rounds ----------------------------------------------------------------------------------------

def _records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    out = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written while the page is read
        if isinstance(record, dict):
            out.append(record)
    return out


def runs_page(run: Path | None) -> str:
    if run is None or not (run / "metrics.jsonl").is_file():
        where = f"{run}/metrics.jsonl" if run else "no run folder"
        return (f'<p class="muted">No round metrics ({esc(where)}): start the viewer with --run RUN_FOLDER (the '
                f'output_dir of `lightning-otel train`) to see its curves.</p>')
    curve = round_curve(run)
    records = _records(run)

    def series(key: str, points: list[dict] = curve) -> list[tuple[float, float]]:
        return [(p["round"], float(p[key])) for p in points if isinstance(p.get(key), (int, float))]

    validation = [r for r in records if r.get("val_reward_mean") is not None]
    charts = [
        line_chart("reward per round", {"reward mean": series("reward_mean")}, chart_id="chart-reward"),
        line_chart("success per round", {"success rate": [(r["round"], float(r["success_rate"])) for r in records
                                                          if r.get("phase") == "grpo"
                                                          and isinstance(r.get("success_rate"), (int, float))]},
                   chart_id="chart-success"),
        line_chart("validation", {"val reward mean": series("val_reward_mean", validation),
                                  "val accuracy": series("val_accuracy", validation)}, chart_id="chart-validation"),
        line_chart("loop checks", {"first ratio mean": series("first_ratio_mean"),
                                   "clip fraction": series("clip_fraction")}, chart_id="chart-loop"),
        line_chart("zero-variance groups", {"groups": series("zero_variance_groups")}, chart_id="chart-zero"),
        line_chart("seconds per phase", {"rollout": series("rollout_seconds"), "train": series("train_seconds")},
                   chart_id="chart-time"),
    ]
    rows = [[esc(p["round"]), esc(fmt(p.get("reward_mean"))), esc(fmt(p.get("val_reward_mean"))),
             esc(fmt(p.get("policy_version"))), esc(fmt(p.get("served_policy_versions"))),
             esc(fmt(p.get("first_ratio_mean"))), esc(fmt(p.get("clip_fraction"))),
             esc(fmt(p.get("zero_variance_groups"))), esc(fmt(p.get("rollout_seconds"))),
             esc(fmt(p.get("train_seconds"))),
             link(url("/", version=p.get("served_policy_versions", [None])[0]
                      if isinstance(p.get("served_policy_versions"), list) and p.get("served_policy_versions") else
                      p.get("policy_version")), "rollouts")] for p in curve]
    served = served_each_round(curve)
    check = ("every round was served the checkpoint of the round before" if served else
             "a round was not served the previous round's checkpoint (or no round recorded its served version)")
    return (f'<p>run folder <code>{esc(run)}</code> · {len(curve)} rounds · '
            f'<span class="{"ok" if served else "err"}">'
            f'{esc(check)}</span></p><div class="charts">{"".join(charts)}</div>'
            + table(["round", "reward", "val reward", "version", "served", "first ratio", "clip fraction",
                     "zero-variance groups", "rollout s", "train s", ""], rows, "rounds"))


# ---- compare two policy versions ------------------------------------------------------------------------------

def compare_page(source: StoreSource, params: dict[str, str], default_reward: str | None) -> str:
    versions = [str(v) for v in source.query(queries.SQL_VERSIONS)["policy_version"].to_list()]
    a = queries.number(params, "a", integer=True)
    b = queries.number(params, "b", integer=True)
    reward, names = chosen_reward(source, params, default_reward)
    form = ('<form method="get" action="/compare">'
            + "".join(f'<label>{n} <select name="{n}">' + "".join(
                f'<option{" selected" if v == str(value) else ""}>{esc(v)}</option>' for v in versions)
                + "</select></label>" for n, value in (("a", a), ("b", b)))
            + f'<input type="hidden" name="reward" value="{esc(reward or "")}"><button>compare</button></form>')
    if a is None or b is None:
        return form + f'<p class="muted">Pick two policy versions (stored: {esc(", ".join(versions) or "none")}).</p>'
    frame = source.query(queries.fill(queries.SQL_VERSION_OUTCOMES, a=str(int(a)), b=str(int(b)),
                                      reward=literal(reward or "")))
    episodes: dict[int, list[dict]] = {int(a): [], int(b): []}
    for row in frame.iter_rows(named=True):
        episodes[int(row["policy_version"])].append({"task_id": row["task_id"], "reward": row["reward"]})
    summary_b, summary_a = {"episodes": episodes[int(b)]}, {"episodes": episodes[int(a)]}
    paired = paired_comparison(summary_b, summary_a)
    rates: dict[str, dict[int, list[float]]] = {}
    for version, items in episodes.items():
        for item in items:
            rates.setdefault(item["task_id"], {}).setdefault(version, []).append(item["reward"])
    rows = []
    for task, by_version in sorted(rates.items()):
        share = {v: (sum(x == 1.0 for x in xs) / len(xs) if xs else None) for v, xs in by_version.items()}
        left, right = share.get(int(a)), share.get(int(b))
        change = ("–" if left is None or right is None else "better" if right > left else
                  "worse" if right < left else "same")
        rows.append([link(url("/group", task=task, version=b, reward=reward), task), esc(fmt(left)), esc(fmt(right)),
                     f'<span class="{change}">{esc(change)}</span>'])
    return (form + f'<p id="paired">Version {esc(b)} against version {esc(a)} (reward {esc(reward)}): '
            f'{esc(paired_line(paired))}</p>'
            + table(["task", f"right share, version {esc(a)}", f"right share, version {esc(b)}",
                     f"{esc(b)} vs {esc(a)}"], rows, "compare"))
