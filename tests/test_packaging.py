"""What a user installs: the wheel `make dist` builds, in a fresh venv outside the clone. It declares both
licenses of what it ships (the code's and the bundled Spider data's) with their texts, and its command runs."""
from __future__ import annotations

import subprocess
import zipfile

import pytest


@pytest.mark.heavy
@pytest.mark.xdist_group("wheel")  # the demo's test installs the same wheel (conftest.py: wheel_venv)
def test_the_wheel_installs_runs_and_declares_both_licenses(wheel_venv, tmp_path):
    result = subprocess.run([str(wheel_venv / "bin" / "lightning-otel"), "--help"], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path)
    assert result.returncode == 0 and "usage: lightning-otel" in result.stdout, result.stderr[-2000:]
    (wheel,) = (wheel_venv.parent / "src" / "dist").glob("lightning_otel-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        fields = [line.partition(": ") for line in archive.read(metadata).decode().splitlines() if ": " in line]
    assert ("License-Expression", ": ", "Apache-2.0 AND CC-BY-SA-4.0") in fields
    declared = {value for key, _, value in fields if key == "License-File"}
    assert declared == {"LICENSE", "LICENSES/CC-BY-SA-4.0.txt", "lightning_otel/tasks/spider/data/README.md"}
    for name in declared:
        assert any(n.endswith(f".dist-info/licenses/{name}") for n in names), name
    assert any(n.endswith("tasks/spider/data/database/singer/singer.sqlite") for n in names)
    for asset in ("viewer.css", "viewer.js"):  # the viewer's page loads nothing from the network
        assert f"lightning_otel/view/static/{asset}" in names, asset
