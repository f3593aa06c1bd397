"""Models named by Hugging Face hub id (`org/name[@revision]`), resolved through huggingface_hub's cache.

The cache is built on disk in the hub library's own layout (models--org--name/{blobs,refs,snapshots}), its
blobs being the bundled model's files, and every test runs with HF_HUB_OFFLINE=1 or against a fake hub on
127.0.0.1: nothing here reaches huggingface.co (there is no network where the tests run). Serving a hub id with
the engine is not tested here: the shared engine serves the bundled model, and a second engine costs a minute.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from lightning_otel.errors import UserError
from lightning_otel.serve.engine import EngineConfig, engine_cpu_env, engine_env
from lightning_otel.serve.hub import hub_model_of_path, parse_hub_id, recorded_model, resolve_hub_model
from lightning_otel.serve.model import bundled_model_dir, resolve_model
from lightning_otel.serve.policy import resolve_policy
from lightning_otel.train.checkpoints import export_policy
from tests.helpers.loopback import LoopbackServer, QuietHandler

REPO = "acme/tiny-chat"
MAIN = "a" * 40   # the commit refs/main names
TAGGED = "b" * 40  # an older commit, tagged v1


def add_snapshot(cache: Path, repo: str, commit: str, files: dict[str, Path], refs: tuple[str, ...] = ()) -> Path:
    """One commit of `repo` in a hub cache, laid out as huggingface_hub writes it: file contents in blobs/ under
    their hash, the snapshot's files symlinks to them, refs/<name> holding the commit a branch or tag names."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir(exist_ok=True)
    for name, source in files.items():
        blob = root / "blobs" / hashlib.sha256(f"{source}".encode()).hexdigest()
        if not blob.exists():
            blob.symlink_to(source.resolve())  # the bundled model's bytes, not copied
        (snapshot / name).symlink_to(Path("../..") / "blobs" / blob.name)
    for ref in refs:
        (root / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (root / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """A hub cache holding acme/tiny-chat at two commits (main, and v1), offline as the tests must be."""
    cache = tmp_path / "hf" / "hub"
    bundled = bundled_model_dir()
    files = {p.name: p for p in bundled.iterdir() if p.is_file()}
    add_snapshot(cache, REPO, MAIN, files, refs=("main",))
    add_snapshot(cache, REPO, TAGGED, files, refs=("v1",))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # relative names such as acme/tiny-chat must not be folders here
    return cache


def snapshot(cache: Path, commit: str) -> Path:
    return cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / commit


def test_hub_ids_are_told_apart_from_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert parse_hub_id("Qwen/Qwen2.5-0.5B-Instruct") == ("Qwen/Qwen2.5-0.5B-Instruct", None)
    assert parse_hub_id("Qwen/Qwen2.5-0.5B-Instruct@v1.0") == ("Qwen/Qwen2.5-0.5B-Instruct", "v1.0")
    for not_an_id in ("bundled", "./acme/x", "/abs/x", "~/x", "a/b/c", "acme/x@", "acme/x@a@b", ""):
        assert parse_hub_id(not_an_id) is None, not_an_id
    (tmp_path / "acme" / "x").mkdir(parents=True)
    assert parse_hub_id("acme/x") is None  # an existing folder wins over the hub


def test_a_cached_id_resolves_to_its_snapshot_by_branch_tag_or_commit(hub_cache):
    assert resolve_model(REPO) == snapshot(hub_cache, MAIN)  # no revision: refs/main
    assert resolve_model(f"{REPO}@main") == snapshot(hub_cache, MAIN)
    assert resolve_model(f"{REPO}@v1") == snapshot(hub_cache, TAGGED)  # a tag's ref
    assert resolve_model(f"{REPO}@{TAGGED}") == snapshot(hub_cache, TAGGED)  # a commit: its snapshot, no ref read
    hub = resolve_hub_model(f"{REPO}@v1")
    assert (hub.repo_id, hub.revision, hub.commit, hub.spec, hub.pinned) == (REPO, "v1", TAGGED, f"{REPO}@v1",
                                                                             f"{REPO}@{TAGGED}")
    # eval, serve and rollout --model take the same ids: a base policy on the snapshot, labelled by the id.
    policy = resolve_policy(f"{REPO}@v1")
    assert (policy.base_model, policy.adapter, policy.label, policy.version) == (snapshot(hub_cache, TAGGED), None,
                                                                                 f"{REPO}@v1", 0)


def test_hf_hub_cache_wins_over_hf_home(hub_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "elsewhere"))
    with pytest.raises(UserError, match="not in the hub cache"):
        resolve_model(REPO)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    assert resolve_model(REPO) == snapshot(hub_cache, MAIN)


def test_the_snapshot_loads_as_a_model_folder(hub_cache):
    """The rest of the code takes the snapshot as any local folder: here the tokenizer compile re-tokenises with."""
    from lightning_otel.train.transitions.trajectories import load_tokenizer

    tokenizer, why = load_tokenizer(f"{REPO}@v1")
    assert why is None
    ids = tokenizer.tokenizer("SELECT 1")["input_ids"]
    assert ids and tokenizer.tokenizer.decode(ids) == "SELECT 1"


def test_a_missing_id_offline_names_the_id_and_how_to_fetch_it(hub_cache):
    with pytest.raises(UserError) as caught:
        resolve_model("acme/absent-model")
    message = str(caught.value)
    assert "acme/absent-model" in message and "HF_HUB_OFFLINE is set" in message
    assert "hf download acme/absent-model" in message and str(hub_cache) in message
    with pytest.raises(UserError, match=r"acme/absent-model@v2.*hf download acme/absent-model --revision v2"):
        resolve_policy("acme/absent-model@v2")


def test_a_revision_the_cache_lacks_gets_its_own_error(hub_cache):
    with pytest.raises(UserError) as caught:
        resolve_model(f"{REPO}@nope")
    message = str(caught.value)
    assert f"revision 'nope' of {REPO} is not in the hub cache" in message
    assert f"main ({MAIN[:12]})" in message and f"v1 ({TAGGED[:12]})" in message  # what can be asked for instead
    assert f"hf download {REPO} --revision nope" in message
    with pytest.raises(UserError, match=f"revision '{'c' * 40}' of {REPO} is not in the hub cache"):
        resolve_model(f"{REPO}@{'c' * 40}")


def test_a_snapshot_without_config_or_weights_is_refused(hub_cache):
    bundled = bundled_model_dir()
    add_snapshot(hub_cache, "acme/no-config", MAIN, {"tokenizer.json": bundled / "tokenizer.json"}, ("main",))
    with pytest.raises(UserError, match="has no config.json, so it is not a Hugging Face model"):
        resolve_model("acme/no-config")
    add_snapshot(hub_cache, "acme/no-weights", MAIN, {"config.json": bundled / "config.json"}, ("main",))
    with pytest.raises(UserError, match=r"holds no weights.*hf download acme/no-weights"):
        resolve_model("acme/no-weights")


class FakeHub(QuietHandler):
    """The hub's answers when a repository or revision does not exist, or is gated (its X-Error-Code header)."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        code = ("RevisionNotFound" if "/revision/nope" in self.path else "GatedRepo" if "gated" in self.path
                else "RepoNotFound")
        self.answer(403 if code == "GatedRepo" else 404, {"error": code}, headers={"X-Error-Code": code})


def go_online(monkeypatch, endpoint: str) -> None:
    """Let the hub library make requests, to `endpoint` only. It reads HF_HUB_OFFLINE once, at its import (in a
    test process perhaps while another test had it set), so its copy is reset too."""
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", endpoint)


@pytest.fixture
def fake_hub(hub_cache, monkeypatch):
    with LoopbackServer(FakeHub) as server:
        go_online(monkeypatch, server.url)
        monkeypatch.setenv("HF_TOKEN", "")
        yield server


def test_online_the_hub_answers_for_missing_repositories_and_revisions(fake_hub):
    with pytest.raises(UserError, match=r"no such local folder, and no model acme/absent-model on the Hugging Face "
                                        r"hub \(or it is private"):
        resolve_model("acme/absent-model")
    with pytest.raises(UserError, match=f"the hub has no revision 'nope' of {REPO}"):
        resolve_model(f"{REPO}@nope")
    with pytest.raises(UserError, match="acme/gated-model: the model is gated: accept its terms"):
        resolve_model("acme/gated-model")


def test_unreachable_hub_falls_back_to_the_cache(hub_cache, monkeypatch):
    """No HF_HUB_OFFLINE, but nothing answers (a closed port stands for no network): cached ids still resolve."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    go_online(monkeypatch, f"http://127.0.0.1:{port}")
    assert resolve_model(f"{REPO}@v1") == snapshot(hub_cache, TAGGED)
    with pytest.raises(UserError, match=r"acme/absent-model is not in the hub cache .* while the hub could not be "
                                        r"reached; fetch it"):
        resolve_model("acme/absent-model")


def test_the_engine_is_not_forced_offline(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    config = EngineConfig(model_dir=folder, python="python")
    env = engine_env(config, {"PATH": "/bin", "OTEL_SERVICE_NAME": "x"})
    assert "HF_HUB_OFFLINE" not in env and "OTEL_SERVICE_NAME" not in env and env["PATH"] == "/bin"
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert engine_env(config, {"HF_HUB_OFFLINE": "1"})["HF_HUB_OFFLINE"] == "1"  # the user's setting passes


def test_an_engines_own_environment_counts_as_the_users(tmp_path):
    """EngineConfig.env: over this process's environment, and like a setting the user exported it wins over the
    engine's CPU settings (engine_cpu_env), for this engine only."""
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    own = {"OMP_WAIT_POLICY": "ACTIVE", "VLLM_CPU_OMP_THREADS_BIND": "0", "PATH": "/usr/bin",
           "OTEL_SERVICE_NAME": "x"}
    env = engine_env(EngineConfig(model_dir=folder, python="python", env=own), {"PATH": "/bin"})
    assert env["OMP_WAIT_POLICY"] == "ACTIVE" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in env and env["PATH"] == "/usr/bin" and "OTEL_SERVICE_NAME" not in env
    plain = engine_env(EngineConfig(model_dir=folder, python="python"), {"PATH": "/bin"})
    assert plain["PATH"] == "/bin" and "VLLM_CPU_OMP_THREADS_BIND" not in plain
    assert plain.get("OMP_WAIT_POLICY") == engine_cpu_env({}).get("OMP_WAIT_POLICY")  # PASSIVE on a small CPU


def make_hub_run(root: Path, hub_model: str, base_dir: Path) -> Path:
    """A run folder as the trainer leaves it after training a LoRA on a hub model (PEFT wrote the snapshot
    folder as the adapter's base), with validation rounds and an eval report inside."""
    adapter = root / "checkpoints" / "round-0002" / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
        "base_model_name_or_path": str(base_dir), "revision": None}))
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    (root / "run.json").write_text(json.dumps({"model": hub_model, "rounds_completed": 2, "policy_version": 1,
                                               "last": "checkpoints/round-0002", "best": "checkpoints/round-0002",
                                               "best_metric": 0.5}))
    (root / "config.toml").write_text(f'model = "{REPO}"\nlr = 2e-05\nrounds = 2\n')
    (root / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"round": 0, "phase": "validation", "policy_version": 0, "val_accuracy": 0.25, "val_reward_mean": 0.25,
         "val_rollouts": 8},
        {"round": 1, "phase": "grpo", "reward_mean": 0.3},
        {"round": 2, "phase": "grpo", "policy_version": 1, "val_accuracy": 0.5, "val_reward_mean": 0.5,
         "val_rollouts": 8}]) + "\n")
    report = root / "eval"
    report.mkdir()
    (report / "summary.json").write_text(json.dumps({
        "config": {"tasks": "dev.jsonl", "n": 2}, "policy": {"label": "run/checkpoints/round-0002"}, "tasks": 10,
        "reward": "spider_exec", "accuracy": {"overall": {"accuracy": 0.45, "ci95": [0.3, 0.6], "correct": 9,
                                                          "scored": 20}}}))
    return root


