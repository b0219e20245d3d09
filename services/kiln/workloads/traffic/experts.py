"""MoE expert-load skew from a trace: a Zipf exponent and the per-expert shares it implies
(stdlib only; rationale: docs/design/kernels.md, "Expert load from a trace").

``expert_zipf_exponent`` s is the split-half MLE Zipf exponent of how often Mooncake prompts'
block ids recur (0 for Azure); expert load is modelled as ``share(r) ∝ r^-s``.
``TrafficShape.expert_load_skew`` is the same skew as a ratio (:func:`hot_ratio`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Sequence

from kiln.workloads.traffic.records import Request

MAX_EXPONENT = 4.0
"""Upper bound of fitted and inverted exponents (s = 4 puts ~92 % of a Zipf's mass on rank 1)."""

_EXACT_RANKS = 2000
_SIMPSON_INTERVALS = 400


def _tail_sums(s: float, a: float, b: float) -> tuple[float, float]:
    """(∫ x^-s dx, ∫ x^-s ln x dx) over ``[a, b]`` by Simpson's rule in ``ln x``."""
    lo, hi = math.log(a), math.log(b)
    n = _SIMPSON_INTERVALS
    h = (hi - lo) / n
    z = z1 = 0.0
    for i in range(n + 1):
        u = lo + i * h
        w = 1 if i in (0, n) else (4 if i % 2 else 2)
        e = math.exp((1.0 - s) * u)
        z += w * e
        z1 += w * u * e
    return z * h / 3, z1 * h / 3


def _mean_log_rank(s: float, n: int) -> float:
    """``E_s[ln r]`` under ``P(r) ∝ r^-s`` on ``1..n`` (exact head, integral tail)."""
    head = min(n, _EXACT_RANKS)
    z = z1 = 0.0
    for r in range(1, head + 1):
        lr = math.log(r)
        e = math.exp(-s * lr)
        z += e
        z1 += e * lr
    if n > head:
        tz, tz1 = _tail_sums(s, head + 0.5, n + 0.5)
        z += tz
        z1 += tz1
    return z1 / z


def _fit(pairs: Sequence[tuple[int, int]], n: int) -> float:
    """MLE of s from ``(rank, occurrences)`` on ``1..n``, by bisection on ``E_s[ln r]``."""
    total = sum(c for _, c in pairs)
    if n < 2 or total == 0:
        return 0.0
    target = math.fsum(c * math.log(r) for r, c in pairs) / total
    lo, hi = 0.0, MAX_EXPONENT
    if _mean_log_rank(hi, n) >= target:
        return MAX_EXPONENT
    if _mean_log_rank(lo, n) <= target:
        return 0.0
    for _ in range(48):  # to ~1e-14
        mid = (lo + hi) / 2
        if _mean_log_rank(mid, n) > target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def zipf_exponent(groups: Sequence[Sequence[Hashable]]) -> float:
    """Zipf exponent of how often items recur, by split-half maximum likelihood (Piantadosi
    2014).

    ``groups``: each unit's items in order (a unit stays in one half). Returns s in
    ``[0, MAX_EXPONENT]``; 0.0 with fewer than two distinct items.
    """
    halves: tuple[Counter[Hashable], Counter[Hashable]] = (Counter(), Counter())
    first: dict[Hashable, int] = {}
    for i, items in enumerate(groups):
        for item in items:
            first.setdefault(item, len(first))
        halves[i % 2].update(items)
    n = len(first)
    if n < 2:
        return 0.0
    fits = []
    for ranked_by, fitted in ((halves[0], halves[1]), (halves[1], halves[0])):
        order = sorted(first, key=lambda item: (-ranked_by[item], first[item]))
        rank = {item: r for r, item in enumerate(order, start=1)}
        fits.append(_fit([(rank[item], c) for item, c in fitted.items()], n))
    return (fits[0] + fits[1]) / 2


def block_popularity_exponent(requests: Sequence[Request]) -> float:
    """:func:`zipf_exponent` of the requests' hash-id blocks; 0.0 when none has any."""
    return zipf_exponent([r.hash_ids for r in requests])


def zipf_shares(num_experts: int, top_k: int, s: float) -> list[float]:
    """Target share per expert rank (rank 1 first), summing to 1: ``r^-s`` capped at ``1 /
    top_k``, the excess water-filled. ValueError for ``top_k`` outside ``1..E`` or a bad ``s``.
    """
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be within 1..{num_experts}, got {top_k}")
    if not (math.isfinite(s) and s >= 0):
        raise ValueError(f"the Zipf exponent must be finite and >= 0, got {s}")
    raw = [r**-s for r in range(1, num_experts + 1)]
    cap = 1.0 / top_k
    shares = [0.0] * num_experts
    free = list(range(num_experts))
    budget = 1.0
    while free:
        mass = math.fsum(raw[i] for i in free)
        over = [i for i in free if budget * raw[i] / mass > cap]
        if not over:
            for i in free:
                shares[i] = budget * raw[i] / mass
            break
        for i in over:
            shares[i] = cap
        budget -= cap * len(over)
        free = [i for i in free if i not in over]
    return shares


def hot_ratio(num_experts: int, top_k: int, s: float) -> float:
    """``num_experts x zipf_shares(...)[0]``: in ``[1, num_experts / top_k]``."""
    return num_experts * zipf_shares(num_experts, top_k, s)[0]


def exponent_for_hot_ratio(ratio: float, num_experts: int, top_k: int) -> float:
    """The smallest exponent whose :func:`hot_ratio` is ``ratio`` (clamped to the reachable
    range).
    """
    if not ratio > 1.0:
        return 0.0
    lo, hi = 0.0, MAX_EXPONENT
    ratio = min(ratio, hot_ratio(num_experts, top_k, hi))
    for _ in range(60):
        mid = (lo + hi) / 2
        if hot_ratio(num_experts, top_k, mid) < ratio:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
