"""Experiment trackers: where a run's metrics go besides metrics.jsonl (config key `report_to`).

    report_to = ["tensorboard", "wandb", "mlflow"]   # any of them; [] or ["none"]: metrics.jsonl only

Two series go to every named tracker, each against its own x axis:
    train/<metric>   one point per optimizer step (loss, lr, grad_norm, entropy, approx_kl, clip_fraction, kl,
                     tis_truncated_fraction, tis_weight_mean),
                     x = the run's optimizer steps so far (1, 2, ...; SFT steps and GRPO steps count alike)
    <phase>/<key>    one point per record of metrics.jsonl (phase grpo, sft, validation, pool, offline-grpo ...),
                     x = the record's round
TensorBoard and MLflow keep a step per point; W&B has one step counter per run, so each point carries its axis
(`optimizer_step` or `round`) as a value and every metric is plotted against its axis (wandb define_metric).

A tracker is a small class behind the `Tracker` protocol; TRACKERS maps names to them, and nothing else
branches on a name. The libraries are imported only when named. The runs they open are remembered in
`<run folder>/trackers.json`, so a resumed run continues the same W&B run (its id, resume="allow") and the
same MLflow run (its run id, at the same tracking URI). Steps of a round that a kill interrupted are logged
again when the round is redone.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from lightning_otel.errors import UserError

log = logging.getLogger(__name__)
STATE_FILE = "trackers.json"
STEP_AXIS, ROUND_AXIS = "optimizer_step", "round"
NONE = "none"
INSTALL_HINT = "pip install 'lightning-otel[trackers]'"


@dataclass(frozen=True)
class TrackerRun:
    """What a tracker is opened with."""
    folder: Path      # the run folder
    config: dict      # the resolved train config (W&B config, MLflow params)
    project: str      # W&B project, MLflow experiment
    name: str         # the tracker run's display name
    resume: bool      # the run folder holds a run being resumed: continue its tracker run
    saved: dict       # what this tracker saved in trackers.json last time (empty: nothing)


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], axis: str, step: int) -> None:
        """Finite numbers only; `axis` is STEP_AXIS or ROUND_AXIS, `step` the point's place on it."""

    def saved(self) -> dict:
        """What a resumed run needs to continue this tracker's run (JSON)."""

    def close(self, failed: bool) -> None: ...


