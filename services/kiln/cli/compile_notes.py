"""The legend ``kiln compile``'s summary needs, from what the ledger recorded: which baseline
stands beside the best (like with like: full tier beside a full-tier best) and warnings about
noisy timing and a weak fast/full rank agreement."""

from __future__ import annotations

import re
from typing import Any

from kiln.export.reproduce import NOISY_SPREAD
from kiln.v1 import common_pb2, compiler_pb2


def tps(value: float) -> str:
    """Tokens/s for the tables: ``1,234.5 tok/s``, ``-`` for none."""
    return f"{value:,.1f} tok/s" if value else "-"


def tier_text(m: Any) -> str:
    """``, fast tier`` / ``, full tier`` of a measurement ("" when its tier is unknown)."""
    name = {common_pb2.TIER_FAST: "fast", common_pb2.TIER_FULL: "full"}.get(m.tier)
    return f", {name} tier" if name else ""


def baseline_rows(snap: compiler_pb2.Compilation) -> list[tuple[str, str]]:
    """The baseline rows, like with like: beside a full-tier best, the reference measured next
    to it on the full tier, and the fast-tier baseline (a few layers) in a row of its own; else
    the fast-tier baseline with its tier."""
    fast = snap.baseline
    best = snap.best if snap.HasField("best") else None
    if best is None or best.measurement.tier != common_pb2.TIER_FULL:
        return [("baseline", tps(fast.tokens_per_s) + tier_text(fast))]
    ref = best.reference.tokens_per_s
    fast_text = f"{tps(fast.tokens_per_s)} (fast tier: a few layers, not comparable with the best)"
    if ref <= 0:  # recorded before the reference's figure was: no full-tier baseline to show
        return [("fast-tier baseline", fast_text)]
    return [
        ("baseline", f"{tps(ref)} (full tier, the reference measured next to the best)"),
        ("fast-tier baseline", fast_text),
    ]


WEAK_AGREEMENT = 0.5
"""A fast/full Spearman rho below this (over 3 candidates or more, or negative over 2) is a
weak agreement: fast-tier winners may not win on the full model."""
_AGREEMENT = re.compile(r"Spearman rho (-?\d+(?:\.\d+)?) over (\d+) candidates")


def spread(t: common_pb2.Timing) -> float | None:
    """The p10-p90 spread of a timing over its median; None when not recorded."""
    if t.median_ms <= 0 or t.p90_ms <= 0 or t.p10_ms <= 0:
        return None
    return (t.p90_ms - t.p10_ms) / t.median_ms


def agreement_of(reason: str) -> tuple[int, float] | None:
    """(n, rho) of the tier agreement a succeeded compilation's reason ends with
    (:func:`kiln.domain.judging.agreement_text`), or None when it has no rho."""
    m = _AGREEMENT.search(reason)
    return None if m is None else (int(m.group(2)), float(m.group(1)))


def summary_warnings(snap: compiler_pb2.Compilation) -> list[str]:
    """What the figures need as a legend, from what was recorded: noisy timing of the best, its
    reference or the baseline (p10-p90 over :data:`~kiln.export.reproduce.NOISY_SPREAD` of the
    median, as ``reproduce`` flags it) and a weak or negative fast/full rank agreement
    (:data:`WEAK_AGREEMENT`)."""
    out = []
    timed = [("baseline", snap.baseline)]
    if snap.HasField("best"):
        timed = [("best", snap.best.measurement), ("reference next to it", snap.best.reference)]
        timed.append(("fast-tier baseline", snap.baseline))
    for label, m in timed:
        s = spread(m.timing)
        if s is not None and s > NOISY_SPREAD:
            t = m.timing
            out.append(
                f"noisy timing: the {label}'s steps spread over {s:.0%} of their median "
                f"(p10 {t.p10_ms:.2f} ms, p90 {t.p90_ms:.2f} ms); other work on the engine's "
                "host? Re-measure on a quiet host before trusting the figures"
            )
    agreement = agreement_of(snap.reason)
    if agreement is not None:
        n, rho = agreement
        if (n >= 3 and rho < WEAK_AGREEMENT) or (n >= 2 and rho < 0):
            kind = "negative" if rho < 0 else "weak"
            out.append(
                f"{kind} fast/full rank agreement (Spearman rho {rho:.2f} over {n} candidates): "
                "the fast tier's winners may not be the full model's; only full-tier figures "
                "(the best and its reference) count"
            )
    return out
