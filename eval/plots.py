"""PNG plots of an evaluation summary (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

from pathlib import Path

from lightning_otel.eval.metrics import accuracy_groups, group_field, merged_groups


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_accuracy(summary: dict, baseline: dict | None, path: Path) -> Path:
    """Accuracy by group (Spider: hardness) and overall with 95% intervals; the baseline's bars beside."""
    plt = _pyplot()
    series = [(summary["policy"]["label"], summary["accuracy"])]
    if baseline is not None:
        series.append((f"baseline: {baseline['policy']['label']}", baseline["accuracy"]))
    levels = merged_groups(*(acc for _, acc in series)) + ["all"]
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (label, acc) in enumerate(series):
        entries = [acc["overall"] if level == "all" else accuracy_groups(acc).get(level, {}) for level in levels]
        values = [100 * (e.get("accuracy") or 0.0) for e in entries]
        errors = [[max(0.0, 100 * ((e.get("accuracy") or 0.0) - e["ci95"][0])) if e.get("ci95") else 0.0
                   for e in entries],
                  [max(0.0, 100 * (e["ci95"][1] - (e.get("accuracy") or 0.0))) if e.get("ci95") else 0.0
                   for e in entries]]
        positions = [x + (i - (len(series) - 1) / 2) * width for x in range(len(levels))]
        bars = ax.bar(positions, values, width, yerr=errors, capsize=3, label=label)
        for bar, entry in zip(bars, entries):
            if entry.get("scored"):
                ax.annotate(f"{entry['correct']}/{entry['scored']}", (bar.get_x() + bar.get_width() / 2, 1),
                            ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(levels)), levels)
    ax.set_ylabel(f"accuracy (%, {summary.get('reward', 'reward')} = 1)")
    ax.set_ylim(0, 100)
    ax.set_title(f"Accuracy by {group_field(summary['accuracy'])} (95% Wilson interval)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_transitions(summary: dict, path: Path) -> Path:
    """How many LLM calls (transitions) the episodes took."""
    plt = _pyplot()
    histogram = summary["transitions_per_episode"]["histogram"]
    counts = sorted((int(k), v) for k, v in histogram.items())
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([k for k, _ in counts], [v for _, v in counts], width=0.8)
    ax.set_xlabel("transitions (LLM calls) per episode")
    ax.set_ylabel("rollouts")
    ax.set_xticks([k for k, _ in counts])
    ax.set_title(f"Transitions per episode (mean {summary['transitions_per_episode']['mean'] or 0:.2f})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_rounds(rounds: list[dict], path: Path) -> Path:
    """Mean reward of each training round (from the run's metrics.jsonl), with +-1 std when recorded."""
    plt = _pyplot()
    xs = [r["round"] for r in rounds]
    ys = [r["reward_mean"] for r in rounds]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(xs, ys, marker="o")
    if all(r.get("reward_std") is not None for r in rounds):
        ax.fill_between(xs, [y - r["reward_std"] for y, r in zip(ys, rounds)],
                        [y + r["reward_std"] for y, r in zip(ys, rounds)], alpha=0.2)
    ax.set_xlabel("round")
    ax.set_ylabel("mean reward")
    ax.set_title("Reward across training rounds")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plots(summary: dict, baseline: dict | None, report_dir: Path) -> list[str]:
    """All plots that apply; returns their file names (relative to the report folder)."""
    written = [plot_accuracy(summary, baseline, report_dir / "accuracy.png"),
               plot_transitions(summary, report_dir / "transitions_per_episode.png")]
    if summary.get("rounds"):
        written.append(plot_rounds(summary["rounds"], report_dir / "reward_by_round.png"))
    return [p.name for p in written]
