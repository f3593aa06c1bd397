"""The transition record's shape is checked where compile hands it to the learner."""
from __future__ import annotations

import polars as pl
import pytest

from lightning_otel.train.transitions.record import TRANSITION_SCHEMA, Transition, check_transitions


def frame(**changes) -> pl.DataFrame:
    schema = {**TRANSITION_SCHEMA, **changes}
    return pl.DataFrame({name: [] for name in schema}, schema=schema)


def test_the_schema_passes_and_the_typed_row_names_the_same_keys():
    assert check_transitions(frame()).columns == list(TRANSITION_SCHEMA)
    assert set(Transition.__annotations__) == set(TRANSITION_SCHEMA) | {"token_advantages"}


def test_another_dtype_or_column_order_is_refused():
    with pytest.raises(ValueError, match="prompt_ids is List\\(Int64\\)"):
        check_transitions(frame(prompt_ids=pl.List(pl.Int64())))
    reordered = frame().select(["task_id", "rollout_id", *list(TRANSITION_SCHEMA)[2:]])
    with pytest.raises(ValueError, match="transition columns"):
        check_transitions(reordered)
