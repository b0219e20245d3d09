"""Which work subject (lane) a free device takes its next experiment from: the pool's scheduling
rule, a pure function of what the device holds and how long each lane has waited (why:
docs/design/engine.md, "Scheduling").

A lane is one ``(device kind, tier, model)`` work subject with work queued. For one device:

1. **Overdue first**: a lane that has waited at least its bound (``full_max_wait_s`` for the
   full tier, ``fast_max_wait_s`` for the fast tier) since it was last served here (or since
   work appeared on it) comes before every other, longest wait first, even when taking it
   evicts a warm engine. This is what keeps a confirmation from starving behind a busy
   search lane.
2. **Then lanes that evict nothing** (the device holds their engine, or has room for one more),
   full tier before fast tier (a confirmation holds its compilation's agents; a search item
   does not), then the device's own engines before a build, then models another device of the
   pool does not hold, then the longest wait: lanes of equal standing take turns, so no warm
   lane is drained while another waits.
3. **Last, lanes whose engine would evict a warm one**, full tier first, longest wait first:
   taken only when nothing cheaper has work (an engine build costs seconds to minutes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

FULL_TIER = "full"


@dataclass(frozen=True)
class LaneView:
    """What the rule reads of one lane for one device.

    Attributes:
        tier: "fast" or "full". waited_s: seconds since the lane was last served (or since work
            appeared on it, when later). here: this device holds the lane's engine.
        elsewhere: another device of the pool holds it (and this one does not).
    """

    tier: str
    waited_s: float
    here: bool
    elsewhere: bool = False


@dataclass(frozen=True)
class WaitBounds:
    """Longest waits, seconds, after which a lane is served even at the cost of an engine
    switch (``KILN_ENGINE_FULL_MAX_WAIT_S``, ``KILN_ENGINE_FAST_MAX_WAIT_S``)."""

    full_s: float
    fast_s: float

    def of(self, tier: str) -> float:
        """The bound of ``tier``."""
        return self.full_s if tier == FULL_TIER else self.fast_s


def lane_key(lane: LaneView, *, room: bool, bounds: WaitBounds) -> tuple[float, ...]:
    """The sort key of ``lane`` for a device (smaller first); ``room``: the device can build one
    more engine without evicting one.
    """
    if lane.waited_s >= bounds.of(lane.tier):
        return (0.0, -lane.waited_s)
    tier = 0.0 if lane.tier == FULL_TIER else 1.0
    if lane.here or room:
        return (1.0, tier, float(not lane.here), float(lane.elsewhere), -lane.waited_s)
    return (2.0, tier, -lane.waited_s)


def lane_order(lanes: Sequence[LaneView], *, room: bool, bounds: WaitBounds) -> list[int]:
    """Indices of ``lanes`` in the order a device should try them (stable on ties)."""
    return sorted(range(len(lanes)), key=lambda i: lane_key(lanes[i], room=room, bounds=bounds))
