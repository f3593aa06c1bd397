"""lightning-otel as a user installs it: the wheel `make dist` builds from the tracked files, in a fresh venv."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def source_copy(folder: Path) -> Path:
    """The files git tracks or would track (committed or not), copied: a wheel built in the clone itself would
    also pack what an earlier build left in its build/ folder (modules since moved or deleted)."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.split("\0")
    for name in filter(None, names):
        source, target = REPO / name, folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        elif source.is_file():
            shutil.copy2(source, target)
    return folder


def venv_seeing_these_packages(venv: Path, *venv_args: str) -> tuple[Path, Path]:
    """A fresh venv whose Python also sees this environment's packages (a path entry: nothing is installed or
    downloaded). Returns the venv and its own site-packages folder."""
    subprocess.run([sys.executable, "-m", "venv", *venv_args, str(venv)], check=True, timeout=300)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c",
                                "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv, site


def installed_from_wheel(folder: Path) -> Path:
    """A fresh venv holding lightning-otel as a built wheel (not the clone). Its dependencies are this
    environment's (a path entry, so nothing is downloaded); its console scripts are its own."""
    source = source_copy(folder / "src")
    subprocess.run(["make", "-C", str(source), "dist", f"PY={sys.executable}"], check=True, capture_output=True,
                   timeout=600)
    (wheel,) = (source / "dist").glob("lightning_otel-*.whl")
    venv, _ = venv_seeing_these_packages(folder / "venv")
    python = venv / "bin" / "python"
    import opentelemetry.instrumentation.version as instrumentation
    # --ignore-installed: the dependencies' copy is visible through the path entry, but its console script
    # (opentelemetry-instrument, which starts every agent) must be this venv's own.
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed",
                    "--disable-pip-version-check", str(wheel),
                    f"opentelemetry-instrumentation=={instrumentation.__version__}"],
                   check=True, capture_output=True, timeout=600)
    return venv
