"""When ``kiln supervise`` restarts a component that died, and when it stops trying.

A component found dead is restarted after a pause that doubles with each restart in a row
(``first_delay_s``, jittered, at most ``max_delay_s``); a run that lasts ``stable_s`` resets the
count. After ``max_restarts`` restarts in a row, none of them stable, the component is in a
*crash loop*: the supervisor stops restarting it and says so (its log, ``kiln status``) until
``kiln up`` runs again (:meth:`Restarts.reset`). Times are ``time.monotonic()`` seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.common.backoff import backoff_s


@dataclass(frozen=True)
class RestartPolicy:
    """The schedule (seconds): first pause, longest pause, the run that counts as stable, and
    the restarts in a row that make a crash loop."""

    first_delay_s: float = 0.5
    max_delay_s: float = 30.0
    stable_s: float = 60.0
    max_restarts: int = 8
    jitter: float = 0.25


@dataclass
class Restarts:
    """One component's restarts under ``policy``.

    Attributes:
        in_a_row: restarts since the last stable run. total: restarts since the supervisor
            started. up_since: when it was last started or first seen running (None: not
            running). retry_at: when the next restart is due (None: none scheduled).
        last_exit: how it ended last ("" if it never did). gave_up: why it is no longer
            restarted ("" while it is).
    """

    policy: RestartPolicy = field(default_factory=RestartPolicy)
    in_a_row: int = 0
    total: int = 0
    up_since: float | None = None
    retry_at: float | None = None
    last_exit: str = ""
    gave_up: str = ""

    def running(self, now: float) -> None:
        """It was seen running at ``now``: a run of ``stable_s`` clears the count."""
        if self.up_since is None:
            self.up_since = now
        elif self.in_a_row and now - self.up_since >= self.policy.stable_s:
            self.in_a_row = 0
        self.retry_at = None

    def died(self, now: float, how: str) -> bool:
        """It was seen dead at ``now`` (ended ``how``); schedule its restart, or give up when
        the count reached ``max_restarts``. True the first time a death is seen (to log it),
        False while the restart is already scheduled or it was given up."""
        if self.retry_at is not None or self.gave_up:
            return False
        self.up_since = None
        self.last_exit = how
        if self.in_a_row >= self.policy.max_restarts:
            self.gave_up = (
                f"crash loop: gave up after {self.in_a_row} restarts in a row, none lasting "
                f"{self.policy.stable_s:g} s (last: {how}); `kiln up` tries again"
            )
            return True
        pause = backoff_s(
            self.in_a_row + 1,
            first_s=self.policy.first_delay_s,
            max_s=self.policy.max_delay_s,
            jitter=self.policy.jitter,
        )
        self.retry_at = now + pause
        return True

    def due(self, now: float) -> bool:
        """A restart is scheduled for ``now`` or earlier."""
        return not self.gave_up and self.retry_at is not None and now >= self.retry_at

    def restarted(self, now: float) -> None:
        """It was (re)started at ``now``."""
        self.in_a_row += 1
        self.total += 1
        self.retry_at = None
        self.up_since = now

    def reset(self) -> None:
        """Forget the crash loop and the count (``kiln up`` ran again)."""
        self.in_a_row = 0
        self.retry_at = None
        self.gave_up = ""

    def describe(self, now: float) -> str:
        """What ``kiln status`` adds to the component's row ("" when there is nothing to say)."""
        if self.gave_up:
            return self.gave_up
        if self.retry_at is not None:
            wait = max(0.0, self.retry_at - now)
            return f"died ({self.last_exit}); restarting in {wait:.1f} s"
        if self.total:
            last = self.last_exit if len(self.last_exit) <= 120 else self.last_exit[:117] + "..."
            return f"restarted {self.total}x (last: {last})"
        return ""
