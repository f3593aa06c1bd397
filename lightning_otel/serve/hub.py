"""Models named by a Hugging Face hub id: `org/name`, or `org/name@revision` (a branch, a tag or a commit hash).

    hub = resolve_hub_model("Qwen/Qwen2.5-0.5B-Instruct@main")
    hub.path      # the snapshot folder in the hub cache, used like any local model folder
    hub.pinned    # "Qwen/Qwen2.5-0.5B-Instruct@<commit>": what a run records, so it resumes on the same weights

Resolution goes through `huggingface_hub.snapshot_download` and its cache ($HF_HUB_CACHE, else $HF_HOME/hub,
else ~/.cache/huggingface/hub), so a model fetched with `hf download` or by transformers is found there. With
$HF_HUB_OFFLINE set only the cache is read; otherwise the hub is asked which commit the revision names and
what is missing is downloaded (weights as safetensors, else PyTorch .bin; config and tokenizer files). A model
the cache lacks while the hub cannot be reached is a UserError that names the id, the revision and the command
that fetches it. The cache, $HF_HUB_OFFLINE and $HF_ENDPOINT are read at each call, not at import.
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from lightning_otel.errors import UserError

log = logging.getLogger(__name__)

HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)(?:@(?P<revision>[^\s@]+))?")
COMMIT = re.compile(r"[0-9a-f]{40}")
SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<commit>[^/]+)/?$")
TRUE = ("1", "ON", "YES", "TRUE")
# What a causal LM needs: config, tokenizer, chat template, weights. Duplicate weight copies some repos carry
# (Meta's original/ folder, Mistral's consolidated file) and other formats (GGUF, ONNX) are left on the hub.
FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken", "tokenizer*"]
SKIPPED = ["original/*", "consolidated*", "onnx/*", "*.gguf"]
PYTORCH_WEIGHTS = ["pytorch_model*.bin"]


@dataclass(frozen=True)
class HubModel:
    repo_id: str            # "org/name"
    revision: str | None    # as named (None: the default branch)
    commit: str             # the snapshot's commit hash
    path: Path              # its snapshot folder in the hub cache

    @property
    def spec(self) -> str:
        return f"{self.repo_id}@{self.revision}" if self.revision else self.repo_id

    @property
    def pinned(self) -> str:
        return f"{self.repo_id}@{self.commit}"


def parse_hub_id(text: str | os.PathLike | None) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when `text` has the shape of a hub id, else None. A path that exists, or that
    starts with /, ., ~ or names more than two levels, is never a hub id."""
    if text is None:
        return None
    text = str(text).strip()
    match = HUB_ID.fullmatch(text)
    if match is None or Path(text).expanduser().exists():
        return None
    return match["repo"], match["revision"]


def hub_cache_dir() -> Path:
    """The hub cache the huggingface_hub library uses, read from the environment now (not at its import)."""
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if cache:
        return Path(os.path.expandvars(cache)).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(os.path.expandvars(str(home))).expanduser() / "hub"


