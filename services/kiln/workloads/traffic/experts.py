"""MoE expert-load skew from a trace: a Zipf exponent, and the per-expert shares it implies.

**The statistic.** ``expert_zipf_exponent`` s is the maximum-likelihood Zipf exponent of the
trace's *content popularity*: Mooncake gives every prompt as the ids of its 512-token blocks
(equal id = identical content), so how often each distinct block id occurs is how concentrated
the traffic's content is. Ranking the N distinct ids by count (r = 1 most frequent) and treating
each occurrence as a draw of its rank from ``P(r) = r^-s / H(N, s)``, the MLE solves
``E_s[ln r] = mean ln r over occurrences`` (the discrete MLE of Clauset, Shalizi & Newman 2009,
"Power-law distributions in empirical data", with the support bounded by N); ranks and counts
come from independent halves of the requests (:func:`zipf_exponent`), else sorting noise alone
reads as skew. All-distinct content gives s = 0; content dominated by a few recurring blocks
(shared system prompts, multi-turn histories sent again) gives a large s. On the repository's
traces (``../shared/data/traces``): Mooncake conversation ≈ 0.40, Mooncake synthetic ≈ 0.40
(the same-sample fit would say 0.57 and 0.53); Azure traces carry no block ids, so 0
(balanced), with a note.

**Why it sets the expert load.** An MoE router picks experts from the token's hidden state, so
the load per expert is the traffic's content distribution pushed through the router: experts
specialise by token content (Jiang et al. 2024, Mixtral of Experts, §5 routing analysis: the
same tokens keep going to the same experts), so recurring content keeps hitting the same experts
and load concentrates as content does. kiln takes the simplest model of that: the load over
experts follows a Zipf law with the content's exponent, ``share(rank r) ∝ r^-s``, over a seeded
permutation of each layer's experts. It is a stated proxy, not a measurement — request traces
carry no routing — and it ignores that prefix-cached blocks skip prefill (decode tokens about
recurring content still route alike). Engines impose it on random-weight routers (which route
near-uniformly) with a per-expert router bias, see :mod:`kiln.workloads.models.routing`.

**The ratio form.** ``TrafficShape.expert_load_skew`` (the hottest expert's share over the
uniform share, used by the cost model) is the same skew seen through one model:
:func:`hot_ratio` gives it for E experts and top-k routing; :func:`exponent_for_hot_ratio`
inverts it for callers that only give the ratio.

Stdlib only.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Sequence

from kiln.workloads.traffic.records import Request

MAX_EXPONENT = 4.0
"""Upper bound of fitted and inverted exponents (s = 4 already puts ~92 % of a Zipf's mass on
rank 1)."""

_EXACT_RANKS = 2000
_SIMPSON_INTERVALS = 400


def _tail_sums(s: float, a: float, b: float) -> tuple[float, float]:
    """(∫ x^-s dx, ∫ x^-s ln x dx) over ``[a, b]`` by composite Simpson in ``u = ln x``
    (integrands ``e^{(1-s)u}`` and ``u e^{(1-s)u}``: smooth, stable at s = 1)."""
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
    """``E_s[ln r]`` under ``P(r) ∝ r^-s`` on ``1..n``: exact for the first
    :data:`_EXACT_RANKS` ranks, the midpoint-rule integral (Euler–Maclaurin, error ~ f''/24 per
    rank) beyond."""
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
    """MLE of s from ``(rank, occurrences)`` pairs under ``P(r) ∝ r^-s`` on ``1..n``:
    ``E_s[ln r]`` decreases in s, so bisection on ``E_s[ln r] = mean ln r``."""
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
    """Zipf exponent of how often items recur, by split-half maximum likelihood.

    Ranking items by their counts and fitting the same counts overstates s (sorting noise looks
    like skew: 100k uniform draws over 2000 items fit s ≈ 0.12). So, as Piantadosi (2014,
    "Zipf's word frequency law in natural language", Psychon. Bull. Rev.) recommends, ranks and
    frequencies come from independent halves: groups alternate into halves A and B; items are
    ranked by their count in A (ties by first appearance; items absent from A after all of
    A's), the MLE is fitted to B's occurrences at those ranks, and the same with A and B
    swapped; the result is the mean of the two. Support: every distinct item.

    Args:
        groups: the items of each unit in order (e.g. each request's block ids); a unit stays
            whole in one half.

    Returns:
        s in ``[0, MAX_EXPONENT]``; 0.0 with fewer than two distinct items.
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
    """``expert_zipf_exponent`` of a trace: :func:`zipf_exponent` of its requests' hash-id
    blocks (see the module docs); 0.0 when no request has hash ids (Azure)."""
    return zipf_exponent([r.hash_ids for r in requests])


def zipf_shares(num_experts: int, top_k: int, s: float) -> list[float]:
    """Target share of routed assignments per expert *rank* (rank 1 first), summing to 1.

    ``share(r) ∝ r^-s``, then capped at ``1 / top_k`` — an expert cannot be picked by more than
    every token, and each token picks ``top_k`` distinct experts — with the excess spread over
    the uncapped ranks in proportion (water-filling), so the result is feasible.

    Raises:
        ValueError: ``top_k`` outside ``1..num_experts``, or ``s`` negative or not finite.
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
    """The hottest expert's share over the uniform share (``expert_load_skew``'s form) of the
    Zipf load with exponent ``s``: ``num_experts × zipf_shares(...)[0]`` (>= 1, at most
    ``num_experts / top_k``)."""
    return num_experts * zipf_shares(num_experts, top_k, s)[0]


def exponent_for_hot_ratio(ratio: float, num_experts: int, top_k: int) -> float:
    """The smallest Zipf exponent whose :func:`hot_ratio` is ``ratio`` (bisection). The ratio
    is clamped to what ``num_experts`` and ``top_k`` allow (at most ``num_experts / top_k``,
    where the hottest expert takes every token), the exponent to ``MAX_EXPONENT``."""
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
