"""How many timed steps the gate verifies against the reference (rationale:
docs/design/engine.md, "Check").

A candidate wrong on a fraction ``p`` of its timed steps escapes ``k`` steps chosen uniformly
after each call returned with probability at most ``(1 - p) ** k`` (drawn without replacement
it is lower). The default ``k`` is the smallest with ``(1 - CHEAT_FRACTION) ** k <
ESCAPE_TARGET``; an experiment with fewer timed steps verifies them all, and records the
probability it achieved. Standard library only (the engine pool's settings import it).
"""

from __future__ import annotations

CHEAT_FRACTION = 0.2
"""The fraction of wrong timed steps the default is sized to catch."""
ESCAPE_TARGET = 0.01
"""The chance such a cheat may have of escaping, at most (exclusive)."""


def escape_probability(verified: int, fraction: float = CHEAT_FRACTION) -> float:
    """``(1 - fraction) ** verified``: the chance that none of ``verified`` steps is one of a
    ``fraction`` of wrong ones (1.0 when none was verified)."""
    return (1.0 - fraction) ** max(0, verified)


def steps_to_verify(fraction: float = CHEAT_FRACTION, target: float = ESCAPE_TARGET) -> int:
    """The smallest ``k`` with :func:`escape_probability` ``(k, fraction) < target``.

    Raises:
        ValueError: ``fraction`` not in (0, 1] or ``target`` not in (0, 1].
    """
    if not 0 < fraction <= 1 or not 0 < target <= 1:
        raise ValueError(f"need 0 < fraction <= 1 and 0 < target <= 1, got {fraction}, {target}")
    k = 0
    while escape_probability(k, fraction) >= target:
        k += 1
    return k


VERIFY_TIMED_STEPS = steps_to_verify()
"""The default number of timed steps verified: 21 for a fifth of the steps and 1 %."""
