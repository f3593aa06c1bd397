"""Per-round metrics: one JSON line each in metrics.jsonl, TensorBoard scalars, and reward_curve.png."""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)
SHOWN = ("reward_mean", "success_rate", "transitions_per_episode", "loss", "kl", "clip_fraction",
         "first_ratio_mean", "zero_variance_groups", "rollout_seconds", "train_seconds", "val_reward_mean",
         "val_accuracy", "pool_tasks", "pool_kept", "pool_never", "pool_always", "value_loss", "explained_variance")


def format_record(record: dict) -> str:
    parts = [f"{record.get('phase', '')} round {record.get('round')}"]
    for key in SHOWN:
        value = record.get(key)
        if value is not None:
            parts.append(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}")
    return " ".join(parts)


class MetricsLog:
    def __init__(self, folder: Path, echo: Callable[[str], None] | None = None):
        self.folder = Path(folder)
        self.path = self.folder / "metrics.jsonl"
        self.echo = echo or log.info
        self._writer = None

    def _tensorboard(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.folder / "tensorboard"))
        return self._writer

    def write(self, record: dict) -> None:
        with self.path.open("a") as out:
            out.write(json.dumps(record) + "\n")
        writer = self._tensorboard()
        step = int(record.get("round") or 0)
        for key, value in record.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                writer.add_scalar(f"{record.get('phase', 'train')}/{key}", value, step)
        writer.flush()
        plot_rewards(self.records(), self.folder / "reward_curve.png")
        self.echo(format_record(record))

    def records(self) -> list[dict]:
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


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
