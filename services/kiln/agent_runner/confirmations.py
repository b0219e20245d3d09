"""Confirmation scheduling: the fast-tier leader measured on the full tier, next to the
reference.

When a search-tier result makes a confirmation due
(:func:`~kiln.agent_runner.judge.confirmation_due`), its experiment slots are held at once
(before the agents take them) and the confirmation task (agent ``confirm``, one per compilation)
closes the *gate* (agents wait there before requesting), waits for the search-tier experiments
past the gate, and measures the reference (unless the last full-tier request is one) and then
the freshest leader on the full tier, back to back. A pair that does not fit in the experiment
budget leaves its slots to the agents. Everything it decides is recomputed from the
compilation's experiments, so after a restart it finishes the full-tier experiments in flight
first and then starts the confirmations that are due.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable, Iterator

from kiln.agent_runner.experiment import Requested
from kiln.agent_runner.judge import CONFIRM_TIER, confirmation_due, needs_reference
from kiln.agent_runner.state import CompilationState
from kiln.common.logging import get_logger
from kiln.domain.candidate import REFERENCE_CANDIDATE, Candidate

log = get_logger(__name__)


class Confirmations:
    """The gate, the search-tier experiments past it and the confirmation task.

    Args:
        state: the compilation (what is due is read from its experiments).
        reserve: take an experiment slot (False: none left, or the compilation stops).
        release: give back a slot.
        measure: request a candidate on the full tier for a taken slot, wait for it and judge it
            (the slot is given back when nothing was requested).
        finish: wait for a full-tier experiment requested before a restart and judge it.
    """

    def __init__(
        self,
        state: CompilationState,
        *,
        reserve: Callable[[], bool],
        release: Callable[[], None],
        measure: Callable[[Candidate], Awaitable[object]],
        finish: Callable[[Requested], Awaitable[object]],
    ) -> None:
        self.state = state
        self._reserve, self._release = reserve, release
        self._measure, self._finish = measure, finish
        self.gate = asyncio.Event()
        """Open (set) unless a confirmation is running: agents wait here before requesting."""
        self.gate.set()
        self._searching = 0
        """Search-tier experiments past the gate and not completed."""
        self._search_idle = asyncio.Event()
        self._search_idle.set()
        self._slots = 0
        """Experiment slots held for the confirmation due."""
        self._wanted = asyncio.Event()
        self._agents_done = False

    @contextlib.contextmanager
    def searching(self) -> Iterator[None]:
        """Count a search-tier experiment under way (a confirmation waits for none)."""
        self._searching += 1
        self._search_idle.clear()
        try:
            yield
        finally:
            self._searching -= 1
            if self._searching == 0:
                self._search_idle.set()

    def search_result(self) -> None:
        """After a search-tier result: if a confirmation is due, hold its slots now and wake
        the confirmation task."""
        if confirmation_due(self.state) is not None:
            self._hold_slots()
            self._wanted.set()

    @property
    def pending(self) -> bool:
        """A confirmation is under way (the gate is closed) or due with its slots held."""
        return not self.gate.is_set() or self._slots > 0

    def agents_done(self) -> None:
        """The agents stopped: the task ends once nothing is due."""
        self._agents_done = True
        self._wanted.set()

    async def run(self, in_flight: Iterable[Requested]) -> None:
        """Confirm until the agents are done and nothing is due, first finishing the full-tier
        experiments of ``in_flight`` (a confirmation cut by a restart); a failure is logged and
        the agents go on without confirmations. The gate is open and no slot held on return."""
        try:
            await self._confirm_until_done(in_flight)
        except Exception as exc:
            log.error("confirmations stopped", compilation=self.state.compilation_id, exc_info=exc)
        finally:
            self.gate.set()
            self._release_slots()

    async def _confirm_until_done(self, in_flight: Iterable[Requested]) -> None:
        adopted = sorted((r for r in in_flight if r.tier == CONFIRM_TIER), key=lambda r: r.position)
        if adopted:
            self.gate.clear()
            for req in adopted:
                await self._finish(req)
        while True:
            self._wanted.clear()
            if confirmation_due(self.state) is None:
                if self._agents_done:
                    return
                self._release_slots()  # agents waiting for a slot may take them
                self.gate.set()
                await self._wanted.wait()
                continue
            self.gate.clear()
            await self._search_idle.wait()
            if not await self._confirm_pair():
                self.gate.set()
                if self._agents_done:
                    return  # no slot left for it
                await self._wanted.wait()

    async def _confirm_pair(self) -> bool:
        """The reference (unless the last full-tier request is one), then the fast leader, on
        the full tier; False when the experiment budget has no room for them."""
        if not self._hold_slots():
            return False
        if needs_reference(self.state):
            self._slots -= 1
            await self._measure(REFERENCE_CANDIDATE)
        target = confirmation_due(self.state)  # the freshest leader
        if target is None:
            return True
        self._slots -= 1
        await self._measure(target)
        return True

    def _hold_slots(self) -> bool:
        """Hold the slots the due confirmation needs, all or none."""
        need = 1 + int(needs_reference(self.state))
        while self._slots < need and self._reserve():
            self._slots += 1
        if self._slots >= need:
            return True
        self._release_slots()
        return False

    def _release_slots(self) -> None:
        while self._slots:
            self._slots -= 1
            self._release()
