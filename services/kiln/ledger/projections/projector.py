"""The live projector: folds new events into the projection tables, batch by batch.

Each batch is one transaction: lock (so replicas of the ledger take turns), read the checkpoint,
read the next events after it, fold them, upsert the touched rows, write the new checkpoint,
commit. A crash anywhere rolls the whole batch back, so every event is applied exactly once.

A *poison* event — one the fold or the projection tables reject (a data error, not a lost
connection) — must not stop the projections for good. When a batch fails with such an error the
projector retries event by event; the event that fails alone is recorded in
``projection_failures`` (quarantined), skipped, counted in ``kiln_projector_failures_total`` and
logged, and the checkpoint moves past it. Replay then reports the live tables as different from
the rebuild, which is the truth.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import structlog
from prometheus_client import Counter, Gauge
from sqlalchemy import func, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.exc import DataError, IntegrityError, ProgrammingError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from kiln.ledger.model import StoredEvent
from kiln.ledger.notifier import CommitNotifier
from kiln.ledger.projections import all_projections
from kiln.ledger.projections.base import FOLD_ERRORS, Projection
from kiln.ledger.projections.checkpoint import lock_projector, read_checkpoint, write_checkpoint
from kiln.ledger.projections.rows import load_rows, upsert_rows
from kiln.ledger.store import row_to_event
from kiln.ledger.tables import events, projection_failures

log = structlog.get_logger("kiln.ledger.projector")

EVENTS_PROJECTED = Counter("kiln_projector_events_total", "Events folded into the projections")
FAILURES = Counter("kiln_projector_failures_total", "Events quarantined by the projector")
CHECKPOINT = Gauge("kiln_projector_checkpoint_position", "Last global position projected")
LAG = Gauge(
    "kiln_projector_lag_events", "Committed positions not yet projected (head - checkpoint)"
)

POISON_ERRORS: tuple[type[BaseException], ...] = (
    *FOLD_ERRORS,
    DataError,
    IntegrityError,
    ProgrammingError,
)
"""Errors that mean "this event cannot be projected" (as opposed to a lost connection)."""


class Projector:
    """Keeps the live projection tables up to date with the event store.

    Args:
        engine: async engine on the ledger database.
        projections: defaults to ``all_projections()``.
        batch_size: events per transaction.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        projections: Sequence[Projection] | None = None,
        batch_size: int = 500,
    ) -> None:
        self.engine = engine
        self.projections = list(projections) if projections is not None else all_projections()
        self.batch_size = batch_size

    async def _fold(self, conn: AsyncConnection, batch: list[StoredEvent]) -> None:
        for proj in self.projections:
            relevant = [e for e in batch if e.type in proj.handles]
            keys = {k for e in relevant if (k := proj.key_of(e)) is not None}
            rows = await load_rows(conn, proj.table, proj.key, keys)
            for event in relevant:
                proj.apply(rows, event)
            await upsert_rows(conn, proj.table, proj.key, [rows[k] for k in keys if k in rows])

    async def run_once(self, batch_size: int | None = None) -> int:
        """Project one batch; returns how many events it consumed (0 = caught up).

        A batch failing with a poison error is retried one event at a time, quarantining the
        event that fails alone. Other errors (connection lost) propagate; nothing was written.
        """
        size = batch_size or self.batch_size
        try:
            async with self.engine.begin() as conn:
                await lock_projector(conn)
                checkpoint = await read_checkpoint(conn)
                result = await conn.execute(
                    select(events)
                    .where(events.c.position > checkpoint)
                    .order_by(events.c.position)
                    .limit(size)
                )
                batch = [row_to_event(r) for r in result]
                if not batch:
                    LAG.set(0)
                    return 0
                if size == 1:
                    await self._fold_or_quarantine(conn, batch[0])
                else:
                    await self._fold(conn, batch)
                await write_checkpoint(conn, batch[-1].position)
        except POISON_ERRORS as exc:
            if size == 1:
                raise
            log.warning("projector batch failed; isolating the event", error=str(exc)[:500])
            return await self.run_once(batch_size=1)
        EVENTS_PROJECTED.inc(len(batch))
        CHECKPOINT.set(batch[-1].position)
        return len(batch)

    async def _fold_or_quarantine(self, conn: AsyncConnection, event: StoredEvent) -> None:
        try:
            async with conn.begin_nested():
                await self._fold(conn, [event])
        except POISON_ERRORS as exc:
            error = f"{type(exc).__name__}: {exc}"[:2000]
            await conn.execute(
                insert(projection_failures)
                .values(
                    position=event.position, event_id=event.event_id, type=event.type, error=error
                )
                .on_conflict_do_nothing()
            )
            FAILURES.inc()
            log.error(
                "event quarantined: the projections skip it",
                position=event.position,
                event_id=event.event_id,
                type=event.type,
                error=error[:500],
            )

    async def catch_up(self) -> int:
        """Project until no events are left; returns the number consumed."""
        total = 0
        while n := await self.run_once():
            total += n
        return total

    async def report_lag(self) -> int:
        """Set the checkpoint and lag gauges from the database; returns the lag in positions."""
        async with self.engine.connect() as conn:
            checkpoint = await read_checkpoint(conn)
            head = int(
                await conn.scalar(select(func.coalesce(func.max(events.c.position), 0))) or 0
            )
        CHECKPOINT.set(checkpoint)
        LAG.set(max(head - checkpoint, 0))
        return max(head - checkpoint, 0)

    async def run(
        self,
        stop: asyncio.Event,
        notifier: CommitNotifier,
        poll_interval_s: float = 1.0,
        coalesce_s: float = 0.05,
    ) -> None:
        """Catch up after commit notifications, or every ``poll_interval_s`` seconds; errors
        are logged and retried after a pause (the batch rolled back, nothing is lost).

        After a wake-up it waits ``coalesce_s`` so a burst of commits is folded in a few large
        batches rather than one transaction per commit (projections lag by about that much)."""
        while not stop.is_set():
            try:
                await self.report_lag()
                await self.catch_up()
            except Exception:
                log.exception("projector batch failed; retrying")
                await asyncio.sleep(1.0)
                continue
            await notifier.wait(poll_interval_s)
            await asyncio.sleep(coalesce_s)