class TensorBoardTracker:
    def __init__(self, run: TrackerRun):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run.folder / "tensorboard"))

    def log(self, metrics: dict[str, float], axis: str, step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        if axis == ROUND_AXIS:  # step points are flushed with the round's (and at close)
            self.writer.flush()

    def saved(self) -> dict:
        return {}

    def close(self, failed: bool) -> None:
        self.writer.close()


class WandbTracker:
    """wandb.init in the run folder (`<run>/wandb/`). The mode comes from the environment as wandb reads it:
    WANDB_MODE=offline writes the run there for a later `wandb sync`, no account needed."""

    def __init__(self, run: TrackerRun):
        import wandb

        previous = run.saved.get("id") if run.resume else None
        try:
            # WANDB_MODE read now: wandb's process-wide setup keeps the environment of its first run
            self.run = wandb.init(project=run.project, name=run.name, dir=str(run.folder), config=run.config,
                                  id=previous, resume="allow" if previous else None,
                                  mode=os.environ.get("WANDB_MODE") or None, settings=wandb.Settings(silent=True))
        except wandb.errors.Error as exc:  # a missing login (UsageError), a bad project or no network (CommError)
            raise UserError(f"report_to wandb: W&B could not start a run ({exc}); log in with `wandb login`, or "
                            f"set WANDB_MODE=offline to write the run into the run folder (then `wandb sync`)") \
                from None
        self.id = self.run.id
        self.defined: set[str] = set()
        log.info("W&B run %s: %s", self.id, self.run.url or f"offline, in {run.folder / 'wandb'} (wandb sync)")

    def log(self, metrics: dict[str, float], axis: str, step: int) -> None:
        if axis not in self.defined:
            self.run.define_metric(axis)
            self.defined.add(axis)
        for key in metrics.keys() - self.defined:
            self.run.define_metric(key, step_metric=axis)
            self.defined.add(key)
        self.run.log({**metrics, axis: step})

    def saved(self) -> dict:
        return {"id": self.id}

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class MlflowTracker:
    """An MLflow run through MlflowClient (no process-wide active run). Tracking URI: MLFLOW_TRACKING_URI, else
    a file store in the run folder (`<run>/mlruns`, opened with MLFLOW_ALLOW_FILE_STORE=true: MLflow 3 keeps
    the file store in maintenance mode, and a database store would need the full mlflow package). The config
    goes in as the run's params."""

    def __init__(self, run: TrackerRun):
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or (run.folder / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client, self.uri = MlflowClient(uri), uri
        previous = run.saved.get("run_id") if run.resume and run.saved.get("tracking_uri") == uri else None
        if previous:
            self.run_id = previous
            self.client.update_run(previous, status="RUNNING")
            return
        experiment = self.client.get_experiment_by_name(run.project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(run.project)
        self.run_id = self.client.create_run(experiment_id, run_name=run.name).info.run_id
        self._log_params(run.config)

    def _log_params(self, config: dict) -> None:
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

        params = [Param(key, str(value)[:MAX_PARAM_VAL_LENGTH]) for key, value in config.items() if value is not None]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[start:start + 100])

    def log(self, metrics: dict[str, float], axis: str, step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(key, value, now, step) for key, value in metrics.items()])

    def saved(self) -> dict:
        return {"run_id": self.run_id, "tracking_uri": self.uri}

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


# name -> (tracker class, the module it needs)
TRACKERS: dict[str, tuple[type, str]] = {
    "tensorboard": (TensorBoardTracker, "tensorboard"),
    "wandb": (WandbTracker, "wandb"),
    "mlflow": (MlflowTracker, "mlflow"),
}


def tracker_names(value: str | list[str] | None) -> list[str]:
    """`report_to` as a list of tracker names: a list, or one text with names separated by commas or spaces;
    "none" (alone) or nothing means no tracker. Unknown names and missing libraries are user errors."""
    items = [value] if isinstance(value, str) else list(value or [])
    if not all(isinstance(item, str) for item in items):
        raise UserError(f"train config: report_to = {value!r}: give a list of tracker names, e.g. "
                        f"[\"tensorboard\", \"wandb\"]")
    names = [name.strip().lower() for item in items for name in item.replace(",", " ").split()]
    if NONE in names:
        if len(names) > 1:
            raise UserError(f"train config: report_to = {value!r}: \"none\" turns every tracker off; give it alone")
        return []
    unknown = [name for name in names if name not in TRACKERS]
    if unknown:
        raise UserError(f"train config: report_to names unknown tracker(s) {', '.join(map(repr, unknown))}; choose "
                        f"from {', '.join(TRACKERS)} (or \"none\")")
    missing = [name for name in names if importlib.util.find_spec(TRACKERS[name][1]) is None]
    if missing:
        packages = ", ".join(TRACKERS[name][1] for name in missing)
        raise UserError(f"train config: report_to names {', '.join(missing)}, but the {packages} package is not "
                        f"installed: {INSTALL_HINT}")
    return list(dict.fromkeys(names))


class Trackers:
    """Every named tracker behind one `log`; finite numbers only reach them."""

    def __init__(self, trackers: dict[str, Tracker]):
        self.trackers = trackers

    def log(self, metrics: dict[str, float], axis: str, step: int) -> None:
        numbers = {key: float(value) for key, value in metrics.items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)}
        if numbers:
            for tracker in self.trackers.values():
                tracker.log(numbers, axis, step)

    def close(self, failed: bool = False) -> None:
        for name, tracker in self.trackers.items():
            try:
                tracker.close(failed)
            except Exception:  # one tracker failing to close must not keep the others open
                log.exception("closing the %s tracker failed", name)
        self.trackers = {}


def open_trackers(names: list[str], folder: Path, config: dict, project: str, run_name: str,
                  resume: bool) -> Trackers:
    """Open the named trackers for the run in `folder` and record in trackers.json what a resume needs."""
    folder = Path(folder)
    state_path = folder / STATE_FILE
    state = json.loads(state_path.read_text()) if resume and state_path.is_file() else {}
    opened: dict[str, Tracker] = {}
    try:
        for name in names:
            cls, _ = TRACKERS[name]
            opened[name] = cls(TrackerRun(folder, config, project, run_name or folder.resolve().name, resume,
                                          state.get(name, {})))
    except BaseException:
        Trackers(opened).close(failed=True)
        raise
    state.update({name: tracker.saved() for name, tracker in opened.items()})
    if opened:
        state_path.write_text(json.dumps(state, indent=2))
    log.info("metrics go to %s", ", ".join(names) if names else "metrics.jsonl only")
    return Trackers(opened)
