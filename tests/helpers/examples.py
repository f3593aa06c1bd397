"""The repository's examples as modules, for tests and benchmarks that reuse an example's prompts, parser, data
or reward.

An example is a folder of scripts, not a package, and several folders have an `agent.py`: each file is loaded
under a name of its own (`_example_<folder>_<module>`), so which one `import agent` would find never depends on
the tests that ran before, and nothing is added to sys.path.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example_module(folder: str, module: str = "agent") -> ModuleType:
    """examples/<folder>/<module>.py, loaded once per process."""
    name = f"_example_{folder}_{module}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / folder / f"{module}.py")
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[name] = loaded  # as an import would: dataclasses and typing look the module up by name
    try:
        spec.loader.exec_module(loaded)
    except BaseException:
        del sys.modules[name]
        raise
    return loaded
