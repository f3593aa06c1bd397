"""HTML building blocks of the viewer's pages: the layout, escaping, links, tables, timing bars and inline SVG
line charts. Every value that reaches a page goes through `esc` (or `attr`)."""
from __future__ import annotations

import html
import math
from typing import Iterable, Sequence
from urllib.parse import quote, urlencode

NAV = (("/", "Rollouts"), ("/runs", "Runs and rounds"), ("/compare", "Compare versions"))


def esc(value: object) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def url(path: str, **params: object) -> str:
    query = urlencode({k: v for k, v in params.items() if v is not None and v != ""})
    return path + ("?" + query if query else "")


def rollout_url(rollout_id: str, tail: str = "") -> str:
    return f"/rollout/{quote(rollout_id, safe='')}{tail}"


def link(href: str, text: object, **attrs: str) -> str:
    extra = "".join(f' {k.rstrip("_")}="{esc(v)}"' for k, v in attrs.items())
    return f'<a href="{esc(href)}"{extra}>{esc(text)}</a>'


def fmt(value: object, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def page(title: str, body: str, store: str) -> str:
    nav = " ".join(link(href, text) for href, text in NAV)
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>{esc(title)} · lightning-otel'
            f'</title><meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<link rel="stylesheet" href="/static/viewer.css"><script src="/static/viewer.js" defer></script>'
            f'</head><body><header><strong>lightning-otel view</strong> <span class="muted">{esc(store)}</span>'
            f'<nav>{nav}</nav></header><main><h1>{esc(title)}</h1>\n{body}\n</main></body></html>\n')


def table(headers: Sequence[str], rows: Iterable[Sequence[str]], table_id: str = "") -> str:
    """Cells are HTML already (escaped by the caller)."""
    head = "".join(f"<th>{h}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>\n" for row in rows)
    ident = f' id="{esc(table_id)}"' if table_id else ""
    return f'<table{ident}><thead><tr>{head}</tr></thead><tbody>\n{body}</tbody></table>'


def timing_bar(start: float, end: float, first: float, last: float) -> str:
    """A span's place in its rollout's time, as a bar (percentages of the rollout's duration)."""
    total = max(last - first, 1.0)
    left = max(0.0, min(100.0, 100 * (start - first) / total))
    width = max(0.4, min(100.0 - left, 100 * (end - start) / total))
    return f'<span class="bar"><span style="left:{left:.2f}%;width:{width:.2f}%"></span></span>'


def advantage_colour(value: float | None, masked: bool = False) -> str:
    """The background of a completion token: green for a positive advantage, red for a negative one, more
    opaque the larger |value| is up to 2 (a z-score of 2 saturates); grey for tokens the loss leaves out."""
    if masked or value is None or math.isnan(value):
        return "rgba(128, 128, 128, 0.15)"
    strength = min(abs(value) / 2.0, 1.0)
    alpha = round(0.1 + 0.6 * strength, 3)
    return f"rgba(0, 160, 60, {alpha})" if value >= 0 else f"rgba(220, 40, 40, {alpha})"


def line_chart(title: str, series: dict[str, list[tuple[float, float]]], width: int = 520, height: int = 220,
               chart_id: str = "") -> str:
    """An inline SVG line chart of (x, y) series sharing axes; an empty chart says there is no data."""
    points = [p for values in series.values() for p in values if p[1] is not None and math.isfinite(p[1])]
    ident = f' id="{esc(chart_id)}"' if chart_id else ""
    if not points:
        return (f'<figure class="chart"{ident}><figcaption>{esc(title)}</figcaption><p class="muted">no data</p>'
                f'</figure>')
    pad_l, pad_r, pad_t, pad_b = 48, 12, 12, 28
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1

    def sx(x: float) -> float:
        return pad_l + (x - x0) / (x1 - x0) * (width - pad_l - pad_r)

    def sy(y: float) -> float:
        return height - pad_b - (y - y0) / (y1 - y0) * (height - pad_t - pad_b)

    parts = [f'<line class="axis" x1="{pad_l}" y1="{height - pad_b}" x2="{width - pad_r}" y2="{height - pad_b}"/>',
             f'<line class="axis" x1="{pad_l}" y1="{pad_t}" x2="{pad_l}" y2="{height - pad_b}"/>',
             f'<text x="{pad_l - 4}" y="{sy(y1) + 4:.1f}" text-anchor="end">{esc(fmt(float(y1)))}</text>',
             f'<text x="{pad_l - 4}" y="{sy(y0) + 4:.1f}" text-anchor="end">{esc(fmt(float(y0)))}</text>',
             f'<text x="{sx(x0):.1f}" y="{height - 8}" text-anchor="middle">{esc(fmt(x0))}</text>',
             f'<text x="{sx(x1):.1f}" y="{height - 8}" text-anchor="middle">{esc(fmt(x1))}</text>']
    legend = []
    for index, (name, values) in enumerate(series.items()):
        kept = [(x, y) for x, y in values if y is not None and math.isfinite(y)]
        if not kept:
            continue
        cls = f"s{index % 6}"
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in kept)
        parts.append(f'<polyline class="{cls}" points="{path}"><title>{esc(name)}</title></polyline>')
        parts.extend(f'<circle class="{cls}" cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3"><title>{esc(name)} '
                     f'{esc(fmt(x))}: {esc(fmt(y))}</title></circle>' for x, y in kept)
        legend.append(f'<span class="{cls}">■ {esc(name)}</span>')
    svg = (f'<svg viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
           f'aria-label="{esc(title)}">{"".join(parts)}</svg>')
    return f'<figure class="chart"{ident}><figcaption>{esc(title)} {" ".join(legend)}</figcaption>{svg}</figure>'
