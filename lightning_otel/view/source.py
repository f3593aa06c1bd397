"""Where the viewer reads from: the live collector's read-only query endpoint (with the query token from
`<db>.collector.json`), or a read-only connection to the file when no collector holds it. Also the tokens a
viewer request must carry when the store is live, and the one write the viewer makes: a person's score through
the collector's admin route POST /v1/feedback, with the admin token the person gave."""
from __future__ import annotations

import hmac
import logging
import threading
import urllib.error
import urllib.request
from pathlib import Path

import orjson
import polars as pl

from lightning_otel.errors import UserError
from lightning_otel.span_store import client, discovery, store
from lightning_otel.span_store.feedback import FIELDS, Feedback

log = logging.getLogger(__name__)
WRITE_TIMEOUT_S = 30.0


class StoreSource:
    """Read statements on one store. Holds a read-only connection only while no collector holds the file."""

    def __init__(self, db: Path):
        self.db = Path(db)
        if not self.db.exists():
            raise UserError(f"no trace store at {self.db}: give the DuckDB file of `lightning-otel collect` "
                            f"(--db) or a run folder (--run)")
        self._lock = threading.Lock()
        self._reader: store.Reader | None = None
        self._known_tokens: list[str] = []  # once seen live, pages keep needing its tokens after it stops

    def collector(self) -> discovery.CollectorInfo | None:
        """The live collector holding the store; None while the viewer reads the file itself."""
        return None if self._reader is not None else discovery.find_collector(self.db)

    def query(self, sql: str) -> pl.DataFrame:
        """One read statement (checked read-only on both paths) as a Polars DataFrame."""
        if self._reader is None and discovery.find_collector(self.db) is not None:
            return client.query(sql, self.db)
        with self._lock:
            if self._reader is None:
                self._reader = store.Reader(store.connect(self.db, read_only=True))
        return pl.from_arrow(self._reader.arrow(sql))  # type: ignore[return-value]

    def read_tokens(self) -> list[str]:
        """Tokens of which a viewer request must carry one: the live collector's query and admin tokens, still
        asked for after that collector stops (the page stays as closed as it was); none for a file that no
        collector held while the viewer ran, or when the collector's query role is open."""
        info = self.collector()
        if info is None:
            return self._known_tokens
        if "query" not in info.tokens:  # a role without a token is open (discovery.py)
            return []
        self._known_tokens = [t for t in (info.tokens.get("query"), info.tokens.get("admin")) if t]
        return self._known_tokens

    def write_feedback(self, score: Feedback, admin_token: str | None) -> dict:
        """Send a score to the live collector with the admin token the person gave; refused (UserError) without
        a live collector, without an admin token there, or without the right token here."""
        info = self.collector()
        if info is None:
            raise PermissionError("the viewer reads this store read-only and no collector holds it: start "
                                  "`lightning-otel collect --db ... --admin-token ...` to take scores here, or "
                                  "use `lightning-otel feedback`")
        expected = info.tokens.get("admin")
        if not expected:
            raise PermissionError("the collector holding this store has no admin token, so the viewer takes no "
                                  "scores: restart it with --admin-token (or --token), or use `lightning-otel "
                                  "feedback`")
        if not admin_token or not hmac.compare_digest(admin_token.encode(), expected.encode()):
            raise PermissionError("a score needs the collector's admin token: give it in the form's admin token "
                                  "field (the query token only reads)")
        body = orjson.dumps({key: getattr(score, key) for key in FIELDS})
        request = urllib.request.Request(info.url + "/v1/feedback", data=body, method="POST", headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {admin_token}"})
        try:
            with urllib.request.urlopen(request, timeout=WRITE_TIMEOUT_S) as response:
                return orjson.loads(response.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode("utf-8", errors="replace")
            try:
                detail = orjson.loads(detail).get("message", detail)
            except (orjson.JSONDecodeError, AttributeError):
                pass
            raise UserError(f"the collector refused the score: {detail}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise UserError(f"cannot reach the collector at {info.url}: {exc}") from None

    def close(self) -> None:
        with self._lock:
            if self._reader is not None:
                self._reader.con.close()
                self._reader = None


def literal(value: str) -> str:
    return client.sql_literal(value)
