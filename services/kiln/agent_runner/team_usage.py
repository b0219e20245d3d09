"""Engine time per team over a rolling window, derived from the ledger (so a restarted runner
knows what each team spent).

Each ``ExperimentCompleted`` counts its engine time (:func:`kiln.agent_runner.usage.device_ms_of`:
``device_ms``, else the sum of ``phases_ms``) for the team that appended it (the event's
metadata: the engine pool appends as the work's team), at its ``recorded_at``. On start the
reader finds, by bisection over ``ReadAll`` (one event per probe), the last position recorded
before the window (less :data:`SLACK_S`), reads every completion after it, sets
:attr:`TeamUsage.loaded`, and then follows the ledger, reconnecting after errors.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from dataclasses import dataclass, field

from kiln.agent_runner.usage import device_ms_of
from kiln.common.logging import get_logger
from kiln.ledger.client import LedgerClient
from kiln.v1 import ledger_pb2

log = get_logger("kiln.agent_runner.team_usage")

COMPLETED = "ExperimentCompleted"
SLACK_S = 60.0
"""Read from this long before the window: positions follow commit order, ``recorded_at`` the
transaction's clock, so the two may disagree by a transaction's length."""
RETRY_S = 2.0


def recorded_s(event: ledger_pb2.RecordedEvent) -> float:
    """An event's ``recorded_at`` as Unix seconds."""
    return event.recorded_at.seconds + event.recorded_at.nanos * 1e-9


async def position_before(client: LedgerClient, when_s: float, head: int) -> int:
    """The position of the last event recorded before ``when_s``, found by bisection over
    positions (``recorded_at`` grows with the position but for a transaction's length: callers
    subtract :data:`SLACK_S`); 0 when none is older. ``head``: a position at or below the
    ledger's last (a projection's checkpoint will do); KilnError when the ledger fails.
    """
    lo, hi = 0, max(head, 0) + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first = None
        async for event in client.read_all(mid, max_count=1):
            first = event
        if first is None or recorded_s(first) >= when_s:
            hi = mid
        else:
            lo = max(lo, int(first.position))
    return lo


@dataclass
class TeamUsage:
    """Device-seconds of each team's experiments completed in the last ``period_s`` seconds.

    Attributes:
        loaded: set once the window's history is read (until then :meth:`spent` may be low).
        position: the last ledger position read.
    """

    period_s: float
    loaded: asyncio.Event = field(default_factory=asyncio.Event)
    position: int = 0
    _entries: dict[str, deque[tuple[float, float]]] = field(default_factory=dict)
    _totals: dict[str, float] = field(default_factory=dict)
    _located: bool = False

    # ------------------------------------------------------------------ the book
    def add(self, team: str, at_s: float, device_s: float) -> None:
        """Count ``device_s`` engine seconds of ``team`` at Unix time ``at_s``."""
        if device_s <= 0 or not team:
            return
        self._entries.setdefault(team, deque()).append((at_s, device_s))
        self._totals[team] = self._totals.get(team, 0.0) + device_s

    def spent(self, team: str, now_s: float | None = None) -> float:
        """``team``'s engine seconds recorded in ``(now - period_s, now]``."""
        self._prune(team, time.time() if now_s is None else now_s)
        return self._totals.get(team, 0.0)

    def frees_in(self, team: str, limit_s: float, now_s: float | None = None) -> float:
        """Seconds until :meth:`spent` drops below ``limit_s`` as old entries leave the window
        (0 when it is below already)."""
        now = time.time() if now_s is None else now_s
        total = self.spent(team, now)
        if total < limit_s:
            return 0.0
        for at, device_s in self._entries.get(team, ()):
            total -= device_s
            if total < limit_s:
                return max(0.0, at + self.period_s - now)
        return 0.0

    def _prune(self, team: str, now_s: float) -> None:
        entries = self._entries.get(team)
        start = now_s - self.period_s
        while entries and entries[0][0] <= start:
            _, device_s = entries.popleft()
            self._totals[team] = max(0.0, self._totals[team] - device_s)

    def take(self, event: ledger_pb2.RecordedEvent) -> None:
        """Count one ``ExperimentCompleted`` read from the ledger (others are ignored)."""
        self.position = max(self.position, int(event.position))
        if event.type != COMPLETED:
            return
        try:
            data = json.loads(event.data)
            device_s = device_ms_of(data) / 1e3
        except (ValueError, TypeError, AttributeError):
            return
        at = recorded_s(event)
        if at > time.time() - self.period_s:
            self.add(event.metadata.team, at, device_s)

    # ------------------------------------------------------------------ reading the ledger
    async def run(self, client: LedgerClient, head: int = 0) -> None:
        """Read the window's completions, set :attr:`loaded`, then follow the ledger forever
        (retrying every :data:`RETRY_S` while it fails). ``head``: see :func:`position_before`.
        """
        while True:
            try:
                if not self._located:
                    start = time.time() - self.period_s - SLACK_S
                    self.position = await position_before(client, start, head)
                    self._located = True
                async for event in client.read_all(self.position, types=[COMPLETED]):
                    self.take(event)
                if not self.loaded.is_set():
                    log.info("team usage loaded", position=self.position, teams=len(self._totals))
                    self.loaded.set()
                async for event in client.read_all(self.position, follow=True, types=[COMPLETED]):
                    self.take(event)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("team usage reader stopped; resuming", error=str(exc) or repr(exc))
                await asyncio.sleep(RETRY_S)
