"""Evaluation and reports. Installed as lightning_otel.eval.

    from lightning_otel.eval import EvalConfig, evaluate
"""
from __future__ import annotations

import importlib
from typing import Any

__all__ = ["EvalConfig", "EvalResult", "evaluate"]


def __getattr__(name: str) -> Any:
    # Lazy, so importing a submodule (metrics, report) does not pull in the runner.
    if name in __all__:
        return getattr(importlib.import_module("lightning_otel.eval.evaluator"), name)
    raise AttributeError(f"module 'lightning_otel.eval' has no attribute {name!r}")
