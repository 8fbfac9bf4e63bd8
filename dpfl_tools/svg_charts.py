"""The report's charts as inline SVG, drawn here: line charts (`chart`, linear or log x) and a heatmap; nothing
fetched, no script."""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field

WIDTH, HEIGHT, MARGIN = 440, 260, (34, 16, 44, 62)  # margins: top, right, bottom, left


def number(value) -> bool:
    """Is `value` a finite int or float (not a bool, not None)?"""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def fmt(value, digits: int = 4) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return "∞" if math.isinf(value) else f"{value:.{digits}g}"
    return str(value)


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    if hi <= lo:
        lo, hi = lo - (abs(lo) or 1) * 0.5, hi + (abs(hi) or 1) * 0.5
    raw = (hi - lo) / count
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 2.5, 5, 10) if raw <= m * step)
    return [i * step for i in range(math.floor(lo / step), math.ceil(hi / step) + 1)]


@dataclass
class Series:
    label: str
    points: list[tuple[float, float]]
    color: str
    dashed: bool = False
    markers: bool = False
    marker_class: str = "point"
    marker_titles: list[str] = field(default_factory=list)


def bounded_range(ys: list[float], bounds: tuple[float, float], margin: float = 0.05) -> tuple[float, float]:
    """The data's range widened by `margin` (at least, else 10% of the range) on each side, kept within `bounds`:
    a single accuracy of 0.9 is drawn on 0.85-0.95, not on 0.4-1.4."""
    lo, hi = min(ys), max(ys)
    pad = max(margin, 0.1 * (hi - lo))
    return max(bounds[0], lo - pad), min(bounds[1], hi + pad)


def chart(
    title: str,
    series: list[Series],
    x_label: str,
    y_label: str,
    *,
    log_x: bool = False,
    hlines: list[Series] = (),
    css: str = "",
    note: str = "",
    y_bounds: tuple[float, float] | None = None,
) -> str:
    """A line chart: `series` as lines (and markers), `hlines` as horizontal dashed lines (their first y).
    `y_bounds`: the y axis spans the data with a margin, never beyond these (accuracy: (0, 1))."""
    xs = [x for s in series for x, _ in s.points]
    ys = [y for s in list(series) + list(hlines) for _, y in s.points]
    if not xs and not hlines:
        return ""
    xs = xs or [0.0, 1.0]
    if log_x:
        xs = [math.log10(x) for x in xs if x > 0] or [0.0]
        lo, hi = math.floor(min(xs)), math.ceil(max(xs))
        lo, hi = (lo - 1, lo + 1) if hi == lo else (lo, hi)
        steps = (1, 2, 5) if hi - lo <= 2 else (1,)  # 1-2-5 ticks over one or two decades
        x_ticks = [math.log10(m) + k for k in range(lo, hi) for m in steps] + [float(hi)]
    else:
        x_ticks = nice_ticks(min(xs), max(xs))
    y_ticks = nice_ticks(*(bounded_range(ys, y_bounds) if y_bounds else (min(ys), max(ys))))
    top, right, bottom, left = MARGIN
    x0, x1, y0, y1 = x_ticks[0], x_ticks[-1], y_ticks[0], y_ticks[-1]

    def px(x: float) -> float:
        x = math.log10(x) if log_x else x
        return left + (x - x0) / ((x1 - x0) or 1) * (WIDTH - left - right)

    def py(y: float) -> float:
        return HEIGHT - bottom - (y - y0) / ((y1 - y0) or 1) * (HEIGHT - top - bottom)

    out = [
        f'<svg class="chart {css}" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'role="img"><title>{html.escape(title)}</title>',
        f'<text x="{left}" y="16" class="title">{html.escape(title)}</text>',
    ]
    for t in x_ticks:
        x = left + (t - x0) / ((x1 - x0) or 1) * (WIDTH - left - right)
        label = fmt(10**t) if log_x else fmt(t)
        out.append(
            f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{HEIGHT - bottom}" class="grid"/>'
            f'<text x="{x:.1f}" y="{HEIGHT - bottom + 14}" class="tick" text-anchor="middle">{label}</text>'
        )
    for t in y_ticks:
        out.append(
            f'<line x1="{left}" y1="{py(t):.1f}" x2="{WIDTH - right}" y2="{py(t):.1f}" class="grid"/>'
            f'<text x="{left - 5}" y="{py(t) + 4:.1f}" class="tick" text-anchor="end">{fmt(t)}</text>'
        )
    out.append(
        f'<text x="{(left + WIDTH - right) / 2}" y="{HEIGHT - 8}" class="axis" text-anchor="middle">'
        f'{html.escape(x_label)}</text><text transform="translate(13 {(top + HEIGHT - bottom) / 2}) '
        f'rotate(-90)" class="axis" text-anchor="middle">{html.escape(y_label)}</text>'
    )
    for s in hlines:
        y = py(s.points[0][1])
        out.append(
            f'<line x1="{left}" y1="{y:.1f}" x2="{WIDTH - right}" y2="{y:.1f}" class="reference" '
            f'stroke="{s.color}"><title>{html.escape(s.label)}: {fmt(s.points[0][1])}</title></line>'
        )
    for s in series:
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in sorted(s.points))
        dash = ' stroke-dasharray="5 3"' if s.dashed else ""
        out.append(f'<polyline points="{path}" fill="none" stroke="{s.color}" stroke-width="1.8"{dash}/>')
        if s.markers:
            for i, (x, y) in enumerate(s.points):
                tip = s.marker_titles[i] if i < len(s.marker_titles) else f"{fmt(x)}, {fmt(y)}"
                out.append(
                    f'<circle class="{s.marker_class}" cx="{px(x):.1f}" cy="{py(y):.1f}" r="4" '
                    f'fill="{s.color}"><title>{html.escape(tip)}</title></circle>'
                )
    legend = [s for s in list(series) + list(hlines) if s.label]
    out.append("</svg>")
    items = "".join(
        f'<span><i style="border-color:{s.color}" class="{"dash" if s.dashed or s in hlines else ""}">'
        f"</i>{html.escape(s.label)}</span>"
        for s in legend
    )
    note_html = f'<p class="note">{html.escape(note)}</p>' if note else ""
    return f'<figure>{"".join(out)}<figcaption class="legend">{items}</figcaption>{note_html}</figure>'


