"""The rollouts table and one rollout's page: its span tree across every trace it spans, with timings,
messages, tool calls and results, rewards where they landed, errors, and the feedback form."""
from __future__ import annotations

import datetime as dt
from typing import Any

import orjson
import polars as pl

from lightning_otel.view import queries
from lightning_otel.view.html import esc, fmt, link, rollout_url, table, timing_bar, url
from lightning_otel.view.source import StoreSource, literal

LLM_OPERATIONS = ("chat", "text_completion", "completion", "generate_content")
TOOL_KEYS = ("gen_ai.tool.call.arguments", "traceloop.entity.input", "gen_ai.tool.call.result",
             "traceloop.entity.output")
MAX_SHOWN = 20_000  # characters of one message or attribute shown before it is cut


class NotFound(LookupError):
    """A rollout, task or page that is not there (answered 404)."""


def reward_names(source: StoreSource) -> list[str]:
    return source.query(queries.SQL_REWARD_NAMES)["name"].to_list()


def chosen_reward(source: StoreSource, params: dict[str, str], default: str | None) -> tuple[str | None, list[str]]:
    names = reward_names(source)
    wanted = params.get("reward") or default
    if wanted and wanted not in names:
        names = [wanted, *names]
    return (wanted or (names[0] if names else None)), names


def _select(name: str, options: list[str], chosen: str | None, blank: str = "any") -> str:
    opts = [f'<option value="">{esc(blank)}</option>'] if blank else []
    opts += [f'<option value="{esc(o)}"{" selected" if o == chosen else ""}>{esc(o)}</option>' for o in options]
    return f'<select name="{esc(name)}">{"".join(opts)}</select>'


def _time(ns: Any) -> str:
    if ns is None:
        return "–"
    return dt.datetime.fromtimestamp(ns / 1e9, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def rollouts_page(source: StoreSource, params: dict[str, str], default_reward: str | None) -> str:
    chosen = queries.RolloutFilter.from_params(params)
    reward, names = chosen_reward(source, params, default_reward)
    statuses = source.query(queries.SQL_STATUSES)
    versions = [str(v) for v in source.query(queries.SQL_VERSIONS)["policy_version"].to_list()]
    frame = source.query(chosen.sql(reward))
    total = int(frame["total"][0]) if frame.height else 0
    status_names = sorted(set(statuses["status"].to_list()) - {""})
    error_classes = sorted(set(statuses["error_class"].to_list()) - {""})
    version = None if chosen.version is None else str(chosen.version)
    form = (
        '<form class="filters" method="get" action="/">'
        f'<label>task <input name="task" value="{esc(chosen.task or "")}" size="14"></label>'
        f'<label>status {_select("status", status_names, chosen.status)}</label>'
        f'<label>error class {_select("error_class", error_classes, chosen.error_class)}</label>'
        f'<label>reward {_select("reward", names, reward, blank="")}</label>'
        f'<label>from <input name="reward_min" value="{esc(fmt(chosen.reward_min))}" size="5"></label>'
        f'<label>to <input name="reward_max" value="{esc(fmt(chosen.reward_max))}" size="5"></label>'
        f'<label>policy version {_select("version", versions, version)}</label>'
        f'<label>agent <input name="agent" value="{esc(chosen.agent or "")}" size="12"></label>'
        f'<input type="hidden" name="sort" value="{esc(chosen.sort)}">'
        f'<input type="hidden" name="order" value="{"desc" if chosen.descending else "asc"}">'
        '<button type="submit">filter</button> <a href="/">clear</a></form>').replace('value="–"', 'value=""')
    base = {k: v for k, v in params.items() if k in ("task", "status", "error_class", "reward", "reward_min",
                                                     "reward_max", "version", "agent")}
    columns = [("rollout_id", "rollout"), ("task_id", "task"), ("attempt", "sample"), ("policy_version", "version"),
               ("status", "status"), ("reward", f"reward ({reward or 'none'})"), ("llm_calls", "LLM calls"),
               ("spans", "spans"), ("traces", "traces"), ("error_spans", "errors"), ("duration_s", "seconds"),
               ("started_ns", "started (UTC)")]
    headers = []
    for key, label in columns:
        order = "asc" if chosen.sort == key and chosen.descending else "desc"
        arrow = (" ▼" if chosen.descending else " ▲") if chosen.sort == key else ""
        headers.append(link(url("/", **base, sort=key, order=order), label + arrow, class_="sort"))
    rows = []
    for row in frame.iter_rows(named=True):
        status = row["status"] or ""
        if row["error_class"]:
            status += f" ({row['error_class']})"
        group = url("/group", task=row["task_id"], version=row["policy_version"], reward=reward)
        rows.append([link(rollout_url(row["rollout_id"]), row["rollout_id"]),
                     link(group, row["task_id"]) if row["task_id"] is not None else "–", esc(fmt(row["attempt"])),
                     esc(fmt(row["policy_version"])), esc(status or "–"), esc(fmt(row["reward"])),
                     esc(row["llm_calls"]), esc(row["spans"]), esc(row["traces"]),
                     f'<span class="{"err" if row["error_spans"] else ""}">{esc(row["error_spans"])}</span>',
                     esc(fmt(row["duration_s"])), esc(_time(row["started_ns"]))])
    first = chosen.page * queries.PAGE_SIZE
    pager = [f'<span class="muted">{first + 1 if total else 0}–{first + frame.height} of {total} rollouts</span>']
    order = "desc" if chosen.descending else "asc"
    if chosen.page > 0:
        pager.append(link(url("/", **base, sort=chosen.sort, order=order, page=chosen.page - 1), "← previous"))
    if first + frame.height < total:
        pager.append(link(url("/", **base, sort=chosen.sort, order=order, page=chosen.page + 1), "next →",
                          rel="next"))
    return form + f'<p class="pager">{" ".join(pager)}</p>' + table(headers, rows, "rollouts")


# ---- one rollout ------------------------------------------------------------------------------------------

def _json(text: Any) -> Any:
    if text is None:
        return None
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return text


def _short(text: Any) -> str:
    text = text if isinstance(text, str) else orjson.dumps(text).decode()
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN] + f" … ({len(text) - MAX_SHOWN} more characters)"


