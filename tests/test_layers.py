"""The floors (docs/design.md): the import-linter contract in pyproject.toml holds on the installed layout, and
an import from a lower floor into a higher one, even inside a function, breaks it."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"


def installed_layout(folder: Path) -> Path:
    """The package's Python files laid out as a wheel installs them (no data files): lightning_otel/ with the
    span_store, train and eval links followed."""
    ignore = shutil.ignore_patterns("__pycache__", "data", "*.sqlite", "*.gz", "*.c", "*.so")
    shutil.copytree(ROOT / "lightning_otel", folder / "lightning_otel", ignore=ignore)
    return folder


def test_the_source_tree_is_the_import_tree():
    # span_store/, train/ and eval/ sit at the top of the repository and install inside lightning_otel
    # (pyproject.toml's package-dir); links in lightning_otel/ mirror that, so tools that read the source tree
    # (lint-imports run from the repository root, editors) see the package as it installs.
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    mapped = {name.removeprefix("lightning_otel."): folder for name, folder in package_dir.items()
              if name.count(".") == 1}
    assert {"span_store", "train", "eval"} <= set(mapped)
    for name, folder in mapped.items():
        link = ROOT / "lightning_otel" / name
        assert link.is_symlink() and link.resolve() == (ROOT / folder).resolve(), (link, folder)


def lint(folder: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(folder)}
    return subprocess.run([LINT, "--no-cache", str(ROOT / "pyproject.toml")], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_floors_contract_is_kept(tmp_path):
    result = lint(installed_layout(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "5 kept, 0 broken" in result.stdout
    # and as a contributor runs it, from the repository root
    here = subprocess.run([LINT, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert here.returncode == 0 and "5 kept, 0 broken" in here.stdout, here.stdout + here.stderr


UPWARD = [
    ("capture/context.py", "lightning_otel.span_store", "import lightning_otel.span_store.store\n"),
    ("span_store/store.py", "lightning_otel.serve", "def f():\n    from lightning_otel.serve import engine\n"),
    ("serve/gateway.py", "lightning_otel.rollouts", "from lightning_otel.rollouts import runner\n"),
    ("rollouts/runner.py", "lightning_otel.train", "def f():\n    import lightning_otel.train.trainer\n"),
    ("train/transitions/compile.py", "lightning_otel.eval", "from lightning_otel.eval import metrics\n"),
    ("eval/report.py", "lightning_otel.cli", "def f():\n    from lightning_otel.cli import main\n"),
    ("errors.py", "lightning_otel.capture", "from lightning_otel.capture import distro\n"),
]


@pytest.mark.heavy
@pytest.mark.parametrize("module, target, line", UPWARD, ids=[u[0] for u in UPWARD])
def test_an_upward_import_breaks_the_contract(tmp_path, module, target, line):
    folder = installed_layout(tmp_path)
    path = folder / "lightning_otel" / module
    path.write_text(path.read_text() + "\n\n" + line)
    result = lint(folder)
    assert result.returncode != 0
    assert "BROKEN" in result.stdout.upper() and target in result.stdout, result.stdout


def test_a_generic_layer_that_imports_a_task_pack_breaks_the_contract(tmp_path):
    # Nothing task-specific below the command line: eval reaches the Spider pack by name, never by import.
    folder = installed_layout(tmp_path)
    path = folder / "lightning_otel" / "eval" / "metrics.py"
    path.write_text(path.read_text() + "\n\ndef f():\n    from lightning_otel.tasks.spider import outcomes\n")
    result = lint(folder)
    assert result.returncode != 0 and "lightning_otel.eval.metrics -> lightning_otel.tasks.spider" in result.stdout


@pytest.mark.parametrize("module, package", [("capture/distro.py", "duckdb"), ("errors.py", "torch"),
                                             ("train/transitions/credit.py", "torch")])
def test_the_agent_side_and_the_compiler_stay_off_heavy_stacks(tmp_path, module, package):
    folder = installed_layout(tmp_path)
    path = folder / "lightning_otel" / module
    path.write_text(path.read_text() + f"\n\ndef f():\n    import {package}\n")
    result = lint(folder)
    assert result.returncode != 0 and f"is not allowed to import {package}" in result.stdout, result.stdout


def test_a_module_outside_every_floor_breaks_the_contract(tmp_path):
    # exhaustive = true: a new top-level module must be given a floor in pyproject.toml.
    folder = installed_layout(tmp_path)
    (folder / "lightning_otel" / "stray.py").write_text("X = 1\n")
    result = lint(folder)
    assert result.returncode != 0 and "stray" in result.stdout + result.stderr


def test_the_agent_side_stays_light():
    # What an agent process imports: no duckdb, no torch, no higher floor.
    code = ("import sys, lightning_otel, lightning_otel.capture.distro, lightning_otel.capture.agent_worker\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('duckdb', 'torch', 'pyarrow', 'polars')\n"
            "               or m.startswith(('lightning_otel.span_store', 'lightning_otel.serve', "
            "'lightning_otel.rollouts', 'lightning_otel.train', 'lightning_otel.eval', 'lightning_otel.cli')))\n"
            "print(heavy)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]", result.stdout