def hub_offline() -> bool:
    """Whether the user turned the hub off ($HF_HUB_OFFLINE, or transformers' $TRANSFORMERS_OFFLINE)."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in TRUE


def hub_model_of_path(path: Path | str) -> HubModel | None:
    """The hub model a folder is the snapshot of, when it lies in a hub cache (models--org--name/snapshots/<commit>)."""
    match = SNAPSHOT.search(Path(path).as_posix())
    if match is None:
        return None
    return HubModel(f"{match['org']}/{match['name']}", None, match["commit"], Path(path))


def recorded_model(path: Path | str) -> str:
    """How a run records the base model folder it trained: a hub snapshot as its pinned id (`org/name@<commit>`,
    which resolves to the same weights on any machine that has it cached), any other folder as its path."""
    hub = hub_model_of_path(path)
    return hub.pinned if hub else str(path)


def resolve_hub_model(text: str, what: str = "--model", local_only: bool = False) -> HubModel:
    """The snapshot folder of hub id `text` (`org/name[@revision]`): from the cache, downloaded first when the hub
    can be reached (unless `local_only`). `what` names the setting in error messages."""
    parsed = HUB_ID.fullmatch(str(text).strip())
    if parsed is None:
        raise UserError(f"{what} {text}: not a Hugging Face hub id; write it as org/name or org/name@revision")
    repo_id, revision = parsed["repo"], parsed["revision"]
    offline = local_only or hub_offline()
    path = Path(_snapshot(repo_id, revision, what, offline, FILES))
    if not (path / "config.json").is_file():
        raise UserError(f"{what} {text}: the snapshot {path} has no config.json, so it is not a Hugging Face model "
                        f"(a dataset or another kind of repository?); give a model's id")
    if not any(path.glob("*.safetensors")) and not any(path.glob("pytorch_model*.bin")) and not offline:
        path = Path(_snapshot(repo_id, revision, what, offline, PYTORCH_WEIGHTS))
    if not any(path.glob("*.safetensors")) and not any(path.glob("pytorch_model*.bin")):
        raise UserError(f"{what} {text}: the snapshot {path} holds no weights (*.safetensors or pytorch_model*.bin); "
                        f"{_fetch_hint(repo_id, revision)}")
    hub = HubModel(repo_id, revision, path.name, path)
    log.info("%s %s: hub snapshot %s", what, hub.spec, path)
    return hub


def _snapshot(repo_id: str, revision: str | None, what: str, offline: bool, patterns: list[str]) -> str:
    try:
        from huggingface_hub import errors, snapshot_download
    except ImportError:
        raise UserError(f"{what} {repo_id}: hub ids need the huggingface_hub package: pip install huggingface_hub "
                        f"(it comes with lightning-otel[train])") from None
    named = f"{what} {_label(repo_id, revision)}"
    cache = hub_cache_dir()
    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=offline,
                                 allow_patterns=patterns, ignore_patterns=SKIPPED,
                                 endpoint=os.environ.get("HF_ENDPOINT") or None)
    except errors.HFValidationError as exc:
        raise UserError(f"{named}: not a valid Hugging Face hub id ({exc})") from None
    except errors.GatedRepoError:
        raise UserError(f"{named}: the model is gated: accept its terms on huggingface.co/{repo_id}, then log in "
                        f"with `hf auth login` (or set HF_TOKEN)") from None
    except errors.RevisionNotFoundError:
        raise UserError(f"{named}: the hub has no revision {revision!r} of {repo_id} (a branch, tag or full commit "
                        f"hash); leave @{revision} out for the default branch") from None
    except errors.RepositoryNotFoundError:
        raise UserError(f"{named}: no such local folder, and no model {repo_id} on the Hugging Face hub (or it is "
                        f"private: log in with `hf auth login` or set HF_TOKEN)") from None
    except errors.LocalEntryNotFoundError as exc:
        incomplete = isinstance(exc, getattr(errors, "IncompleteSnapshotError", ()))
        raise UserError(_not_cached(repo_id, revision, named, cache, offline, incomplete)) from None


def _not_cached(repo_id: str, revision: str | None, named: str, cache: Path, offline: bool, incomplete: bool) -> str:
    why = ("HF_HUB_OFFLINE is set" if hub_offline() else "only the cache was asked" if offline
           else "the hub could not be reached")
    repo_dir = cache / f"models--{repo_id.replace('/', '--')}"
    cached = _cached_revisions(repo_dir)
    if incomplete:
        return (f"{named}: the cached snapshot in {repo_dir} is incomplete (an interrupted download?) and {why}; "
                f"{_fetch_hint(repo_id, revision)}")
    if cached and revision:
        return (f"{named}: revision {revision!r} of {repo_id} is not in the hub cache {cache} and {why} (cached: "
                f"{', '.join(cached)}); give one of those, or {_fetch_hint(repo_id, revision)}")
    return (f"{named}: no such local folder, and the Hugging Face model {_label(repo_id, revision)} is not in the hub "
            f"cache {cache} while {why}; {_fetch_hint(repo_id, revision)}")


def _cached_revisions(repo_dir: Path) -> list[str]:
    """What a cached repository can be asked for offline: its refs (branch/tag -> commit) and snapshot commits."""
    refs = sorted(p for p in (repo_dir / "refs").rglob("*") if p.is_file()) if (repo_dir / "refs").is_dir() else []
    named = [f"{p.relative_to(repo_dir / 'refs').as_posix()} ({p.read_text().strip()[:12]})" for p in refs]
    snapshots = sorted(p.name for p in (repo_dir / "snapshots").iterdir()) if (repo_dir / "snapshots").is_dir() else []
    return named + [f"commit {c}" for c in snapshots]


def _label(repo_id: str, revision: str | None) -> str:
    return f"{repo_id}@{revision}" if revision else repo_id


def _fetch_hint(repo_id: str, revision: str | None) -> str:
    option = f" --revision {revision}" if revision else ""
    return (f"fetch it where the hub is reachable with `hf download {repo_id}{option}` (huggingface_hub's CLI; older "
            f"releases call it huggingface-cli), into the same cache (HF_HUB_CACHE / HF_HOME), or run once with "
            f"network and without HF_HUB_OFFLINE")