def test_a_run_on_a_hub_model_records_and_exports_the_hub_id(hub_cache, tmp_path):
    base = snapshot(hub_cache, MAIN)
    assert recorded_model(base) == f"{REPO}@{MAIN}"  # what the trainer writes as run.json's model
    assert recorded_model(bundled_model_dir()) == str(bundled_model_dir())
    assert hub_model_of_path(base).repo_id == REPO
    run = make_hub_run(tmp_path / "run", recorded_model(base), base)
    policy = resolve_policy(run)
    assert policy.base_model == base and policy.adapter == run / "checkpoints" / "round-0002" / "adapter"

    out = export_policy(str(run), tmp_path / "exported")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == REPO and config["revision"] == MAIN
    assert (out / "adapter_model.safetensors").read_bytes() == b"weights"
    card = (out / "README.md").read_text()
    assert card.startswith(f"---\nbase_model: {REPO}\nlibrary_name: peft\n")
    assert f"`{REPO}` (Hugging Face hub, revision `{MAIN}`)" in card
    assert f'```toml\nmodel = "{REPO}"\nlr = 2e-05\nrounds = 2\n```' in card  # the training config
    assert "| 0 | 0 | 25.0% | 0.250 | 8 |" in card and "| 2 | 1 | 50.0% | 0.500 | 8 |" in card  # validation
    assert "accuracy 45.0% (9/20 scored rollouts; 95% interval 30.0% to 60.0%)" in card  # the run's eval report

    # The exported adapter, alone, finds its base again by hub id and revision (from the cache, offline).
    alone = resolve_policy(out)
    assert alone.base_model == base and alone.adapter == out


