"""Exponential backoff with jitter, the one schedule kiln's retry loops share (the engine pool
waiting out the ledger, the agent runner waiting out the ledger and NATS, ``kiln supervise``
restarting what died)."""

from __future__ import annotations

import random


def backoff_s(
    failures: int, *, first_s: float = 0.5, max_s: float = 10.0, jitter: float = 0.5
) -> float:
    """The pause after the ``failures``-th failure in a row (1 = the first), seconds:
    ``first_s * 2**(failures - 1)`` capped at ``max_s``, then scaled by a uniform factor in
    ``[1 - jitter, 1]`` so processes that failed together do not retry together.
    """
    base = min(max_s, first_s * 2.0 ** max(0, min(failures - 1, 62)))
    return base * random.uniform(1.0 - max(0.0, min(jitter, 1.0)), 1.0)
