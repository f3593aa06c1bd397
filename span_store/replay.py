"""Replaying stored rollouts to another OTLP/HTTP endpoint (Phoenix, Langfuse, Jaeger, an OpenTelemetry
Collector), so a run can be browsed there afterwards, with what the run learnt on the spans:

    lightning-otel export --db traces.duckdb --otlp http://127.0.0.1:6006 --where "task_id = 'spider-12'"

Every span of the chosen rollouts is rebuilt as OTLP protobuf (otlp_encode.py) and gets `lightning.reward` (the
rollout's episode reward; `lightning.reward.<name>` per name when it has several); LLM call spans also get
`lightning.advantage` (from the `transitions` view, when the rollout has transitions) and
`lightning.policy.version`. Attributes the span already has are never replaced.

`where` is a SQL condition over the `rollouts` view; every statement goes through the store's read-only
query path (client.reading: the live collector's /v1/query, or the file opened read-only), which refuses
anything but reads. Spans go out in pages of `batch_spans`, so memory stays bounded by a page; each page is one
gzip request, retried like forwarding (forwarding.post_otlp).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import polars as pl
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from lightning_otel.errors import UserError
from lightning_otel.span_store import client
from lightning_otel.span_store.forwarding import PROTOBUF, SIGNAL_PATHS, check_headers, otlp_base_url, post_otlp
from lightning_otel.span_store.otlp_encode import SPAN_COLUMNS, encode_spans
from lightning_otel.span_store.readonly import check_condition, check_read_only

log = logging.getLogger(__name__)

REWARD_KEY = "lightning.reward"
ADVANTAGE_KEY = "lightning.advantage"
POLICY_VERSION_KEY = "lightning.policy.version"
MAX_IDS_PER_PAGE = 200  # rollout ids named in one page's query
# The condition sits on lines of its own, so a trailing `-- comment` in it ends there.
SQL_CHOSEN = "SELECT rollout_id, spans, policy_version FROM rollouts WHERE (\n{where}\n) ORDER BY rollout_id"
SQL_CHOSEN_IDS = "SELECT rollout_id FROM rollouts WHERE (\n{where}\n)"
SQL_REWARDS = f"SELECT rollout_id, reward_name, reward FROM episode_rewards WHERE rollout_id IN ({SQL_CHOSEN_IDS})"
SQL_ADVANTAGES = (f"SELECT rollout_id, reward_name, any_value(advantage) AS advantage FROM transitions "
                  f"WHERE rollout_id IN ({SQL_CHOSEN_IDS}) GROUP BY ALL")
SQL_RECORD_VERSIONS = (f"SELECT rollout_id, min(policy_version) AS policy_version FROM token_records "
                       f"WHERE rollout_id IN ({SQL_CHOSEN_IDS}) GROUP BY rollout_id")
SQL_PAGE = """
SELECT {columns}, rollout_id, coalesce(is_llm_call(name, operation_name), false) AS llm_call FROM spans
WHERE rollout_id IN ({ids}) AND (trace_id > {trace} OR (trace_id = {trace} AND span_id > {span}))
ORDER BY trace_id, span_id LIMIT {limit}
"""


@dataclass
class ReplayConfig:
    db: Path
    url: str  # the endpoint's base (as OTEL_EXPORTER_OTLP_ENDPOINT), or its /v1/traces URL
    where: str | None = None  # SQL condition over the rollouts view; None: every rollout
    headers: dict[str, str] = field(default_factory=dict)
    reward: str | None = None  # the reward name lightning.reward / lightning.advantage carry when there are several
    batch_spans: int = 1000
    max_retry_s: float = 60.0  # one request retried this long while the endpoint is down or busy
    timeout_s: float = 30.0  # one POST

    def __post_init__(self) -> None:
        self.db = Path(self.db)
        self.url = otlp_base_url(self.url, "--otlp")
        check_headers(self.headers, "--header")
        if self.where is not None:
            check_condition(self.where)
        if self.reward is not None and not self.reward.strip():
            raise UserError("--reward is empty: give a reward name (`SELECT DISTINCT name FROM rewards` lists them)")
        if not 1 <= self.batch_spans <= 100_000:
            raise UserError(f"batch of {self.batch_spans} spans: give 1 to 100000")
        if not self.max_retry_s >= 0 or not self.timeout_s > 0:
            raise UserError("the retry and timeout seconds must be positive")

    @property
    def endpoint(self) -> str:
        return self.url + SIGNAL_PATHS["traces"]

    def sql(self, template: str) -> str:
        return template.format(where=self.where if self.where is not None else "true")


@dataclass
class ReplayReport:
    rollouts: int = 0
    spans: int = 0  # spans the endpoint accepted (sent minus those it said it rejected)
    requests: int = 0
    rejected_spans: int = 0  # spans the endpoint answered as rejected (OTLP partial success)
    retries: int = 0


@dataclass
class _Labels:
    """What replay adds, per rollout: attributes for every span, and more for its LLM call spans."""
    every_span: dict[str, dict[str, Any]]
    llm_calls: dict[str, dict[str, Any]]


def replay(config: ReplayConfig, progress: Callable[[ReplayReport, int], None] | None = None) -> ReplayReport:
    """Send every span of the chosen rollouts to config.url. Raises UserError when the selection is wrong or empty,
    or when the endpoint refuses a request or stays down past max_retry_s (saying how much went out before)."""
    report = ReplayReport()
    with client.reading(config.db) as read:
        chosen = _chosen_rollouts(config, read)
        total = int(chosen["spans"].sum() or 0)
        labels = _labels(config, read, chosen)
        report.rollouts = chosen.height
        for page in _pages(config, read, chosen):
            extra = {}
            for row in page:
                added = dict(labels.every_span.get(row["rollout_id"], {}))
                if row["llm_call"]:
                    added.update(labels.llm_calls.get(row["rollout_id"], {}))
                if added:
                    extra[(row["trace_id"], row["span_id"])] = added
            _send(config, encode_spans(page, extra).SerializeToString(), len(page), report, total)
            if progress is not None:
                progress(report, total)
    return report


def _chosen_rollouts(config: ReplayConfig, read: Callable[[str], pl.DataFrame]) -> pl.DataFrame:
    sql = config.sql(SQL_CHOSEN)
    try:
        check_read_only(sql)
        chosen = read(sql)
    except UserError as exc:
        raise UserError(f"--where {config.where!r} is not a condition over the rollouts view ({exc}); e.g. "
                        f"task_id = 'spider-12' or rollout_id IN ('a', 'b'), with the columns of `lightning-otel "
                        f"sql \"DESCRIBE rollouts\"`") from None
    chosen = chosen.filter(pl.col("spans") > 0)
    if chosen.height == 0:
        raise UserError(f"no rollout with spans matches --where {config.where!r}: `lightning-otel sql \"SELECT "
                        f"rollout_id, task_id, spans FROM rollouts\"` lists the stored ones")
    return chosen


def _labels(config: ReplayConfig, read: Callable[[str], pl.DataFrame], chosen: pl.DataFrame) -> _Labels:
    rewards = read(config.sql(SQL_REWARDS))
    if config.reward is not None and config.reward not in set(rewards["reward_name"].to_list()):
        names = sorted(set(rewards["reward_name"].to_list()))
        raise UserError(f"--reward {config.reward!r}: no chosen rollout has a reward of that name; they have "
                        f"{', '.join(names) if names else 'none'}")
    advantages = read(config.sql(SQL_ADVANTAGES))
    record_versions = dict(read(config.sql(SQL_RECORD_VERSIONS)).iter_rows())
    every_span = _named_values(rewards, "reward", REWARD_KEY, config.reward)
    llm_calls = _named_values(advantages, "advantage", ADVANTAGE_KEY, config.reward)
    for rollout_id, version in zip(chosen["rollout_id"], chosen["policy_version"]):
        version = version if version is not None else record_versions.get(rollout_id)
        if version is not None:
            llm_calls.setdefault(rollout_id, {})[POLICY_VERSION_KEY] = int(version)
    return _Labels(every_span, llm_calls)


def _named_values(frame: pl.DataFrame, column: str, key: str, primary: str | None) -> dict[str, dict[str, Any]]:
    """rollout -> {key: the primary name's value, and key.<name> per name unless the primary one is its only one}.
    The primary name is `primary`, else the rollout's only one."""
    out: dict[str, dict[str, Any]] = {}
    for (rollout_id,), group in frame.group_by("rollout_id"):
        values = {name: value for name, value in zip(group["reward_name"], group[column]) if value is not None}
        attributes: dict[str, Any] = {}
        chosen = primary if primary is not None else (next(iter(values)) if len(values) == 1 else None)
        if chosen in values:
            attributes[key] = float(values[chosen])
        if len(values) > 1 or (values and chosen not in values):
            attributes.update({f"{key}.{name}": float(value) for name, value in values.items()})
        if attributes:
            out[rollout_id] = attributes
    return out


def _rollout_groups(chosen: pl.DataFrame, batch_spans: int) -> Iterator[list[str]]:
    """Rollout ids in groups of about batch_spans spans (a bigger rollout alone; its spans are paged)."""
    group: list[str] = []
    spans = 0
    for rollout_id, count in zip(chosen["rollout_id"], chosen["spans"]):
        if group and (spans + count > batch_spans or len(group) >= MAX_IDS_PER_PAGE):
            yield group
            group, spans = [], 0
        group.append(rollout_id)
        spans += count
    if group:
        yield group


def _pages(config: ReplayConfig, read: Callable[[str], pl.DataFrame],
           chosen: pl.DataFrame) -> Iterator[list[dict[str, Any]]]:
    """Pages of at most batch_spans span rows, by (trace_id, span_id) after the last row of the page before."""
    for group in _rollout_groups(chosen, config.batch_spans):
        ids = ", ".join(client.sql_literal(rollout_id) for rollout_id in group)
        last = ("", "")
        while True:
            page = read(SQL_PAGE.format(columns=", ".join(SPAN_COLUMNS), ids=ids, limit=config.batch_spans,
                                        trace=client.sql_literal(last[0]), span=client.sql_literal(last[1])))
            if page.height:
                rows = page.to_dicts()
                yield rows
                last = (rows[-1]["trace_id"], rows[-1]["span_id"])
            if page.height < config.batch_spans:
                break


def _send(config: ReplayConfig, body: bytes, spans: int, report: ReplayReport, total: int) -> None:
    delivery = post_otlp(config.endpoint, body, PROTOBUF, config.headers, timeout_s=config.timeout_s,
                         max_retry_s=config.max_retry_s)
    report.retries += delivery.retries
    if delivery.outcome != "sent":
        how = ("refused the request" if delivery.outcome == "rejected"
               else f"still failed after {delivery.retries} retries over {config.max_retry_s:g} s")
        raise UserError(f"{config.endpoint} {how} ({delivery.error}); {report.spans} of {total} spans went out "
                        f"before it, in {report.requests} requests. Check that the endpoint runs and takes "
                        f"OTLP/HTTP protobuf (and its --header credentials), then export again: a span sent twice "
                        f"is one span to most trace stores")
    rejected = _rejected_spans(delivery.response)
    report.requests += 1
    report.spans += spans - rejected
    report.rejected_spans += rejected


def _rejected_spans(response: bytes) -> int:
    """Spans an OTLP partial-success answer says were rejected (0 for an empty or non-protobuf answer)."""
    if not response:
        return 0
    try:
        partial = ExportTraceServiceResponse.FromString(response).partial_success
    except DecodeError:
        return 0  # an endpoint that answers with JSON or text said 2xx: taken as accepted
    if partial.rejected_spans:
        log.warning("the endpoint rejected %d spans: %s", partial.rejected_spans, partial.error_message)
    return int(partial.rejected_spans)
