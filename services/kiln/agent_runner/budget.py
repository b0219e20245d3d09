"""Compilation budgets: checking a submitted ``kiln.v1.Budget`` and spending one.

A compilation stops at ``wall_seconds`` after the ledger recorded its submission (a restarted
runner keeps the deadline) or at ``max_experiments`` completed experiments, baseline and
confirmations included (0 = no limit). Slots are reserved before a request, so completed plus
in flight never exceeds the limit.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from datetime import datetime

from kiln.common.errors import InvalidArgument
from kiln.events.types import MAX_EXPERIMENTS, MAX_WALL_SECONDS
from kiln.v1 import common_pb2


def validate_budget(budget: common_pb2.Budget | None) -> common_pb2.Budget:
    """``budget`` when usable; InvalidArgument when missing, ``wall_seconds`` is not a finite
    number in (0, 30 days] or ``max_experiments`` is above 1,000,000.
    """
    if budget is None:
        raise InvalidArgument("budget is missing: set budget.wall_seconds > 0")
    wall = budget.wall_seconds
    if not math.isfinite(wall) or wall <= 0:
        raise InvalidArgument(f"budget.wall_seconds must be a number > 0, got {wall}")
    if wall > MAX_WALL_SECONDS:
        raise InvalidArgument(
            f"budget.wall_seconds {wall:g} is over the limit of {MAX_WALL_SECONDS:g} s (30 days)"
        )
    if budget.max_experiments > MAX_EXPERIMENTS:
        raise InvalidArgument(
            f"budget.max_experiments {budget.max_experiments} is over the limit of "
            f"{MAX_EXPERIMENTS}"
        )
    return budget


@dataclass
class ExperimentBudget:
    """Experiment slots of one compilation: ``limit`` (0 = none), ``completed`` (any status) and
    ``in_flight`` (reserved or requested, not completed).
    """

    limit: int
    completed: int = 0
    in_flight: int = 0
    _changed: asyncio.Event = field(default_factory=asyncio.Event, repr=False, compare=False)

    def reserve(self) -> bool:
        """Take a slot for one more experiment; False when the limit is reached."""
        if self.limit and self.completed + self.in_flight >= self.limit:
            return False
        self.in_flight += 1
        return True

    async def acquire(self, gate: asyncio.Event | None = None) -> bool:
        """Take a slot, waiting while the limit is reached only by reservations that may be given
        back and, with ``gate``, while the gate is closed; False once completions reach the
        limit.
        """
        while True:
            if gate is not None and not gate.is_set():
                await gate.wait()
                continue  # it may have closed again before this task ran
            if self.reserve():
                return True
            if self.spent:
                return False
            await self.changed()

    async def changed(self) -> None:
        """Wait for the next release or completion."""
        self._changed.clear()
        await self._changed.wait()

    def release(self) -> None:
        """Give back a reserved slot that was not used (e.g. the claim was lost)."""
        self.in_flight = max(0, self.in_flight - 1)
        self._changed.set()

    def complete(self) -> None:
        """A reserved experiment completed."""
        self.in_flight = max(0, self.in_flight - 1)
        self.completed += 1
        self._changed.set()

    @property
    def spent(self) -> bool:
        """True when the completed experiments reached the limit."""
        return bool(self.limit) and self.completed >= self.limit

    def end_reason(self) -> str:
        """Why a search that stopped by itself ended: budget spent, or nothing left to propose."""
        if self.spent:
            return f"the experiment budget is spent ({self.completed} of {self.limit} experiments)"
        return f"the agents have nothing left to propose ({self.completed} experiments)"


@dataclass(frozen=True)
class WallClock:
    """The wall-clock budget, anchored at the ledger's ``recorded_at`` of the submission."""

    started_at: datetime
    wall_seconds: float

    def remaining_s(self, now: datetime) -> float:
        """Seconds left at ``now`` (negative when spent)."""
        return self.wall_seconds - (now - self.started_at).total_seconds()

    def end_reason(self) -> str:
        """Why a search that ran out of time ended."""
        return f"the wall-clock budget of {self.wall_seconds:g} s is spent"