def render_messages(messages: Any, kind: str) -> str:
    """GenAI messages ({role, parts: [{type, content | name, arguments | response}]} or {role, content,
    tool_calls}) as readable blocks; anything else as its JSON."""
    if isinstance(messages, str):
        messages = _json(messages)
    if not isinstance(messages, list):
        return f'<pre class="msg">{esc(_short(messages))}</pre>' if messages is not None else ""
    out = []
    for message in messages:
        if not isinstance(message, dict):
            out.append(f'<pre class="msg">{esc(_short(message))}</pre>')
            continue
        role = message.get("role", kind)
        pieces = []
        parts = message.get("parts")
        if isinstance(parts, list):
            for part in parts:
                pieces.append(_part(part))
        if isinstance(message.get("content"), str):
            pieces.append(f'<div class="text">{esc(_short(message["content"]))}</div>')
        for call in message.get("tool_calls") or []:
            function = call.get("function", call) if isinstance(call, dict) else {}
            pieces.append(f'<div class="tool-call">→ {esc(function.get("name"))}'
                          f'(<code>{esc(_short(function.get("arguments", "")))}</code>)</div>')
        out.append(f'<div class="msg role-{esc(role)}"><span class="role">{esc(role)}</span>{"".join(pieces)}</div>')
    return f'<div class="messages {esc(kind)}">{"".join(out)}</div>'


def _part(part: Any) -> str:
    if not isinstance(part, dict):
        return f'<div class="text">{esc(_short(part))}</div>'
    kind = part.get("type")
    if kind == "tool_call":
        return (f'<div class="tool-call">→ {esc(part.get("name"))}(<code>{esc(_short(part.get("arguments", "")))}'
                f'</code>)</div>')
    if kind == "tool_call_response":
        result = part.get("response", part.get("result", ""))
        return f'<div class="tool-result">← <code>{esc(_short(result))}</code></div>'
    return f'<div class="text">{esc(_short(part.get("content", part)))}</div>'


