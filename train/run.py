"""A training run's folder and its resume point.

<output_dir>/run.json holds the RunState: which checkpoint is the last and the best, how many rounds are done,
the policy version the engine serves, and the config the run was started with. It is written atomically after
each finished step (SFT, a round, validation), before the step's metrics line, so a killed run resumes from
the last step it finished. Other tools read it too: `eval --model <run folder>` serves its best checkpoint.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from lightning_otel.errors import UserError

# Keys that may differ when a run is resumed: they change how it runs, not what it trains.
RESUMABLE_CHANGES = {"rounds", "val_every", "concurrency", "rollout_timeout_s", "engine_python", "engine_url",
                     "share_prefix", "micro_batch_tokens", "sft_save_tasks", "sft_save_steps",
                     "group_steps",  # the order of a round's steps only
                     "report_to", "tracker_project", "tracker_run_name"}  # where the metrics go


@dataclass
class RunState:
    model: str                        # the base model folder the run trains (a hub model: org/name@<commit>)
    rounds_completed: int = 0
    policy_version: int = 0           # what the engine serves: 0 = base, +1 per checkpoint
    last: str | None = None           # the newest checkpoint, relative to the run folder
    best: str | None = None           # the one `eval --model <run>` serves: best validation, else the last
    best_metric: float | None = None  # its validation reward mean
    sft_done: bool = False
    validated_start: bool = False     # the policy the rounds start from has been validated
    pool_done: bool = False           # pool.jsonl holds the pool filter's measurement
    rounds_without_step: int = 0      # rounds whose rollouts gave nothing to learn from (no checkpoint, no version)
    config: dict = field(default_factory=dict)
    offline: dict | None = None       # what an offline run trained from (train --offline)
    previous: str | None = None       # the checkpoint before `last`, until its optimizer state is dropped

    @classmethod
    def from_dict(cls, data: dict, where: Path) -> RunState:
        known = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or "model" not in data:
            raise UserError(f"{where} is not a run state (no 'model'): give a new output_dir")
        return cls(**{k: v for k, v in data.items() if k in known})

    def to_dict(self) -> dict:
        data = asdict(self)
        if data["offline"] is None:
            data.pop("offline")
        data.pop("previous")
        return data


def write_atomically(path: Path, text: str) -> None:
    """A kill leaves either the old file or the new one, never a part."""
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(text)
    os.replace(partial, path)


class RunFolder:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.run_json = self.path / "run.json"

    def load(self) -> RunState | None:
        if not self.run_json.is_file():
            return None
        try:
            data = json.loads(self.run_json.read_text())
        except json.JSONDecodeError as exc:
            raise UserError(f"{self.run_json} is not JSON ({exc.msg}): give a new output_dir") from None
        return RunState.from_dict(data, self.run_json)

    def save(self, state: RunState) -> None:
        write_atomically(self.run_json, json.dumps(state.to_dict(), indent=2))

    def checkpoint(self, name: str) -> Path:
        return self.path / "checkpoints" / name


def check_resume(config, folder: RunFolder) -> RunState | None:
    """The saved state of the run in `folder`, if any, after checking it was started with the same settings
    (`config`: a TrainConfig) but for those RESUMABLE_CHANGES allows."""
    state = folder.load()
    if state is None:
        return None
    from lightning_otel.train.config import migrate_saved

    saved = migrate_saved(state.config)
    changed = sorted(k for k, v in asdict(config).items() if k in saved and saved[k] != v and
                     k not in RESUMABLE_CHANGES)
    if changed:
        raise UserError(f"{folder.path} holds a run with different settings ({', '.join(changed)}): resume it with "
                        f"the same config (only {', '.join(sorted(RESUMABLE_CHANGES))} may change), or give a new "
                        f"output_dir")
    return state
