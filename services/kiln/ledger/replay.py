"""Replay: rebuild every projection from the events and compare it with the live tables.

Verify mode reads the checkpoint, the live rows and the events up to the checkpoint in one
REPEATABLE READ snapshot (the projector writes rows and checkpoint in one transaction, so the
snapshot is consistent) and does not block the projector. Apply mode takes the projector lock,
rebuilds, and replaces any live table that differs, in one transaction.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import delete, func, insert, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from kiln.ledger.projections import all_projections
from kiln.ledger.projections.base import FOLD_ERRORS, Projection, Rows
from kiln.ledger.projections.checkpoint import lock_projector, read_checkpoint
from kiln.ledger.projections.rows import load_rows
from kiln.ledger.store import row_to_event
from kiln.ledger.tables import events, projection_failures

MAX_DIFFERENCES = 5


@dataclass
class ProjectionDiff:
    """Live vs rebuilt for one projection; ``differences`` holds a sample of differing rows."""

    name: str
    rows_live: int
    rows_rebuilt: int
    equal: bool
    differences: list[str] = field(default_factory=list)
    applied: bool = False


@dataclass
class ReplayReport:
    """What a replay found: the checkpoint it rebuilt to, events folded, per-projection diffs,
    the head position (a checkpoint below it means the projector is behind) and how many events
    the projector quarantined."""

    checkpoint_position: int
    events_replayed: int
    projections: list[ProjectionDiff]
    duration_s: float
    head_position: int = 0
    quarantined_events: int = 0

    @property
    def equal(self) -> bool:
        """True when every projection's rebuild equals its live table."""
        return all(p.equal for p in self.projections)


def _diff(name: str, live: Rows, rebuilt: Rows) -> ProjectionDiff:
    differences: list[str] = []
    for key in sorted(set(live) | set(rebuilt), key=str):
        a, b = live.get(key), rebuilt.get(key)
        if a != b:
            differences.append(f"{key}: live={_short(a)} rebuilt={_short(b)}")
            if len(differences) >= MAX_DIFFERENCES:
                break
    return ProjectionDiff(name, len(live), len(rebuilt), not differences, differences)


def _short(row: dict[str, Any] | None) -> str:
    return "None" if row is None else "{" + ", ".join(f"{k}={v!s}" for k, v in row.items()) + "}"


async def _rebuild(
    conn: AsyncConnection, projections: Sequence[Projection], upto: int
) -> tuple[dict[str, Rows], int]:
    rebuilt: dict[str, Rows] = {p.name: {} for p in projections}
    count = 0
    result = await conn.stream(
        select(events).where(events.c.position <= upto).order_by(events.c.position),
    )
    async for partition in result.partitions(2000):
        for row in partition:
            event = row_to_event(row)
            count += 1
            for proj in projections:
                if event.type in proj.handles:
                    try:
                        proj.apply(rebuilt[proj.name], event)
                    except FOLD_ERRORS:
                        pass  # the live projector quarantined it too
    return rebuilt, count


async def replay(
    engine: AsyncEngine, *, apply: bool = False, names: Sequence[str] = ()
) -> ReplayReport:
    """Rebuild projections (all, or those in ``names``) and compare with the live tables.

    Args:
        apply: replace a live table that differs with its rebuild (takes the projector lock).
        names: projection names ("compilations", "experiments", "best_candidates").

    Raises:
        ValueError: an unknown projection name.
    """
    started = time.perf_counter()
    projections = all_projections()
    if names:
        unknown = set(names) - {p.name for p in projections}
        if unknown:
            raise ValueError(f"unknown projection(s): {', '.join(sorted(unknown))}")
        projections = [p for p in projections if p.name in names]
    async with engine.connect() as conn:
        if apply:
            await conn.begin()
            await lock_projector(conn)
        else:
            await conn.execution_options(
                isolation_level="REPEATABLE READ", postgresql_readonly=True
            )
            await conn.begin()
        checkpoint = await read_checkpoint(conn)
        head = int(await conn.scalar(select(func.coalesce(func.max(events.c.position), 0))) or 0)
        quarantined = int(
            await conn.scalar(select(func.count()).select_from(projection_failures)) or 0
        )
        rebuilt, count = await _rebuild(conn, projections, checkpoint)
        diffs = []
        for proj in projections:
            live = await load_rows(conn, proj.table, proj.key, None)
            diff = _diff(proj.name, live, rebuilt[proj.name])
            if apply and not diff.equal:
                await conn.execute(delete(proj.table))
                if rebuilt[proj.name]:
                    await conn.execute(insert(proj.table), list(rebuilt[proj.name].values()))
                diff.applied = True
            diffs.append(diff)
        await conn.commit()
    return ReplayReport(checkpoint, count, diffs, time.perf_counter() - started, head, quarantined)
