"""Admission of compilations and of their work items under the teams' quotas
(:mod:`kiln.agent_runner.quotas`; why: docs/design/security.md, "Quotas and fairness").

A submitted compilation is *pending* until its team has a running slot (``max_running``) and
device time left (``device_seconds`` over the period); pending ones are admitted in submission
order (ledger position), so a restart admits them in the same order. A compilation already
running when the runner (re)starts keeps its slot even beyond the limit. A Submit while the team
already has ``max_pending`` waiting is RESOURCE_EXHAUSTED. Search-tier work items are admitted
through two FIFO semaphores, the compilation's (``max_in_flight``, in the lab) and the team's
(``max_in_flight_team``, here), so a team's compilations take turns on its share of the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kiln.agent_runner.quotas import QuotaSettings, TeamLimits
from kiln.agent_runner.team_usage import TeamUsage
from kiln.common.errors import ResourceExhausted
from kiln.common.logging import get_logger

log = get_logger("kiln.agent_runner.admission")

NOT_LOADED_RETRY_S = 0.5
"""How soon a device-time check is tried again while the usage is still being read."""


@dataclass
class _Team:
    running: set[str] = field(default_factory=set)
    waiting: dict[str, tuple[int, asyncio.Future[None]]] = field(default_factory=dict)
    work: asyncio.Semaphore | None = None
    timer: asyncio.TimerHandle | None = None


class Admission:
    """Running slots, pending queues and work-item slots per team.

    Args:
        quotas: the policy. usage: the teams' device time (None: device time is not limited).
    """

    def __init__(self, quotas: QuotaSettings, usage: TeamUsage | None = None) -> None:
        self.quotas = quotas
        self.usage = usage
        self._teams: dict[str, _Team] = {}

    def limits(self, team: str) -> TeamLimits:
        """``team``'s limits."""
        return self.quotas.limits(team)

    def _team(self, team: str) -> _Team:
        return self._teams.setdefault(team, _Team())

    # ------------------------------------------------------------------ counts
    def running(self, team: str) -> int:
        """Compilations of ``team`` admitted and not released."""
        return len(self._team(team).running)

    def pending(self, team: str) -> int:
        """Compilations of ``team`` waiting for admission."""
        return len(self._team(team).waiting)

    def why_pending(self, team: str) -> str:
        """What keeps ``team``'s next compilation waiting, in a sentence ("" when nothing)."""
        lim, t = self.limits(team), self._team(team)
        if lim.max_running and len(t.running) >= lim.max_running:
            return (
                f"team {team!r} runs {len(t.running)} compilations, its limit "
                f"(KILN_QUOTA_MAX_RUNNING) is {lim.max_running}"
            )
        return self.device_time_spent(team) or ""

    # ------------------------------------------------------------------ compilations
    def check_submit(self, team: str) -> None:
        """Raise ResourceExhausted when ``team`` has ``max_pending`` compilations waiting."""
        lim = self.limits(team)
        waiting = self.pending(team)
        if lim.max_pending and waiting >= lim.max_pending:
            raise ResourceExhausted(
                f"team {team!r} has {waiting} compilations waiting to run, its limit "
                f"(KILN_QUOTA_MAX_PENDING) is {lim.max_pending}: submit again once some have "
                f"started or cancel some"
            )

    def hold(self, team: str, compilation_id: str) -> None:
        """Count a compilation that is running already (resumed after a restart)."""
        t = self._team(team)
        t.waiting.pop(compilation_id, None)
        t.running.add(compilation_id)

    def enqueue(self, team: str, compilation_id: str, position: int) -> None:
        """Queue a pending compilation (``position``: of its submission) for :meth:`admit`."""
        t = self._team(team)
        if compilation_id in t.running or compilation_id in t.waiting:
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        t.waiting[compilation_id] = (position, future)
        self._grant(team)

    async def admit(self, team: str, compilation_id: str, position: int) -> None:
        """Wait until the compilation may run (queueing it first if need be); the caller
        :meth:`release`\\ s it when it ends, and also when this is cancelled."""
        self.enqueue(team, compilation_id, position)
        entry = self._team(team).waiting.get(compilation_id)
        if entry is not None:
            await asyncio.shield(entry[1])

    def release(self, team: str, compilation_id: str) -> None:
        """The compilation ended or stopped: free its slot, or take it out of the queue."""
        t = self._team(team)
        t.running.discard(compilation_id)
        entry = t.waiting.pop(compilation_id, None)
        if entry is not None and not entry[1].done():
            entry[1].cancel()
        self._grant(team)

    def _grant(self, team: str) -> None:
        """Admit ``team``'s oldest pending compilations while its limits allow."""
        t, lim = self._team(team), self.limits(team)
        if t.timer is not None:
            t.timer.cancel()
            t.timer = None
        while t.waiting:
            if lim.max_running and len(t.running) >= lim.max_running:
                return
            wait_s = self._device_wait_s(team, lim)
            if wait_s > 0:
                loop = asyncio.get_running_loop()
                t.timer = loop.call_later(wait_s, self._grant, team)
                return
            cid = min(t.waiting, key=lambda c: t.waiting[c][0])
            _, future = t.waiting.pop(cid)
            t.running.add(cid)
            if not future.done():
                future.set_result(None)
            log.info("compilation admitted", compilation=cid, team=team, running=len(t.running))

    def _device_wait_s(self, team: str, lim: TeamLimits) -> float:
        """0 when ``team`` has device time left, else seconds until it may have."""
        if not lim.device_seconds or self.usage is None:
            return 0.0
        if not self.usage.loaded.is_set():
            return NOT_LOADED_RETRY_S
        if self.usage.spent(team) < lim.device_seconds:
            return 0.0
        return max(NOT_LOADED_RETRY_S, self.usage.frees_in(team, lim.device_seconds))

    def device_time_spent(self, team: str) -> str | None:
        """Why ``team`` may not start more device work (its device time is spent), else None."""
        lim = self.limits(team)
        if not lim.device_seconds or self.usage is None:
            return None
        spent = self.usage.spent(team)
        if spent < lim.device_seconds:
            return None
        return (
            f"team {team!r} spent its device time ({spent:.1f} of {lim.device_seconds:g} device-s "
            f"in the last {self.usage.period_s:g} s, KILN_QUOTA_DEVICE_SECONDS)"
        )

    # ------------------------------------------------------------------ work items
    @contextlib.asynccontextmanager
    async def work_slot(self, team: str) -> AsyncIterator[None]:
        """Hold one of ``team``'s ``max_in_flight_team`` work-item slots (FIFO)."""
        lim, t = self.limits(team), self._team(team)
        if not lim.max_in_flight_team:
            yield
            return
        if t.work is None:
            t.work = asyncio.Semaphore(lim.max_in_flight_team)
        async with t.work:
            yield
