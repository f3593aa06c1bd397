"""A run's metrics: one JSON line per round record in metrics.jsonl and per optimizer step in steps.jsonl, the
same figures in the trackers `report_to` names (train/trackers.py), and reward_curve.png."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable

from lightning_otel.train.config import TrainConfig
from lightning_otel.train.trackers import ROUND_AXIS, STEP_AXIS, Trackers, open_trackers

log = logging.getLogger(__name__)
SHOWN = ("reward_mean", "success_rate", "transitions_per_episode", "loss", "kl", "clip_fraction",
         "first_ratio_mean", "zero_variance_groups", "rollout_seconds", "train_seconds", "val_reward_mean",
         "val_accuracy", "prompt_versions", "pool_tasks", "pool_kept", "pool_never", "pool_always", "value_loss",
         "explained_variance", "tis_truncated_fraction")
STEP_PREFIX = "train/"  # the step series' names in the trackers; round records use "<phase>/"


def format_record(record: dict) -> str:
    parts = [f"{record.get('phase', '')} round {record.get('round')}"]
    for key in SHOWN:
        value = record.get(key)
        if value is not None:
            parts.append(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}")
    return " ".join(parts)


class MetricsLog:
    def __init__(self, folder: Path, echo: Callable[[str], None] | None = None, trackers: Trackers | None = None):
        self.folder = Path(folder)
        self.path = self.folder / "metrics.jsonl"
        self.steps_path = self.folder / "steps.jsonl"
        self.echo = echo or log.info
        self.trackers = trackers or Trackers({})

    def write(self, record: dict) -> None:
        with self.path.open("a") as out:
            out.write(json.dumps(record) + "\n")
        phase = record.get("phase", "train")
        self.trackers.log({f"{phase}/{key}": value for key, value in record.items()}, ROUND_AXIS,
                          int(record.get("round") or 0))
        plot_rewards(self.records(), self.folder / "reward_curve.png")
        self.echo(format_record(record))

    def write_step(self, step: int, metrics: dict[str, float]) -> None:
        """One optimizer step's metrics (train/optimize.py), `step` = the run's optimizer steps so far."""
        with self.steps_path.open("a") as out:
            out.write(json.dumps({STEP_AXIS: step, **metrics}) + "\n")
        self.trackers.log({STEP_PREFIX + key: value for key, value in metrics.items()}, STEP_AXIS, step)

    def records(self) -> list[dict]:
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def close(self, failed: bool = False) -> None:
        self.trackers.close(failed)


def open_metrics(config: TrainConfig, folder: Path, resume: bool = False) -> MetricsLog:
    """The run's MetricsLog with the trackers config.report_to names; `resume`: the folder's run goes on, and so
    do its tracker runs."""
    from dataclasses import asdict

    trackers = open_trackers(config.report_to, Path(folder), asdict(config), config.tracker_project,
                             config.tracker_run_name, resume)
    return MetricsLog(folder, trackers=trackers)


def plot_rewards(records: list[dict], out: Path) -> Path | None:
    """Reward mean (+- std) per GRPO round, and validation reward and accuracy when measured (round 0: the policy
    the rounds started from)."""
    rounds = [r for r in records if r.get("phase") == "grpo" and r.get("reward_mean") is not None]
    validated = [r for r in records if r.get("val_reward_mean") is not None]
    if not rounds and not validated:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["round"] for r in rounds]
    mean = [r["reward_mean"] for r in rounds]
    std = [r.get("reward_std") or 0.0 for r in rounds]
    figure, axis = plt.subplots(figsize=(6, 3.5))
    axis.plot(x, mean, marker="o", label="rollout reward (mean)")
    axis.fill_between(x, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2)
    if validated:
        axis.plot([r["round"] for r in validated], [r["val_reward_mean"] for r in validated], marker="s",
                  label="validation reward")
        scored = [r for r in validated if r.get("val_accuracy") is not None]
        axis.plot([r["round"] for r in scored], [r["val_accuracy"] for r in scored], marker="^", linestyle="--",
                  label="validation accuracy")
    axis.set_xlabel("round")
    axis.set_ylabel("reward")
    axis.legend(loc="best")
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out
