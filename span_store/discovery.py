"""Finding a running collector: `<db>.collector.json` next to the DuckDB file (DESIGN §7).

The collector writes the file (pid, host, port, its token per role) once it listens and removes it on exit.
A file whose pid is dead is stale (the collector was killed) and is removed by whoever finds it.

Roles: `ingest` may send OTLP (/v1/traces, /v1/logs), `query` may read (/v1/query), `admin` may do both and
write (/v1/prune, /v1/records: tasks, rollout runs, computed rewards; /v1/feedback: human scores). A role
without a token is open.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROLES = ("ingest", "query", "admin")
ROUTE_ROLES = {"/v1/traces": "ingest", "/v1/logs": "ingest", "/v1/query": "query",
               "/v1/prune": "admin", "/v1/records": "admin", "/v1/feedback": "admin"}


@dataclass(frozen=True)
class CollectorInfo:
    pid: int
    host: str
    port: int
    db: str
    version: str
    tokens: dict[str, str] = field(default_factory=dict)  # role -> token, for the roles that need one

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def ingest_token(self) -> str | None:
        """The token to hand agents and exporters: the ingest role's own, never the admin one."""
        return self.tokens.get("ingest")

    def token_for(self, path: str) -> str | None:
        """The token a request to `path` needs: its role's, else the admin token (which grants every role)."""
        return self.tokens.get(ROUTE_ROLES.get(path, "admin")) or self.tokens.get("admin")


def info_path(db: Path | str) -> Path:
    db = Path(db).absolute()
    return db.with_name(db.name + ".collector.json")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_info(db: Path | str, info: CollectorInfo) -> Path:
    """Write atomically with owner-only permissions: the file holds the access token."""
    path = info_path(db)
    fd, tmp = tempfile.mkstemp(prefix=path.name, dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(asdict(info), fh)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def remove_info(db: Path | str, pid: int) -> None:
    """Remove the file only if it is still ours (a later collector may have replaced it)."""
    path = info_path(db)
    current = read_info(path, clean_stale=False)
    if current is not None and current.pid == pid:
        path.unlink(missing_ok=True)


def read_info(path: Path, clean_stale: bool = True) -> CollectorInfo | None:
    try:
        raw = json.loads(path.read_text())
        tokens = raw.get("tokens")
        if tokens is None and raw.get("token"):  # written by a collector with one token for every role
            tokens = dict.fromkeys(ROLES, raw["token"])
        info = CollectorInfo(pid=int(raw["pid"]), host=str(raw["host"]), port=int(raw["port"]),
                             db=str(raw.get("db", "")), version=str(raw.get("version", "")),
                             tokens={str(k): str(v) for k, v in (tokens or {}).items() if v})
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, AttributeError, OSError):
        if clean_stale:
            path.unlink(missing_ok=True)  # unreadable leftovers would otherwise block every command
        return None
    if clean_stale and not pid_alive(info.pid):
        path.unlink(missing_ok=True)
        return None
    return info


def find_collector(db: Path | str) -> CollectorInfo | None:
    """The live collector holding `db`, or None (a stale file is cleaned on the way)."""
    return read_info(info_path(db))
