"""What each move of a candidate bought, from the measurements a compilation already took.

A *move* is one op choice (``attention=sdpa``) or one transform (``threads(n=2)``) of a
candidate. Its effect is read off measured neighbours on one tier, best evidence first:

- ``without``: the candidate minus that move was measured: effect = candidate / without;
- ``alone``: that move alone (over the reference) was measured beside the reference:
  effect = alone / reference;
- ``unmeasured``: neither was measured (no number is made up).

Several measurements of one recipe on a tier count as their median. Code modules and the lossy
flag are not moves: recipes are matched on ops and transforms.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from kiln.domain.candidate import Candidate, Transform

Recipe = tuple[tuple[tuple[str, str], ...], tuple[Transform, ...]]


@dataclass(frozen=True)
class Measured:
    """One correct result: ``candidate`` on ``tier`` ("fast" / "full") at ``tokens_per_s``."""

    candidate: Candidate
    tier: str
    tokens_per_s: float


@dataclass(frozen=True)
class MoveEffect:
    """One move of the candidate: its label, ``factor`` (tokens/s with it over without it;
    None when ``evidence`` is ``unmeasured``), ``evidence`` (``without`` / ``alone`` /
    ``unmeasured``) and the tokens/s the factor divides (``with_tps`` / ``without_tps``)."""

    move: str
    factor: float | None
    evidence: str
    with_tps: float = 0.0
    without_tps: float = 0.0

    def text(self) -> str:
        """One line, e.g. ``threads(n=2): 1.31x (without it 1,020.0 tok/s)``."""
        if self.factor is None:
            return f"{self.move}: not measured apart"
        if self.evidence == "without":
            return f"{self.move}: {self.factor:.2f}x (without it {self.without_tps:,.1f} tok/s)"
        return f"{self.move}: {self.factor:.2f}x alone (reference {self.without_tps:,.1f} tok/s)"


def recipe(c: Candidate) -> Recipe:
    """The part of ``c`` moves are made of: its ops and transforms."""
    return (c.ops, c.transforms)


def moves_of(c: Candidate) -> list[tuple[str, Recipe]]:
    """Each move of ``c`` as (label, ``c``'s recipe without it), ops first then transforms."""
    out: list[tuple[str, Recipe]] = []
    for op, impl in c.ops:
        rest = tuple(o for o in c.ops if o[0] != op)
        out.append((f"{op}={impl}", (rest, c.transforms)))
    for t in c.transforms:
        params = ",".join(f"{k}={v}" for k, v in t.params)
        label = f"{t.name}({params})" if params else t.name
        out.append((label, (c.ops, tuple(x for x in c.transforms if x.name != t.name))))
    return out


def _alone(c: Candidate, label: str) -> Recipe:
    for op, impl in c.ops:
        if f"{op}={impl}" == label:
            return (((op, impl),), ())
    return ((), tuple(t for t in c.transforms if t.name == label.split("(", 1)[0]))


def move_effects(best: Candidate, measured: Iterable[Measured], tier: str) -> list[MoveEffect]:
    """What each move of ``best`` bought on ``tier`` (see the module docstring); empty for the
    reference or when ``best`` itself was not measured on ``tier``."""
    samples: dict[Recipe, list[float]] = {}
    for m in measured:
        if m.tier == tier and m.tokens_per_s > 0:
            samples.setdefault(recipe(m.candidate), []).append(m.tokens_per_s)
    tps = {r: statistics.median(v) for r, v in samples.items()}
    mine = tps.get(recipe(best))
    if mine is None:
        return []
    reference = tps.get(((), ()))
    out = []
    for label, without in moves_of(best):
        if without in tps:
            out.append(MoveEffect(label, mine / tps[without], "without", mine, tps[without]))
            continue
        alone = tps.get(_alone(best, label))
        if alone is not None and reference:
            out.append(MoveEffect(label, alone / reference, "alone", alone, reference))
        else:
            out.append(MoveEffect(label, None, "unmeasured"))
    return out
