"""The dependency floors in pyproject.toml are the versions `make test-floors` installs (.ci/floors.txt)."""
from __future__ import annotations

import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from conftest import REPO


def floor_pins() -> dict[str, Version]:
    pins = {}
    for line in (REPO / ".ci" / "floors.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f".ci/floors.txt: {line!r} is not an exact pin (name==version)"
            pins[canonicalize_name(name)] = Version(version)
    return pins


def test_every_core_floor_is_the_version_ci_installs():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    floors = {}
    for text in project["dependencies"]:
        requirement = Requirement(text)
        lower = [s.version for s in requirement.specifier if s.operator == ">="]
        assert len(lower) == 1, f"pyproject.toml: {text!r} needs one '>=' floor, tested in .ci/floors.txt"
        floors[canonicalize_name(requirement.name)] = Version(lower[0])
    assert floors == floor_pins(), "update pyproject.toml and .ci/floors.txt together"
