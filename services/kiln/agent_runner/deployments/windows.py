"""The controller's window state: a :class:`WindowFolder` over the feed's messages, and the
stream sequence a restarted controller re-reads from.

With window ``k`` recorded, :meth:`WindowTracker.resume_after` gives the sequence of the oldest
message that may still hold a record of an open window (a message's latest arrival at or after
the first open window's start), or the next sequence when none may: re-reading from there and
re-adding the records to a folder made with the same spec, origin and ``closed_before`` closes
the same windows at the same records (records of windows already recorded count as late and are
dropped), so nothing is recorded twice and nothing is lost.
"""

from __future__ import annotations

from collections import deque

from kiln.agent_runner.deployments.feed import FeedMessage
from kiln.workloads.traffic.windows import TrafficWindow, WindowFolder, WindowSpec


class WindowTracker:
    """Windows of one deployment's feed.

    Args:
        spec: the deployment's window spec.
        origin_s: start of window 0 (None: the first record's arrival).
        closed_before: windows below this index are recorded already.
        resume_sequence: the sequence reading starts at (what :meth:`resume_after` said).
    """

    def __init__(
        self,
        spec: WindowSpec,
        origin_s: float | None = None,
        closed_before: int = 0,
        resume_sequence: int = 1,
    ) -> None:
        self.folder = WindowFolder(spec, origin_s, closed_before=closed_before)
        self._messages: deque[tuple[int, float]] = deque()
        self._next_sequence = resume_sequence
        self.last_arrival_s: float | None = None

    @property
    def origin_s(self) -> float | None:
        """Start of window 0 (None before the first record)."""
        return self.folder.origin_s

    def add(self, message: FeedMessage) -> list[TrafficWindow]:
        """Fold one message in; the windows it closes, oldest first."""
        closed: list[TrafficWindow] = []
        for request in message.requests:
            closed += self.folder.add(request)
            if self.last_arrival_s is None or request.arrival_s > self.last_arrival_s:
                self.last_arrival_s = request.arrival_s
        if message.requests:
            latest = max(r.arrival_s for r in message.requests)
            self._messages.append((message.sequence, latest))
        if message.flush:
            closed += self.folder.flush()
        self._next_sequence = max(self._next_sequence, message.sequence + 1)
        return closed

    def resume_after(self, index: int) -> int:
        """Where a controller restarted once window ``index`` is recorded re-reads from: the
        oldest message that may hold a record of window ``index + 1`` or later."""
        start = self.folder.start_of(index + 1)
        for sequence, latest in self._messages:
            if latest >= start:
                return sequence
        return self._next_sequence

    def recorded(self, index: int) -> None:
        """Window ``index`` is in the ledger: forget the messages no later window needs."""
        start = self.folder.start_of(index + 1)
        while self._messages and self._messages[0][1] < start:
            self._messages.popleft()
