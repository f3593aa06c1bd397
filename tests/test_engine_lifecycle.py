"""The vLLM engine's whole process tree (API server, engine core, workers) dies with its owner, even when
the owner is SIGKILLed or its whole process group is signalled: the parent-death signal alone reaches only the
API server."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

# The owner starts the engine and reports its server's pid once the server and its watchdog run; it is killed as
# soon as the engine core has started its worker (it need not answer yet: the core and worker are what must not
# outlive the owner), about a minute sooner on a 2-core machine than after the engine is ready.
OWNER = textwrap.dedent("""
    import threading, time
    from lightning_otel.serve.engine import EngineConfig, VLLMEngine, default_engine_python
    from lightning_otel.serve.model import bundled_model_dir
    python = default_engine_python()
    engine = VLLMEngine(EngineConfig(model_dir=bundled_model_dir(python), python=python, kv_cache_gib=1))
    engine.process = engine.watchdog = None
    threading.Thread(target=engine.start, daemon=True).start()
    while engine.process is None or engine.watchdog is None:
        time.sleep(0.05)
    print(engine.process.pid, flush=True)
    time.sleep(600)
""")


def group_parents(group: int) -> dict[int, int]:
    """{pid: parent pid} of the processes in session `group` (the engine's server leads its own)."""
    out = subprocess.run(["ps", "-o", "pid=,ppid=", "-g", str(group)], capture_output=True, text=True).stdout
    pairs = [line.split() for line in out.splitlines() if line.strip()]
    return {int(pid): int(ppid) for pid, ppid in pairs}


def group_members(group: int) -> list[int]:
    return list(group_parents(group))


def a_worker_started(parents: dict[int, int], group: int) -> bool:
    """The engine core (the server's child) has started its worker (the core's child)."""
    return any(parent in parents and parent != group for parent in parents.values())


@pytest.mark.heavy
@pytest.mark.parametrize("how", ["SIGKILL to the owner", "SIGTERM to the owner's process group"])
def test_a_killed_owner_takes_the_engine_core_and_workers_with_it(how):
    # The owner leads a process group of its own, as a job a shell or job runner starts; a group signal (Ctrl-C,
    # `kill -- -PGID`) reaches every process in it, and used to take the watchdog down with the owner.
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        group = int(owner.stdout.readline())
        deadline = time.monotonic() + 300
        while not a_worker_started(parents := group_parents(group), group) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert a_worker_started(parents, group), \
            f"expected the API server, its engine core and the core's worker in group {group}: {parents}"
    finally:
        if how.startswith("SIGKILL"):
            os.kill(owner.pid, signal.SIGKILL)
        else:
            os.killpg(owner.pid, signal.SIGTERM)
        owner.wait(30)
    deadline = time.monotonic() + 30
    while group_members(group) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not group_members(group), f"left behind after the owner was killed: {group_members(group)}"


# ---- full weights loaded into the running engine ---------------------------------------------------------


def perturbed_copy(base, out, scale: float = 0.02):
    """`base` with noise added to every MLP weight: the same architecture and tokenizer, other weights."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, out)
    weights = load_file(str(base / "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    save_file({k: v + scale * torch.randn(v.shape, generator=generator).to(v.dtype) if ".mlp." in k else v
               for k, v in weights.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_only_a_folder_of_the_same_shape_and_tokenizer_loads_in_place(tmp_path):
    import json
    import shutil

    from lightning_otel.serve.engine import same_model_shape
    from lightning_otel.serve.model import bundled_model_dir

    base = bundled_model_dir()
    copy = tmp_path / "copy"
    shutil.copytree(base, copy, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32", "_name_or_path": "x"}))
    assert same_model_shape(base, copy)
    (copy / "config.json").write_text(json.dumps({**config, "num_hidden_layers": config["num_hidden_layers"] + 1}))
    assert not same_model_shape(base, copy)
    (copy / "config.json").write_text(json.dumps(config))
    tokenizer = json.loads((copy / "tokenizer_config.json").read_text())
    # transformers records where a tokenizer was loaded from: not a difference (a trained checkpoint's says false)
    (copy / "tokenizer_config.json").write_text(json.dumps({**tokenizer, "local_files_only": False}))
    assert same_model_shape(base, copy)
    (copy / "tokenizer_config.json").write_text("{}")
    assert not same_model_shape(base, copy)
    assert not same_model_shape(base, tmp_path / "missing")


@pytest.mark.heavy
def test_full_weights_load_into_the_running_engine_without_a_restart(engine, tmp_path):
    engine.use_base()
    mod = perturbed_copy(engine.base_dir, tmp_path / "perturbed")
    body = {"messages": [{"role": "user", "content": "Name three SQL keywords."}], "max_tokens": 12,
            "temperature": 0}

    def answer() -> tuple[list[int], list[float]]:
        choice = engine.generate("/v1/chat/completions", dict(body))["choices"][0]
        return choice["token_ids"], [x["logprob"] for x in choice["logprobs"]["content"]]

    base = answer()  # this prompt is now in vLLM's prefix cache, computed with the base weights
    reloads, restarts, process = engine.reloads, engine.restarts, engine.process
    engine.load_model(mod, 7)
    assert (engine.reloads, engine.restarts, engine.process) == (reloads + 1, restarts, process)
    assert engine.config.model_dir == mod and engine.policy_version == 7
    moved = answer()
    gap = sum(abs(a - b) for a, b in zip(base[1], moved[1])) / len(base[1])
    assert moved[0] != base[0] or gap > 0.02, "the engine still answers with the base weights"
    engine._post("/reset_prefix_cache", {}, timeout=60)
    assert answer() == moved  # the first answer after the load did not reuse the base weights' cached prompt
    engine.use_base()
    assert (engine.reloads, engine.restarts) == (reloads + 2, restarts) and engine.policy_version == 0
    assert answer() == base  # back on the base weights, exactly
