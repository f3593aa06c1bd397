"""Wrapping the OpenAI SDK's methods when (or if already) it is imported, the way the capture modules add what the
instrumentations leave out (responses_context: the traceparent on Responses calls; agent_header: the agent name)."""
from __future__ import annotations

from typing import Any, Callable

_registered: set[tuple[str, Callable]] = set()


def wrap_when_imported(module: str, methods: tuple[str, ...], wrapper: Callable) -> None:
    """Wrap each `Class.method` of `module` with `wrapper` (wrapt's signature) once the module is imported, now
    if it already is; registering the same module and wrapper again does nothing."""
    if (module, wrapper) in _registered:
        return
    import wrapt

    def wrap(loaded: Any) -> None:
        for method in methods:
            owner, name = method.split(".")
            if hasattr(getattr(loaded, owner, None), name):
                wrapt.wrap_function_wrapper(loaded, method, wrapper)

    wrapt.register_post_import_hook(wrap, module)
    _registered.add((module, wrapper))


def registered(module: str) -> bool:
    """Whether some wrapper waits for (or has wrapped) `module`."""
    return any(name == module for name, _ in _registered)
