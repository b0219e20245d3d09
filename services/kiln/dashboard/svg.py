"""Server-side SVG plots: best-so-far step lines over time, one series per agent.

:func:`step_plot` returns one ``<svg>`` element as text (no script, no external reference);
every label is escaped. Empty data gives a plot frame with "no data yet", never an error.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from html import escape

PALETTE = (
    "#1f77b4",
    "#d62728",
    "#2ca02c",
    "#ff7f0e",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#17becf",
    "#7f7f7f",
    "#bcbd22",
)
"""Series colours, in order (tab10)."""


@dataclass(frozen=True)
class Series:
    """One line: ``points`` are (x, y) pairs in x order; ``dashed`` draws it dashed."""

    name: str
    points: Sequence[tuple[float, float]] = field(default_factory=tuple)
    dashed: bool = False


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About ``count`` round tick values covering [lo, hi] (1, 2, 5 times a power of ten)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return [0.0]
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(count, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step) * step
    ticks: list[float] = []
    t = first
    while t <= hi + step * 1e-9:
        ticks.append(round(t, 10))
        t += step
    if ticks[-1] < hi:
        ticks.append(round(t, 10))
    return ticks


def fmt(value: float) -> str:
    """A tick label: thousands separators, at most 3 significant decimals."""
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if value == int(value):
        return f"{int(value)}"
    return f"{value:.3g}"


def step_plot(
    series: Sequence[Series],
    *,
    title: str = "",
    x_label: str = "seconds since submission",
    y_label: str = "tokens/s",
    width: int = 720,
    height: int = 320,
    x_max: float | None = None,
) -> str:
    """An SVG of ``series`` as step lines (each holds its value until its next point; with
    ``x_max`` the last value is held to it). Axes start at 0; ticks are round numbers."""
    left, right, top, bottom = 64, 170, 28, 44
    pw, ph = width - left - right, height - top - bottom
    pts = [p for s in series for p in s.points if math.isfinite(p[0]) and math.isfinite(p[1])]
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="plot" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="{escape(title or y_label)}">',
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#fff"/>',
    ]
    if title:
        out.append(
            f'<text x="{left}" y="18" font-size="14" font-weight="bold">{escape(title)}</text>'
        )
    x_hi = max([p[0] for p in pts] + [x_max or 0.0, 1.0])
    y_hi = max([p[1] for p in pts] + [1.0]) * 1.05
    xt, yt = nice_ticks(0.0, x_hi), nice_ticks(0.0, y_hi)
    x_hi, y_hi = xt[-1] or 1.0, yt[-1] or 1.0

    def sx(x: float) -> float:
        return left + pw * x / x_hi

    def sy(y: float) -> float:
        return top + ph - ph * y / y_hi

    out.append('<g class="axes" font-size="11" fill="#333" stroke="none">')
    for t in yt:
        y = sy(t)
        out.append(
            f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>'
            f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{fmt(t)}</text>'
        )
    for t in xt:
        x = sx(t)
        out.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top + ph}" y2="{top + ph + 4}" stroke="#333"/>'
            f'<text x="{x:.1f}" y="{top + ph + 16}" text-anchor="middle">{fmt(t)}</text>'
        )
    out.append(
        f'<line class="x-axis" x1="{left}" x2="{left + pw}" y1="{top + ph}" y2="{top + ph}" '
        'stroke="#333"/>'
        f'<line class="y-axis" x1="{left}" x2="{left}" y1="{top}" y2="{top + ph}" stroke="#333"/>'
        f'<text x="{left + pw / 2:.1f}" y="{height - 8}" text-anchor="middle">'
        f"{escape(x_label)}</text>"
        f'<text transform="translate(14 {top + ph / 2:.1f}) rotate(-90)" '
        f'text-anchor="middle">{escape(y_label)}</text></g>'
    )
    if not pts:
        out.append(
            f'<text class="empty" x="{left + pw / 2:.1f}" y="{top + ph / 2:.1f}" '
            'text-anchor="middle" fill="#888" font-size="13">no data yet</text>'
        )
    for i, s in enumerate(series):
        colour = PALETTE[i % len(PALETTE)]
        good = [p for p in s.points if math.isfinite(p[0]) and math.isfinite(p[1])]
        if good:
            path = _step_path(good, x_max, sx, sy)
            dash = ' stroke-dasharray="5 3"' if s.dashed else ""
            out.append(
                f'<g class="series" data-series="{escape(s.name)}">'
                f'<path d="{path}" fill="none" stroke="{colour}" stroke-width="2"{dash}/>'
            )
            for x, y in good:
                out.append(
                    f'<circle class="point" cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" '
                    f'fill="{colour}"><title>{escape(s.name)}: {fmt(y)} at {fmt(x)} s'
                    "</title></circle>"
                )
            out.append("</g>")
        ly = top + 10 + 16 * i
        out.append(
            f'<g class="legend"><rect x="{left + pw + 12}" y="{ly - 8}" width="12" height="3" '
            f'fill="{colour}"/><text x="{left + pw + 30}" y="{ly - 2}" font-size="11">'
            f"{escape(s.name[:24])}</text></g>"
        )
    out.append("</svg>")
    return "".join(out)


def _step_path(
    points: Sequence[tuple[float, float]],
    x_max: float | None,
    sx: Callable[[float], float],
    sy: Callable[[float], float],
) -> str:
    """The ``d`` of a step line through ``points`` (held to ``x_max`` when given)."""
    parts = [f"M{sx(points[0][0]):.1f},{sy(points[0][1]):.1f}"]
    for x, y in points[1:]:
        parts.append(f"H{sx(x):.1f}V{sy(y):.1f}")
    end = points[-1][0] if x_max is None else max(points[-1][0], x_max)
    parts.append(f"H{sx(end):.1f}")
    return "".join(parts)
