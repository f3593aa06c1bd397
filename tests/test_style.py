"""The code style's one mechanical rule the suite checks: no source line longer than pyproject.toml's line length
(ruff's `line-length`, the width the sources are written to)."""
from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("lightning_otel", "span_store", "train", "eval", "tests", "benchmarks", "examples")


def long_lines(paths, limit: int) -> list[str]:
    return [f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{number}: {len(line)} characters"
            for path in paths for number, line in enumerate(path.read_text().splitlines(), 1) if len(line) > limit]


def test_no_source_line_is_longer_than_the_configured_width(tmp_path):
    limit = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["line-length"]
    sources = sorted({path.resolve() for folder in FOLDERS for path in (ROOT / folder).rglob("*.py")})
    assert len(sources) > 100
    assert long_lines(sources, limit) == []
    # and the check sees a long line where there is one
    wide = tmp_path / "wide.py"
    wide.write_text("x = 1\n" + "y = '" + "a" * limit + "'\n")
    assert long_lines([wide], limit) == [f"wide.py:2: {limit + 6} characters"]