def test_export_of_a_bundled_run_writes_a_card_without_a_hub_id(tmp_path):
    bundled = bundled_model_dir()
    run = make_hub_run(tmp_path / "run", recorded_model(bundled), bundled)  # the trainer records the folder
    (run / "eval" / "summary.json").unlink()
    out = export_policy(str(run), tmp_path / "exported")
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(bundled)
    card = (out / "README.md").read_text()
    assert "base_model:" not in card and "the bundled SmolLM2-135M-Instruct" in card
    with pytest.raises(UserError, match="--eval-report .*: no summary.json there"):
        export_policy(str(run), tmp_path / "again", eval_reports=[tmp_path])


def test_export_of_a_hub_id_copies_the_snapshot_with_its_own_card_kept(hub_cache, tmp_path):
    readme = tmp_path / "upstream-README.md"
    readme.write_text("# upstream card\n")
    weights = tmp_path / "small.safetensors"  # a full copy is what is checked, not the bytes: keep them few
    weights.write_bytes(b"weights")
    files = {"config.json": bundled_model_dir() / "config.json", "model.safetensors": weights, "README.md": readme}
    add_snapshot(hub_cache, "acme/with-card", MAIN, files, ("main",))
    out = export_policy("acme/with-card", tmp_path / "copy")
    assert not (out / "model.safetensors").is_symlink() and (out / "model.safetensors").read_bytes() == b"weights"
    assert (out / "BASE_README.md").read_text() == "# upstream card\n"
    card = (out / "README.md").read_text()
    assert card.startswith("---\nbase_model: acme/with-card\nlibrary_name: transformers\n")
    assert "No training run folder was found" in card and "No evaluation is recorded" in card
