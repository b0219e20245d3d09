"""Interpolation over measured points, as the microbenchmark tier reads its tables.

Times are interpolated linearly between measured points (an op's time is close to affine in
its work between two nearby shapes). Below the smallest measured point the smallest's time is
kept (a kernel does not get faster than its fixed cost); above the largest the time grows in
proportion to the work (``y_last x x / x_last``, a bandwidth- or math-bound op) and the answer
says it was extrapolated. Pure functions, no I/O.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

Kind = str
"""How a value was obtained: ``measured`` (at the point), ``interpolated`` (between points),
``clamped`` (below the smallest), ``extrapolated`` (above the largest), ``scaled`` (from
another shape, by the ratio of work)."""


@dataclass(frozen=True)
class Lookup:
    """A time read off a table, ms, and how (:data:`Kind`)."""

    ms: float
    how: Kind

    def scaled(self, factor: float, how: Kind | None = None) -> Lookup:
        """The time times ``factor``; ``how`` replaces the kind when given."""
        return Lookup(self.ms * factor, how or self.how)


_RANK = {"measured": 0, "interpolated": 1, "clamped": 2, "scaled": 3, "extrapolated": 4}


def worst(a: Kind, b: Kind) -> Kind:
    """The less direct of two kinds (measured < interpolated < clamped < scaled <
    extrapolated)."""
    return a if _RANK.get(a, 9) >= _RANK.get(b, 9) else b


def interp_1d(xs: Sequence[float], ys: Sequence[float], x: float) -> Lookup:
    """``y(x)`` over points ``xs`` (ascending, distinct, positive) and ``ys``; ValueError for
    empty or mismatched inputs."""
    if not xs or len(xs) != len(ys):
        raise ValueError("interp_1d needs as many ys as xs, at least one")
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return Lookup(ys[i], "measured")
    if i == 0:
        return Lookup(ys[0], "clamped")
    if i == len(xs):
        return Lookup(ys[-1] * x / xs[-1], "extrapolated")
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return Lookup(y0 + (y1 - y0) * (x - x0) / (x1 - x0), "interpolated")


def interp_2d(
    xs: Sequence[float],
    ys: Sequence[float],
    table: dict[tuple[float, float], float],
    x: float,
    y: float,
) -> Lookup | None:
    """Bilinear ``f(x, y)`` over the grid ``xs`` x ``ys`` (ascending); ``table`` must hold
    every grid cell (None when one is missing). Outside the grid the nearest edge point is used
    and, above it, scaled by ``(x y) / (x_edge y_edge)`` (``extrapolated``)."""
    if not xs or not ys:
        return None
    cx, cy = min(max(x, xs[0]), xs[-1]), min(max(y, ys[0]), ys[-1])
    ix = min(max(bisect.bisect_left(xs, cx), 1), len(xs) - 1) if len(xs) > 1 else 0
    iy = min(max(bisect.bisect_left(ys, cy), 1), len(ys) - 1) if len(ys) > 1 else 0
    x0, x1 = (xs[ix - 1], xs[ix]) if len(xs) > 1 else (xs[0], xs[0])
    y0, y1 = (ys[iy - 1], ys[iy]) if len(ys) > 1 else (ys[0], ys[0])
    try:
        f00, f01 = table[(x0, y0)], table[(x0, y1)]
        f10, f11 = table[(x1, y0)], table[(x1, y1)]
    except KeyError:
        return None
    tx = (cx - x0) / (x1 - x0) if x1 != x0 else 0.0
    ty = (cy - y0) / (y1 - y0) if y1 != y0 else 0.0
    value = f00 * (1 - tx) * (1 - ty) + f10 * tx * (1 - ty) + f01 * (1 - tx) * ty + f11 * tx * ty
    if (x, y) == (cx, cy):
        on_grid = x in xs and y in ys
        return Lookup(value, "measured" if on_grid else "interpolated")
    grow = max(1.0, (x * y) / (cx * cy))
    return Lookup(value * grow, "extrapolated" if grow > 1 else "clamped")
