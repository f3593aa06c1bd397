"""The collector's settings (`lightning-otel collect`'s flags), checked when made, and the private collector
a command starts for its own run."""
from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path
from typing import Any

from lightning_otel.errors import UserError
from lightning_otel.httpserver import ConnectionLimits, check_exposure
from lightning_otel.span_store import discovery, store
from lightning_otel.span_store.forwarding import ForwardConfig


@dataclass
class CollectorConfig:
    db: Path
    host: str = "127.0.0.1"
    port: int = 4318
    token: str | None = None  # for every role not given its own token below
    ingest_token: str | None = None  # OTLP in (/v1/traces, /v1/logs): what agents are handed
    query_token: str | None = None  # reads (/v1/query)
    admin_token: str | None = None  # every route, and the only one for /v1/prune and /v1/records
    max_body_bytes: int = 32 * 1024 * 1024
    max_pending_rows: int = 200_000
    max_inflight_requests: int = 32
    retry_after_s: int = 1
    query_timeout_s: float = 120.0
    # Queries get slots of their own (ingest keeps max_inflight_requests whatever queries do), and one token
    # (one caller) at most max_queries_per_token of them.
    max_concurrent_queries: int = 4
    max_queries_per_token: int = 2
    max_admin_requests: int = 4
    query_send_timeout_s: float = 30.0  # a client that does not read its answer is cut off after this
    memory_limit: str = "2GB"
    # A query's answer is held whole before it is sent (so a bound hit is a 413, not a cut stream).
    max_result_rows: int = 5_000_000
    max_result_bytes: int = 512 * 1024 * 1024
    # Queries are interrupted while the process's resident memory is over this size ("auto": memory_limit + 1GB;
    # `collect`'s default). None: no such bound, for a collector inside another process (the commands' own, in
    # the trainer beside its model), whose resident memory is not the collector's alone.
    max_query_memory: str | None = None
    max_temp_size: str = "10GB"  # what queries may spill to <db>.tmp (DuckDB's default: 90% of the disk)
    # DuckDB's default (16 MB of WAL) checkpoints every ~13k spans and rewrites the open row group each
    # time; 256 MB doubled sustained ingest (benchmarks/RESULTS.md) for at most that much WAL to replay.
    checkpoint_threshold: str = "256MB"
    decode_workers: int = field(default_factory=lambda: default_decode_workers())
    # DuckDB's threads (inserts and queries alike): one core is left to the request threads and decoders, so a
    # query cannot take every core from ingest (benchmarks/RESULTS.md, "ingest under attack").
    threads: int = field(default_factory=lambda: default_threads())
    connection_limits: ConnectionLimits = field(default_factory=ConnectionLimits)  # slow clients
    # A host other than loopback with a role that needs no token is refused unless this is set: anyone on the
    # network could then read every task's answers or write rewards.
    insecure_no_auth: bool = False
    # Every committed OTLP body is also sent on to this OTLP/HTTP endpoint, in the background (forwarding.py).
    forward: ForwardConfig | None = None

    def __post_init__(self) -> None:
        self.db = Path(self.db)
        if not 0 <= self.port <= 65535:
            raise UserError(f"--port {self.port} is not a TCP port (0-65535; 0 picks a free one)")
        if self.max_body_bytes < 1024:
            raise UserError(f"--max-body-bytes {self.max_body_bytes} is too small (at least 1024)")
        for name in ("max_pending_rows", "max_inflight_requests", "max_concurrent_queries", "max_queries_per_token",
                     "max_admin_requests", "max_result_rows", "max_result_bytes", "threads"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} {getattr(self, name)}: give a positive number")
        for name in ("query_timeout_s", "query_send_timeout_s"):
            if not getattr(self, name) > 0:
                raise UserError(f"--{name.replace('_', '-')} {getattr(self, name)}: give a positive number of seconds")
        self.query_limits()  # sizes that do not parse fail here, not on the first query
        store.parse_size(self.max_temp_size)
        if self.decode_workers < 0:
            raise UserError("--decode-workers must be 0 (decode in the server process) or more")
        for role in (None, *discovery.ROLES):
            if getattr(self, f"{role}_token" if role else "token") == "":
                raise UserError(f"--{role + '-' if role else ''}token is empty: give a token, or leave it out "
                                f"(a role without a token accepts requests without one)")
        tokens = self.role_tokens()
        open_roles = [role for role in discovery.ROLES if role not in tokens]
        if not self.insecure_no_auth:
            check_exposure(self.host, not open_roles, f"the {', '.join(open_roles)} role(s) need a token: give "
                                                      f"--token (one for every role) or a token per role")
        for a, b in combinations(discovery.ROLES, 2):
            explicit = getattr(self, f"{a}_token") is not None or getattr(self, f"{b}_token") is not None
            if explicit and a in tokens and tokens.get(a) == tokens.get(b):
                raise UserError(f"the {a} and {b} roles have the same token: give each role its own (an agent "
                                f"holding the ingest token must not read the store or write rewards), or give "
                                f"only --token for one token for every role")

    def query_limits(self) -> store.QueryLimits:
        resident = (None if self.max_query_memory is None
                    else store.parse_size(self.memory_limit) + 10**9 if self.max_query_memory == "auto"
                    else store.parse_size(self.max_query_memory))
        return store.QueryLimits(self.max_result_rows, self.max_result_bytes, resident)

    def role_tokens(self) -> dict[str, str]:
        """role -> the token it needs, for the roles that need one."""
        tokens = {role: getattr(self, f"{role}_token") or self.token for role in discovery.ROLES}
        return {role: token for role, token in tokens.items() if token is not None}


def private_config(db: Path | str, **overrides: Any) -> CollectorConfig:
    """A collector a command starts for its own run (the trainer, the runner, `serve`): any free port and a fresh
    random token per role. Its agents get the ingest token; the command keeps the others (discovery file)."""
    tokens = {f"{role}_token": secrets.token_urlsafe(32) for role in discovery.ROLES}
    return CollectorConfig(db=Path(db), port=0, **{**tokens, **overrides})


def default_threads() -> int:
    """DuckDB's threads: every core but one (one on a 2-core machine)."""
    return max(1, (os.cpu_count() or 1) - 1)


def default_decode_workers() -> int:
    """One core stays with the writer (DuckDB inserts); the others decode, at most 4."""
    return max(1, min((os.cpu_count() or 1) - 1, 4))
