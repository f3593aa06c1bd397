"""The evaluation report: summary.json (every number, the config, the policy), report.md (tables) and the
PNG plots (eval/plots.py). A baseline is another report's summary.json, compared metric by metric and task by
task."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterable

from lightning_otel.errors import UserError
from lightning_otel.eval.metrics import accuracy_groups, group_field, merged_groups, sign_test_p

log = logging.getLogger(__name__)
SUMMARY = "summary.json"
REPORT = "report.md"


def read_summary(report_dir: Path) -> dict:
    """Another evaluation's summary, for --baseline."""
    path = Path(report_dir) / SUMMARY
    if not path.is_file():
        raise UserError(f"--baseline {report_dir}: no {SUMMARY} there; give the --report folder of an earlier "
                        f"`lightning-otel eval`")
    try:
        summary = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not JSON ({exc.msg})") from None
    if not isinstance(summary, dict) or "accuracy" not in summary:
        raise UserError(f"{path} is not an evaluation summary (no 'accuracy')")
    return summary


def read_rounds(run_dir: Path | None) -> list[dict]:
    """Per-round training metrics of a run (metrics.jsonl lines with `round` and `reward_mean`, and `phase`
    "grpo" when there is a phase); [] if none."""
    if run_dir is None or not (run_dir / "metrics.jsonl").is_file():
        return []
    rounds = []
    for number, line in enumerate((run_dir / "metrics.jsonl").read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            log.warning("%s:%d: not JSON, skipped", run_dir / "metrics.jsonl", number)
            continue
        if not isinstance(row, dict) or row.get("phase", "grpo") != "grpo":
            continue  # SFT warm-start lines and the like are not rollout rounds
        if row.get("round") is not None and row.get("reward_mean") is not None:
            rounds.append({"round": row["round"], "reward_mean": row["reward_mean"],
                           "reward_std": row.get("reward_std")})
    return sorted(rounds, key=lambda r: r["round"])


def _delta(ours, theirs):
    if isinstance(ours, (int, float)) and isinstance(theirs, (int, float)):
        return ours - theirs
    return None


def comparison_rows(summary: dict, baseline: dict) -> list[dict]:
    """Metric by metric: this evaluation, the baseline, and this minus the baseline."""
    rows = []

    def add(metric: str, ours, theirs) -> None:
        rows.append({"metric": metric, "value": ours, "baseline": theirs, "delta": _delta(ours, theirs)})

    ours_acc, their_acc = summary["accuracy"], baseline["accuracy"]
    add("accuracy (all)", ours_acc["overall"]["accuracy"], their_acc["overall"]["accuracy"])
    for level in merged_groups(ours_acc, their_acc):
        add(f"accuracy ({level})", accuracy_groups(ours_acc).get(level, {}).get("accuracy"),
            accuracy_groups(their_acc).get(level, {}).get("accuracy"))
    for key in ("mean", "p50"):
        add(f"transitions per episode ({key})", summary["transitions_per_episode"].get(key),
            baseline.get("transitions_per_episode", {}).get(key))
    for key in ("prompt", "completion", "total"):
        add(f"tokens per episode ({key})", summary["tokens_per_episode"].get(key),
            baseline.get("tokens_per_episode", {}).get(key))
    for what, label in (("rollout_s", "rollout seconds"), ("llm_call_ms", "LLM call ms")):
        for key in ("p50", "p90"):
            add(f"{label} ({key})", (summary["latency"].get(what) or {}).get(key),
                (baseline.get("latency", {}).get(what) or {}).get(key))
    ours_total = max(summary["rollouts"], 1)
    their_total = max(baseline.get("rollouts", 0), 1)
    for name in dict.fromkeys([*summary["failure_classes"], *baseline.get("failure_classes", {})]):
        add(f"share {name}", summary["failure_classes"].get(name, 0) / ours_total,
            baseline.get("failure_classes", {}).get(name, 0) / their_total)
    return rows


def task_rates(summary: dict, classes: Iterable[str] | None = None) -> dict[str, float]:
    """Task id -> share of its scored episodes that were right (unscored episodes left out); with `classes`,
    the share whose outcome class is one of them (e.g. correct and wrong_result: the final SQL runs)."""
    wanted = None if classes is None else set(classes)
    rewards: dict[str, list[float]] = {}
    for episode in summary.get("episodes") or []:
        if episode.get("reward") is not None:
            hit = episode["reward"] == 1.0 if wanted is None else episode.get("failure_class") in wanted
            rewards.setdefault(episode["task_id"], []).append(1.0 if hit else 0.0)
    return {task: sum(values) / len(values) for task, values in rewards.items()}


def paired_comparison(summary: dict, baseline: dict, classes: Iterable[str] | None = None) -> dict:
    """Task by task on the tasks both evaluations scored: on how many this one did better, worse, the same
    (share of right episodes, or of episodes whose outcome is in `classes`), and the exact sign test's p-value
    over the tasks that differ. Two accuracies on the same questions are compared this way because their
    intervals overlap even when one policy wins on nearly every question where they differ."""
    ours, theirs = task_rates(summary, classes), task_rates(baseline, classes)
    common = sorted(set(ours) & set(theirs))
    better = sum(ours[t] > theirs[t] for t in common)
    worse = sum(ours[t] < theirs[t] for t in common)
    return {"tasks": len(common), "better": better, "worse": worse, "same": len(common) - better - worse,
            "p_value": sign_test_p(better, worse) if common else None,
            "only_here": len(set(ours) - set(theirs)), "only_baseline": len(set(theirs) - set(ours))}


def paired_line(paired: dict) -> str:
    """The paired comparison in one sentence."""
    if not paired["tasks"]:
        return (f"No task was scored by both evaluations ({paired['only_here']} here, {paired['only_baseline']} in "
                f"the baseline): evaluate both on the same task file to compare them task by task.")
    line = (f"Paired on the {paired['tasks']} tasks both scored: better on {paired['better']}, worse on "
            f"{paired['worse']}, the same on {paired['same']}; exact sign test p = {paired['p_value']:.3g}")
    if paired["only_here"] or paired["only_baseline"]:
        line += f" ({paired['only_here']} tasks only here and {paired['only_baseline']} only in the baseline left out)"
    return line + "."


def terminal_summary(summary: dict) -> str:
    """The evaluation in a few lines for the terminal: accuracy with its interval, overall and by group,
    episode shape and outcomes, and the comparison with the baseline when there is one."""
    def pct(entry: dict) -> str:
        if entry.get("accuracy") is None:
            return "-"
        low, high = entry["ci95"]
        return (f"{100 * entry['accuracy']:.1f}% [{100 * low:.1f}, {100 * high:.1f}] "
                f"({entry['correct']}/{entry['scored']})")

    acc = summary["accuracy"]
    lines = [f"policy {summary['policy']['label']}: accuracy {pct(acc['overall'])}"
             + (f" ({summary['reward']} = 1)" if summary.get("reward") else "")]
    lines += [f"  {level:<8} {pct(entry)}" for level, entry in accuracy_groups(acc).items()]
    lines.append(f"transitions per episode {summary['transitions_per_episode']['mean'] or 0:.2f}, tokens per "
                 f"episode {summary['tokens_per_episode']['total'] or 0:.0f}; outcomes: "
                 + ", ".join(f"{k}={v}" for k, v in summary["failure_classes"].items() if v))
    if summary.get("baseline"):
        first = summary["baseline"]["comparison"][0]
        delta = "-" if first["delta"] is None else f"{100 * first['delta']:+.1f} points"
        lines.append(f"against baseline {summary['baseline']['label']}: accuracy {delta}")
        if summary["baseline"].get("paired"):
            lines.append(f"  {paired_line(summary['baseline']['paired'])}")
    return "\n".join(lines)


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _ci(interval) -> str:
    return "-" if not interval else f"[{100 * interval[0]:.1f}%, {100 * interval[1]:.1f}%]"


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines + [""]


def render_markdown(summary: dict) -> str:
    config, policy, acc = summary["config"], summary["policy"], summary["accuracy"]
    lines = [f"# Evaluation: {policy['label']}", "",
             f"- tasks: `{config['tasks']}` ({summary['tasks']} tasks x {config['n']} samples = "
             f"{summary['rollouts']} rollouts)",
             f"- agent: `{config['agent']}`",
             (f"- policy: {policy['label']} at the outside endpoint `{policy['outside_url']}` (forwarded by the "
              f"gateway, recorded as text)" if policy.get("outside_url") else
              f"- policy: {policy['label']} (base model `{policy['base_model']}`"
              + (f", LoRA adapter `{policy['adapter']}`" if policy["adapter"] else "")
              + f", served as policy version {policy['version']})"),
             f"- trace store: `{summary['store']}` (every number below is a query over it)", "",
             f"- reward: `{summary.get('reward', '-')}` (task pack `{summary.get('task_pack', '-')}`)", "",
             "## Accuracy", "", "Share of scored rollouts whose reward is 1.", ""]
    rows = [[level, e["rollouts"], e["scored"], e["correct"], _pct(e["accuracy"]), _ci(e["ci95"])]
            for level, e in accuracy_groups(acc).items()]
    overall = acc["overall"]
    rows.append(["**all**", overall["rollouts"], overall["scored"], overall["correct"], _pct(overall["accuracy"]),
                 _ci(overall["ci95"])])
    lines += _table([group_field(acc), "rollouts", "scored", "correct", "accuracy", "95% interval (Wilson)"], rows)
    tpe, tok = summary["transitions_per_episode"], summary["tokens_per_episode"]
    lines += ["## Episodes", ""]
    lines += _table(["metric", "value"], [
        ["transitions (LLM calls) per episode, mean", _fmt(tpe["mean"], 2)],
        ["transitions per episode, median / max", f"{_fmt(tpe['p50'], 1)} / {_fmt(tpe['max'])}"],
        ["prompt tokens per episode, mean", _fmt(tok["prompt"], 1)],
        ["completion tokens per episode, mean", _fmt(tok["completion"], 1)],
        ["tokens per episode, mean", _fmt(tok["total"], 1)]])
    total = max(summary["rollouts"], 1)
    lines += ["## Outcomes", ""]
    lines += _table(["class", "rollouts", "share", "meaning"],
                    [[name, count, _pct(count / total), summary.get("outcome_classes", {}).get(name, "")]
                     for name, count in summary["failure_classes"].items()])
    lines += ["## Latency", ""]
    lat = summary["latency"]
    latency_rows = [["rollout (s)", "-", _fmt(lat["rollout_s"].get("mean"), 2), _fmt(lat["rollout_s"].get("p50"), 2),
                     _fmt(lat["rollout_s"].get("p90"), 2)]]
    for key, name in (("llm_call_ms", "LLM call, agent side (ms)"), ("engine_ms", "generation, engine (ms)")):
        entry = lat.get(key) or {}
        latency_rows.append([name, _fmt(entry.get("calls")), _fmt(entry.get("mean"), 1), _fmt(entry.get("p50"), 1),
                             _fmt(entry.get("p90"), 1)])
    lines += _table(["what", "count", "mean", "p50", "p90"], latency_rows)
    if summary.get("rounds"):
        lines += ["## Training rounds", ""]
        lines += _table(["round", "reward mean"], [[r["round"], _fmt(r["reward_mean"])] for r in summary["rounds"]])
    if summary.get("baseline"):
        base = summary["baseline"]
        lines += [f"## Against the baseline: {base['label']}", "", f"Baseline report: `{base['path']}`", ""]
        if base.get("paired"):
            lines += [paired_line(base["paired"]), ""]
        lines += _table(["metric", "this", "baseline", "delta"],
                        [[r["metric"], _fmt(r["value"]), _fmt(r["baseline"]), _fmt(r["delta"])]
                         for r in base["comparison"]])
    if summary.get("plots"):
        lines += ["## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in summary["plots"]] + [""]
    return "\n".join(lines)


def write_report(summary: dict, report_dir: Path) -> Path:
    """Write summary.json and report.md (plots are written first and listed in the summary)."""
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / SUMMARY).write_text(json.dumps(summary, indent=2, default=str) + "\n")
    path = report_dir / REPORT
    path.write_text(render_markdown(summary))
    return path