def heatmap(title: str, rounds: list[int], clients: list[str], values: dict[tuple[int, str], float]) -> str:
    """Rounds (rows) x clients (columns), darker = more epsilon spent; a cell for every pair."""
    cell_w = max(6, min(24, 380 // max(1, len(clients))))
    cell_h = max(6, min(18, 300 // max(1, len(rounds))))
    left, top = 40, 30
    width, height = left + cell_w * len(clients) + 10, top + cell_h * len(rounds) + 40
    high = max((v for v in values.values() if number(v)), default=1.0) or 1.0
    out = [
        f'<svg class="heatmap" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">'
        f'<title>{html.escape(title)}</title><text x="0" y="16" class="title">{html.escape(title)}</text>'
    ]
    for i, rnd in enumerate(rounds):
        y = top + i * cell_h
        if len(rounds) <= 20 or i % max(1, len(rounds) // 10) == 0:
            out.append(f'<text x="{left - 4}" y="{y + cell_h - 2}" class="tick" text-anchor="end">{rnd}</text>')
        for j, client in enumerate(clients):
            value = values.get((rnd, client))
            shade = f"rgba(128,0,38,{0.08 + 0.92 * value / high:.3f})" if number(value) else "#eee"
            out.append(
                f'<rect class="cell" x="{left + j * cell_w}" y="{y}" width="{cell_w - 1}" height="{cell_h - 1}" '
                f'fill="{shade}" data-round="{rnd}" data-client="{html.escape(client)}">'
                f"<title>round {rnd}, client {html.escape(client)}: epsilon {fmt(value)}</title></rect>"
            )
    bottom = top + cell_h * len(rounds)
    out.append(
        f'<text x="{left}" y="{bottom + 14}" class="tick">clients ({len(clients)}) →  '
        f"rows: rounds; darkest = epsilon {fmt(high)}</text></svg>"
    )
    return "".join(out)
