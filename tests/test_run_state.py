"""The run folder's resume point: RunState round-trips through run.json, older files load, a changed config or a
broken file is refused with what to do."""
from __future__ import annotations

import json

import pytest

from lightning_otel.errors import UserError
from lightning_otel.train.config import TrainConfig
from lightning_otel.train.run import RunFolder, RunState, check_resume


def test_state_round_trips_and_the_transient_previous_is_not_saved(tmp_path):
    folder = RunFolder(tmp_path)
    assert folder.load() is None
    state = RunState(model="/m", rounds_completed=2, policy_version=3, last="checkpoints/round-0002",
                     best="checkpoints/round-0001", best_metric=0.5, sft_done=True, previous="checkpoints/x",
                     config={"lr": 1e-4})
    folder.save(state)
    saved = json.loads((tmp_path / "run.json").read_text())
    assert "previous" not in saved and "offline" not in saved and saved["best_metric"] == 0.5
    loaded = folder.load()
    assert loaded == RunState(**{**state.__dict__, "previous": None})


def test_a_run_json_of_an_earlier_release_loads(tmp_path):
    # written before RunState: no validated_start/pool_done, and a key this release does not know
    (tmp_path / "run.json").write_text(json.dumps({"model": "/m", "rounds_completed": 1, "policy_version": 1,
                                                   "last": "checkpoints/round-0001", "best": None,
                                                   "best_metric": None, "sft_done": False, "later_key": 1}))
    state = RunFolder(tmp_path).load()
    assert state.last == "checkpoints/round-0001" and not state.pool_done


@pytest.mark.parametrize("text, needle", [("{", "is not JSON"), ("[1, 2]", "is not a run state")])
def test_a_broken_run_json_says_to_use_a_new_output_dir(tmp_path, text, needle):
    (tmp_path / "run.json").write_text(text)
    with pytest.raises(UserError, match=needle) as info:
        RunFolder(tmp_path).load()
    assert "new output_dir" in str(info.value)


def test_resuming_with_other_settings_names_them(tmp_path):
    folder = RunFolder(tmp_path)
    config = TrainConfig(reward="number_match", lr=1e-4, rounds=2)
    folder.save(RunState(model="/m", config=config.__dict__.copy()))
    assert check_resume(TrainConfig(reward="number_match", lr=1e-4, rounds=5), folder) is not None  # rounds may
    with pytest.raises(UserError, match=r"different settings \(lr\)"):
        check_resume(TrainConfig(reward="number_match", lr=2e-4, rounds=2), folder)
