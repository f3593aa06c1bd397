"""A rollout's transitions: for each trained call, its prompt tokens (dimmed) and completion tokens coloured by
advantage (per token where the transitions carry `token_advantages`, else the transition's advantage), each
token's id, logprob, loss mask and advantage in its title (shown on hover).

Transitions come from `lightning-otel compile`'s Parquet when the viewer was given one (--transitions, or the
run folder's transitions.parquet), else from the store: the rollout's token records with the compiler's default
credit over its group (queries.SQL_STORE_TRANSITIONS). Token ids
become text through the model's tokenizer (default: the bundled model's)."""
from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import polars as pl

from lightning_otel.errors import UserError
from lightning_otel.view import queries
from lightning_otel.view.html import advantage_colour, esc, fmt, link, rollout_url
from lightning_otel.view.pages import NotFound
from lightning_otel.view.source import StoreSource, literal

log = logging.getLogger(__name__)
NEEDED = ("rollout_id", "turn", "prompt_ids", "completion_ids", "advantage")


class TokenText:
    """Token id -> its text, with the tokenizer of `model` ("bundled" or a model folder), loaded on first use;
    None when it cannot be loaded (the page then shows ids)."""

    def __init__(self, model: str | None):
        self.model = model
        self._lock = threading.Lock()
        self._tokenizer: Any = None
        self.problem: str | None = None if model else "no tokenizer given (--model)"

    def _load(self) -> Any:
        with self._lock:
            if self._tokenizer is None and self.problem is None:
                try:
                    from tokenizers import Tokenizer

                    from lightning_otel.serve.model import resolve_model
                    folder = resolve_model(None if self.model in ("bundled", "base") else self.model)
                    self._tokenizer = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
                except Exception as exc:  # noqa: BLE001 - whatever fails (missing, converting, corrupt): show ids
                    self.problem = f"the tokenizer of {self.model} is unavailable ({exc}); token ids are shown"
                    log.warning("%s", self.problem)
            return self._tokenizer

    def texts(self, ids: list[int]) -> list[str]:
        tokenizer = self._load()
        if tokenizer is None:
            return [f"[{i}]" for i in ids]
        return tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)


def load_transitions(source: StoreSource, parquet: Path | list[Path] | None, rollout_id: str,
                     reward: str | None) -> pl.DataFrame:
    if parquet is not None:
        files = parquet if isinstance(parquet, list) else [parquet]
        scans = pl.concat([pl.scan_parquet(f) for f in files], how="diagonal_relaxed")
        frame = scans.filter(pl.col("rollout_id") == rollout_id).collect()
        missing = [c for c in NEEDED if c not in frame.columns]
        if missing:
            raise UserError(f"{parquet} has no column(s) {missing}: give the Parquet of `lightning-otel compile`")
        return frame.sort("turn")
    return source.query(queries.fill(queries.SQL_STORE_TRANSITIONS, id=literal(rollout_id),
                                     reward=literal(reward or "")))


def _token(text: str, title: str, cls: str, style: str = "", data: str = "") -> str:
    shown = esc(text).replace("\n", "↵<br>")
    return f'<span class="{cls}" title="{esc(title)}"{style}{data}>{shown}</span>'


def transition_block(row: dict, texts: TokenText) -> str:
    prompt = row["prompt_ids"] or []
    completion = row["completion_ids"] or []
    logprobs = row.get("completion_logprobs") or []
    mask = row.get("loss_mask") or [1] * len(completion)
    per_token = row.get("token_advantages")
    prompt_html = "".join(_token(t, f"prompt token {i}", "tok prompt") for i, t in zip(prompt, texts.texts(prompt)))
    cells = []
    for index, (token_id, text) in enumerate(zip(completion, texts.texts(completion))):
        advantage = per_token[index] if per_token is not None and index < len(per_token) else row["advantage"]
        masked = index < len(mask) and not mask[index]
        logprob = logprobs[index] if index < len(logprobs) else None
        title = (f"token {token_id} {text!r} · logprob {fmt(logprob, 4)} · loss mask {0 if masked else 1} · "
                 f"advantage {fmt(advantage, 4)}")
        cells.append(_token(text, title, "tok completion" + (" masked" if masked else ""),
                            f' style="background-color:{advantage_colour(advantage, masked)}"',
                            f' data-index="{index}" data-token-id="{token_id}" data-advantage="{esc(advantage)}"'
                            f' data-logprob="{esc(logprob)}" data-mask="{0 if masked else 1}"'))
    head = (f'turn {esc(row["turn"])} · agent {esc(row.get("agent") or "–")} · '
            f'reward {esc(fmt(row.get("reward")))} · '
            f'return {esc(fmt(row.get("return")))} · advantage <strong>{esc(fmt(row["advantage"], 4))}</strong> · '
            f'{len(prompt)} prompt + {len(completion)} completion tokens')
    return (f'<section class="transition" data-turn="{esc(row["turn"])}"><h3>{head}</h3>'
            f'<details><summary>prompt ({len(prompt)} tokens)</summary>'
            f'<div class="tokens">{prompt_html}</div></details>'
            f'<div class="tokens completion">{"".join(cells)}</div></section>')


def transitions_page(source: StoreSource, parquet: Path | list[Path] | None, texts: TokenText, rollout_id: str,
                     reward: str | None) -> str:
    frame = load_transitions(source, parquet, rollout_id, reward)
    where = (f"the compiled transitions of the run's {len(parquet)} rounds" if isinstance(parquet, list) else
             f"compiled transitions {parquet.name}" if parquet else
             f"the store's token records, default credit (reward {reward})")
    back = link(rollout_url(rollout_id), "← the rollout")
    if not frame.height:
        exists = source.query(queries.fill(queries.SQL_RUN, id=literal(rollout_id))).height
        if not exists and not source.query(
                f"SELECT 1 FROM spans WHERE rollout_id = {literal(rollout_id)} LIMIT 1").height:
            raise NotFound(f"no rollout {rollout_id!r} in this store")
        return (f'<p>{back}</p><p class="muted">No transitions of this rollout in {esc(where)}: it has no reward of '
                f'that name, did not end ok, lacks token records, or its group had zero reward variance.</p>')
    legend = ('<p class="legend">Completion tokens: <span class="tok" style="background-color:'
              f'{advantage_colour(1.5)}">pushed up</span> <span class="tok" style="background-color:'
              f'{advantage_colour(-1.5)}">pushed down</span> (colour strength: |advantage| up to 2) · '
              '<span class="tok prompt">prompt tokens dimmed</span> · '
              'hover a token for its logprob and loss mask.</p>')
    blocks = "".join(transition_block(row, texts) for row in frame.to_dicts())
    note = f'<p class="muted">{esc(texts.problem)}</p>' if texts.problem else ""
    return f'<p>{back} · from {esc(where)}</p>{legend}{note}<div id="transitions">{blocks}</div>'
