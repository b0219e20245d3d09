"""The compilation's results as the LLM prompt shows them: best first, failures with their errors,
within a character budget; and the per-op times (``op_ms``) when result bodies carry them."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kiln.domain.candidate import Candidate

ERROR_CHARS = 240
"""Longest error excerpt per failed result, characters."""
_TRAILER_CHARS = 32
"""Room kept for the "... (N more left out)" line."""


@dataclass(frozen=True)
class Entry:
    """One result body, read defensively.

    Attributes:
        text: the candidate as :meth:`Candidate.describe` writes it ("?" if unreadable).
        status: ``ok``, ``incorrect``, ``crashed``, ``timed_out``, ``rejected``, ...
        ok: status ok and measured correct.
        tokens_per_s: tokens/s (0 when unknown).
        speedup: tokens/s over the baseline's, or None.
        error: the engine's error text ("" for none).
        op_ms: op name -> milliseconds per forward step, when the body carries a profile.
    """

    text: str
    status: str
    ok: bool
    tokens_per_s: float
    speedup: float | None
    error: str
    op_ms: dict[str, float]

    def line(self) -> str:
        """One line for the prompt."""
        speed = f", {self.speedup:.3g}x baseline" if self.speedup is not None else ""
        head = f"- [{self.status}] {self.tokens_per_s:.4g} tokens/s{speed}: {self.text}"
        if self.ok or not self.error:
            return head
        error = " ".join(self.error.split())
        if len(error) > ERROR_CHARS:
            error = error[:ERROR_CHARS] + "..."
        return f"{head}\n    error: {error}"


def _number(value: Any) -> float | None:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def read_op_ms(body: Mapping[str, Any]) -> dict[str, float]:
    """``body["op_ms"]`` as op -> ms, keeping only finite non-negative numbers ({} if absent
    or malformed: the profiler may not have landed on the engines yet)."""
    raw = body.get("op_ms")
    if not isinstance(raw, Mapping):
        return {}
    out = {}
    for op, ms in raw.items():
        x = _number(ms)
        if isinstance(op, str) and x is not None and x >= 0:
            out[op] = x
    return out


def entry(body: Mapping[str, Any]) -> Entry:
    """A result body (:func:`kiln.agent_runner.results.result_body`) as an :class:`Entry`."""
    try:
        text = Candidate.from_canonical(dict(body["candidate"])).describe()
    except (KeyError, TypeError, ValueError):
        text = "?"
    status = str(body.get("status") or "unknown")
    return Entry(
        text=text,
        status=status,
        ok=status == "ok" and bool(body.get("correct")),
        tokens_per_s=_number(body.get("tokens_per_s")) or 0.0,
        speedup=_number(body.get("speedup")),
        error=str(body.get("error") or ""),
        op_ms=read_op_ms(body),
    )


def ordered(bodies: Sequence[Mapping[str, Any]]) -> list[Entry]:
    """Correct results fastest first, then failures newest first (``bodies`` oldest first)."""
    entries = [entry(b) for b in bodies]
    good = sorted((e for e in entries if e.ok), key=lambda e: -e.tokens_per_s)
    bad = [e for e in reversed(entries) if not e.ok]
    return good + bad


def op_profile(bodies: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Per-op ms of the fastest correct result that carries a profile, else of the newest result
    that does; {} when none does."""
    entries = ordered(bodies)
    for e in entries:
        if e.op_ms:
            return e.op_ms
    return {}


def history_text(
    bodies: Sequence[Mapping[str, Any]], budget_chars: int, notes: Sequence[str] = ()
) -> str:
    """The results (see :func:`ordered`) and ``notes`` (this agent's rejected replies), one
    line each, cut to at most ``budget_chars`` characters; a last line says how many were left
    out. "(no results yet)" when there are none."""
    lines = [e.line() for e in ordered(bodies)]
    lines += [f"- [your reply rejected] {n}" for n in notes]
    if not lines:
        return "(no results yet)"
    room = budget_chars - _TRAILER_CHARS
    kept: list[str] = []
    used = 0
    for i, line in enumerate(lines):
        if used + len(line) > room:
            kept.append(f"... ({len(lines) - i} more left out)")
            break
        kept.append(line)
        used += len(line) + 1
    return "\n".join(kept)
