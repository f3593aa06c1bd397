"""Trajectories: per rollout, its LLM calls in order, each once, with its agent path and token ids.

The store does the work (views `trajectory_calls` and `episode_rewards`, migration 0006: duplicated LLM
spans removed, agent paths, token records joined through the traceparent or the response id). This module
reads them and gives every call token ids: the gateway's record, else re-tokenised from the recorded
messages (retokenize.py), else a reason that excludes its rollout. A rollout whose calls an outside model answered
(the gateway forwarded them: closed models) is excluded whatever its messages: another model's text is no sample of
the policy.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import polars as pl

from lightning_otel.errors import UserError
from lightning_otel.serve.forward import FORWARD_SPAN
from lightning_otel.train.transitions.retokenize import ChatTokenizer, Drift, measure_drift

log = logging.getLogger(__name__)
Read = Callable[[str], pl.DataFrame]  # one read statement -> rows (span_store.client.reading)

# The calls without their token lists (those are large: they are read once, below, and joined last).
SQL_CALLS = """
SELECT rollout_id, trace_id, span_id, turn, agent, agent_path, start_ns, end_ns, duplicates,
       record_trace_id, record_span_id, policy_version AS generation_version
FROM trajectory_calls
"""
SQL_TOKENS = """
SELECT trace_id AS token_trace_id, span_id AS token_span_id, prompt_ids, completion_ids, completion_logprobs
FROM token_records WHERE coalesce(choice_index, 0) = 0
"""
SQL_ROLLOUTS = "SELECT rollout_id, task_id, attempt, status, policy_version FROM rollout_identities"
SQL_EPISODE_REWARDS = "SELECT rollout_id, reward FROM episode_rewards WHERE reward_name = $name"
# The same without the rewards the agent emitted: a computed reward outranks those (migration 0007), so this
# is the computed one, or none when the reward function gave none.
SQL_COMPUTED_EPISODE_REWARDS = SQL_EPISODE_REWARDS + " AND source <> 'emitted'"
SQL_REWARD_NAMES = "SELECT name, count(DISTINCT rollout_id) AS rollouts FROM rewards GROUP BY name ORDER BY 2 DESC"
# The recorded messages of kept calls ($which: without a token record, or with one for --drift).
SQL_MESSAGES = """
SELECT c.trace_id, c.span_id, c.system_instructions, c.input_messages, c.output_messages, c.tool_definitions
FROM llm_calls c SEMI JOIN trajectory_calls t ON t.trace_id = c.trace_id AND t.span_id = c.span_id
    AND t.record_span_id IS $which NULL
"""

# Calls with a token record, with the opening the gateway forced into the prompt, if it forced one (--drift).
SQL_RECORDED_CALLS = """
SELECT t.trace_id, t.span_id, t.prompt_ids, t.completion_ids,
       json_extract_string(s.attributes, '$."lightning.prompt.forced_prefix"') AS forced_prefix