def _span_detail(span: dict, attributes: dict, rewards: list[dict]) -> str:
    blocks = []
    if span["status_code"] == "ERROR":
        blocks.append(f'<div class="error">error: {esc(span["status_message"] or "(no message)")}</div>')
    for event in _json(span["events"]) or []:
        if isinstance(event, dict) and event.get("name") == "exception":
            details = event.get("attributes") or {}
            blocks.append(f'<pre class="error">{esc(details.get("exception.type"))}: '
                          f'{esc(details.get("exception.message"))}\n'
                          f'{esc(details.get("exception.stacktrace", ""))}</pre>')
    for key, kind in (("gen_ai.system_instructions", "system"), ("gen_ai.input.messages", "input"),
                      ("gen_ai.output.messages", "output")):
        if attributes.get(key) is not None:
            blocks.append(f'<h4>{kind}</h4>' + render_messages(attributes[key], kind))
    for key in TOOL_KEYS:
        if attributes.get(key) is not None:
            blocks.append(f'<div class="tool"><span class="key">{esc(key)}</span>'
                          f'<pre>{esc(_short(attributes[key]))}</pre></div>')
    if span["name"] == "lightning.generate":
        prompt = attributes.get("lightning.prompt.token_ids")
        completion = attributes.get("lightning.completion.token_ids")
        blocks.append(f'<div class="muted">token record: {len(prompt or [])} prompt, {len(completion or [])} '
                      f'completion tokens, policy version {esc(attributes.get("lightning.policy.version"))}</div>')
    for reward in rewards:
        blocks.append(_reward_badge(reward))
    shown = {k: v for k, v in attributes.items() if not k.startswith("lightning.") or "token_ids" not in k}
    dumped = orjson.dumps(shown, option=orjson.OPT_INDENT_2).decode()
    blocks.append(f'<details><summary>attributes</summary><pre>{esc(_short(dumped))}</pre></details>')
    return "".join(blocks)


def _reward_badge(reward: dict) -> str:
    who = f" by {reward['author']}" if reward.get("author") else ""
    comment = f" — {reward['comment']}" if reward.get("comment") else ""
    return (f'<div class="reward">reward <strong>{esc(reward["name"])} = {esc(fmt(reward["value"]))}</strong> '
            f'<span class="muted">({esc(reward["source"])}{esc(who)}){esc(comment)}</span></div>')


def span_tree(spans: pl.DataFrame, rewards: pl.DataFrame) -> str:
    """Every span of the rollout's traces, nested under its parent (roots: spans whose parent is not stored),
    each trace in turn, in start order."""
    rows = spans.to_dicts()
    by_id = {(r["trace_id"], r["span_id"]): r for r in rows}
    children: dict[tuple, list[dict]] = {}
    roots = []
    for row in rows:
        parent = (row["trace_id"], row["parent_span_id"])
        (children.setdefault(parent, []) if row["parent_span_id"] and parent in by_id else roots).append(row)
    by_span: dict[str, list[dict]] = {}
    for reward in rewards.to_dicts():
        if reward["span_id"]:
            by_span.setdefault(reward["span_id"], []).append(reward)
    starts = [r["start_ns"] for r in rows if r["start_ns"] is not None]
    ends = [r["end_ns"] for r in rows if r["end_ns"] is not None]
    first, last = (min(starts), max(ends)) if starts and ends else (0, 1)
    out: list[str] = []
    traces_seen: list[str] = []

    def walk(span: dict, depth: int) -> None:
        attributes = _json(span["attributes"]) or {}
        kind = ("llm" if span["operation_name"] in LLM_OPERATIONS and span["name"] != "lightning.generate" else
                "tool" if span["operation_name"] == "execute_tool" or span["name"].startswith("execute_tool") else
                "generate" if span["name"] == "lightning.generate" else "span")
        start, end = span["start_ns"] or first, span["end_ns"] or span["start_ns"] or first
        status = ' <span class="err">ERROR</span>' if span["status_code"] == "ERROR" else ""
        marks = "".join(f' <span class="reward-mark">★ {esc(r["name"])}={esc(fmt(r["value"]))}</span>'
                        for r in by_span.get(span["span_id"], []))
        out.append(
            f'<details class="span {kind}" style="margin-left:{depth * 1.2:.1f}em" '
            f'data-span-id="{esc(span["span_id"])}"'
            f'{" open" if kind in ("llm", "tool") or status else ""}><summary>'
            f'<span class="name">{esc(span["name"])}</span>{status}{marks} '
            f'<span class="ms">{(end - start) / 1e6:.1f} ms</span>{timing_bar(start, end, first, last)}</summary>'
            f'<div class="detail">{_span_detail(span, attributes, by_span.get(span["span_id"], []))}</div></details>')
        for child in children.get((span["trace_id"], span["span_id"]), []):
            walk(child, depth + 1)

    for root in roots:
        if root["trace_id"] not in traces_seen:
            traces_seen.append(root["trace_id"])
            out.append(f'<div class="trace-head">trace {esc(root["trace_id"])}</div>')
        walk(root, 0)
    return f'<p class="muted">{len(rows)} spans in {len(set(r["trace_id"] for r in rows))} trace(s)</p>' \
           f'<div id="tree">{"".join(out)}</div>'