FROM trajectory_calls t LEFT JOIN spans s ON s.trace_id = t.record_trace_id AND s.span_id = t.record_span_id
WHERE t.record_span_id IS NOT NULL
"""

# Rollouts whose calls the gateway forwarded to an outside endpoint (closed models: serve/forward.py).
SQL_FORWARDED = f"SELECT DISTINCT rollout_id FROM spans WHERE name = '{FORWARD_SPAN}' AND rollout_id IS NOT NULL"

NO_RECORD = "LLM call without a token record"
FORWARDED = ("answered by an outside model (the gateway forwarded its calls to base_url and recorded them as text): "
             "no token ids of the policy to train on")
TOKEN_MISMATCH = ("token mismatch (a token record's logprobs and completion ids differ in length, "
                  "or its prompt is empty)")


@dataclass
class Tokens:
    """What attach_tokens found. `calls` gains token_source, the lengths of its ids and the key of its ids
    in `lists` (token_trace_id, token_span_id: the record's span, or the call's own when re-tokenised);
    `excluded` names the rollouts it leaves out and why."""

    calls: pl.DataFrame
    lists: pl.DataFrame  # token_trace_id, token_span_id, prompt_ids, completion_ids, completion_logprobs
    excluded: pl.DataFrame  # rollout_id, reason
    retokenized: int = 0


def load_tokenizer(model: Path | str | None, chat_template: str | None = None, tool_format: str | None = None
                   ) -> tuple[ChatTokenizer | None, str | None]:
    """The tokenizer of `model` ("bundled" = the bundled model), rendering with `chat_template` when given (the
    one the gateway was given) and writing calls in `tool_format` (None: detected from the template, as the
    gateway detects it), or None and why not. An explicit folder that cannot be used is the user's error;
    the bundled model being unavailable only disables re-tokenisation (its rollouts are then excluded with the
    reason)."""
    if model is None:
        return None, "no tokenizer to re-tokenise it with: give --tokenizer"
    from lightning_otel.serve.model import resolve_model
    if str(model) in ("bundled", "base"):
        try:
            return ChatTokenizer.load(resolve_model(None), tool_format, chat_template), None
        except UserError as exc:
            log.warning("re-tokenisation is off: %s", exc)
            return None, f"the bundled model's tokenizer is unavailable: {exc}"
    return ChatTokenizer.load(resolve_model(str(model)), tool_format, chat_template), None


def recorded_messages(read: Read, with_record: bool) -> pl.DataFrame:
    return read(SQL_MESSAGES.replace("$which", "NOT" if with_record else ""))


def attach_tokens(calls: pl.DataFrame, read: Read, model: Path | str | None,
                  chat_template: str | None = None, tool_format: str | None = None) -> Tokens:
    """Token ids for every call: the gateway's record, else re-tokenised from the recorded messages
    (completion_logprobs = []); a rollout with a call that has neither a usable record nor readable
    messages is excluded with the reason. Lists stay in `lists` until the caller joins them last."""
    lists = read(SQL_TOKENS)
    calls = calls.with_columns(
        pl.when(pl.col("record_span_id").is_not_null()).then(pl.lit("engine")).otherwise(pl.lit("retokenized"))
        .alias("token_source"),
        pl.coalesce("record_trace_id", "trace_id").alias("token_trace_id"),
        pl.coalesce("record_span_id", "span_id").alias("token_span_id"))
    keys = ["token_trace_id", "token_span_id"]
    forwarded = calls.join(read(SQL_FORWARDED), on="rollout_id", how="semi")
    excluded = [forwarded.select("rollout_id", pl.lit(FORWARDED).alias("reason"))]
    missing = calls.filter(pl.col("record_span_id").is_null()).join(forwarded, on="rollout_id", how="anti")
    retokenized = 0
    if missing.height:
        tokenizer, why_not = load_tokenizer(model, chat_template, tool_format)
        if tokenizer is None:
            excluded.append(missing.select("rollout_id", pl.lit(f"{NO_RECORD} ({why_not})").alias("reason")))
        else:
            wanted = missing.select("trace_id", "span_id")
            encoded = tokenizer.encode(recorded_messages(read, with_record=False).join(
                wanted, on=["trace_id", "span_id"], how="semi"))
            encoded = wanted.join(encoded, on=["trace_id", "span_id"], how="left")
            failed = encoded.filter(pl.col("prompt_ids").is_null())
            excluded.append(missing.join(failed, on=["trace_id", "span_id"], how="semi").select(
                "rollout_id", pl.lit(f"{NO_RECORD} and no recorded messages to re-tokenise").alias("reason")))
            ok = encoded.filter(pl.col("prompt_ids").is_not_null())
            retokenized = ok.height
            lists = pl.concat([lists, ok.select(
                pl.col("trace_id").alias("token_trace_id"), pl.col("span_id").alias("token_span_id"),
                "prompt_ids", "completion_ids",
                pl.lit([], dtype=pl.List(pl.Float64)).alias("completion_logprobs"))], how="vertical_relaxed")
    lengths = lists.select(*keys, pl.col("prompt_ids").list.len().alias("prompt_len"),
                           pl.col("completion_ids").list.len().alias("completion_len"),
                           pl.col("completion_logprobs").list.len().alias("logprobs_len"))
    calls = calls.join(lengths, on=keys, how="left")
    engine = pl.col("token_source") == "engine"
    excluded.insert(1, calls.filter(engine & ((pl.col("prompt_len").fill_null(0) == 0)
                                              | pl.col("logprobs_len").is_null()
                                              | (pl.col("logprobs_len") != pl.col("completion_len"))))
                    .select("rollout_id", pl.lit(TOKEN_MISMATCH).alias("reason")))
    reasons = pl.concat(excluded).unique(subset=["rollout_id"], keep="first", maintain_order=True)
    return Tokens(calls, lists, reasons, retokenized)


def drift(read: Read, model: Path | str | None, chat_template: str | None = None,
          tool_format: str | None = None) -> Drift:
    """Re-tokenise every call that has a token record and compare with the engine's ids; a call with a forced
    opening is re-tokenised with it in the prompt, as the gateway sent it (Drift.forced counts them)."""
    tokenizer, why_not = load_tokenizer(model, chat_template, tool_format)
    if tokenizer is None:
        raise UserError(f"drift needs a tokenizer: {why_not}")
    engine = read(SQL_RECORDED_CALLS)
    messages = recorded_messages(read, with_record=True).join(
        engine.select("trace_id", "span_id", "forced_prefix"), on=["trace_id", "span_id"], how="left")
    return measure_drift(engine, tokenizer.encode(messages))


def join_lists(rows: pl.DataFrame, lists: pl.DataFrame) -> pl.DataFrame:
    """`rows` with their token lists, in the order of `lists` (the order the store holds the records in:
    deterministic). The lists are large (hundreds of MB at a million spans): moving them into any other order
    costs a copy (measured: 0.7-1.0 s for 250k calls), so the small rows are put in their order instead, and
    when every record is used the lists are not copied at all."""
    keys = ["token_trace_id", "token_span_id"]
    at = rows.select(keys).join(lists.select(keys).with_row_index("_at"), on=keys, how="left",
                                maintain_order="left")["_at"]
    rows = rows.with_columns(at).sort("_at")
    at = rows["_at"]
    values = lists.drop(keys)
    if at.len() != lists.height or not (at == pl.int_range(lists.height, eager=True, dtype=at.dtype)).all():
        values = values[at]
    return pl.concat([rows.drop("_at"), values], how="horizontal")