def rollout_page(source: StoreSource, rollout_id: str, notice: str = "") -> str:
    key = literal(rollout_id)
    run = source.query(queries.fill(queries.SQL_RUN, id=key))
    spans = source.query(queries.fill(queries.SQL_SPANS, id=key))
    if not run.height and not spans.height:
        raise NotFound(f"no rollout {rollout_id!r} in this store")
    rewards = source.query(queries.fill(queries.SQL_REWARDS, id=key))
    facts = run.to_dicts()[0] if run.height else {"rollout_id": rollout_id}
    summary = [f"<dt>{esc(k)}</dt><dd>{esc(fmt(facts.get(k)))}</dd>"
               for k in ("task_id", "attempt", "policy_version", "status", "error_class", "exit_code", "final_output")
               if k in facts]
    episode = [r for r in rewards.to_dicts() if not r["span_id"]]
    links = [link(rollout_url(rollout_id, "/transitions"), "its transitions (tokens by advantage)")]
    if facts.get("task_id") is not None:
        group = url("/group", task=facts["task_id"], version=facts.get("policy_version"))
        links.append(link(group, "its task's group"))
    tails = "".join(f'<details><summary>{name}</summary><pre>{esc(facts[name])}</pre></details>'
                    for name in ("stdout_tail", "stderr_tail") if facts.get(name))
    return (notice + f'<dl class="facts">{"".join(summary)}</dl><p>{" · ".join(links)}</p>'
            + ("".join(_reward_badge(r) for r in episode) or '<p class="muted">no episode reward</p>')
            + tails + "<h2>Spans</h2>" + span_tree(spans, rewards) + feedback_form(rollout_id, spans))


def feedback_form(rollout_id: str, spans: pl.DataFrame) -> str:
    options = ['<option value="">the whole rollout</option>'] + [
        f'<option value="{esc(s)}">{esc(n)} ({esc(s)})</option>'
        for s, n in zip(spans["span_id"].to_list(), spans["name"].to_list())]
    return (f'<h2>Feedback</h2><form id="feedback" method="post" action="{esc(rollout_url(rollout_id, "/feedback"))}">'
            '<label>name <input name="name" required maxlength="200" placeholder="e.g. helpful"></label>'
            '<label>value <input name="value" required size="6" placeholder="1"></label>'
            f'<label>about <select name="span_id">{"".join(options)}</select></label>'
            '<label>comment <input name="comment" size="40"></label>'
            '<label>author <input name="author" size="12"></label>'
            '<label>admin token <input name="admin_token" type="password" required autocomplete="off"></label>'
            '<button type="submit">store score</button>'
            '<p class="muted">Stored as a reward row with source human; the next compile uses it.</p></form>')
