"""The live projector: folds new events into the projection tables, batch by batch.

Each batch is one transaction: lock (so replicas of the ledger take turns), read the checkpoint,
read the next events after it, fold them, upsert the touched rows, write the new checkpoint,
commit. A crash anywhere rolls the whole batch back, so every event is applied exactly once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import structlog
from prometheus_client import Counter, Gauge
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from kiln.ledger.notifier import CommitNotifier
from kiln.ledger.projections import all_projections
from kiln.ledger.projections.base import Projection
from kiln.ledger.projections.checkpoint import lock_projector, read_checkpoint, write_checkpoint
from kiln.ledger.projections.rows import load_rows, upsert_rows
from kiln.ledger.store import _row_to_event
from kiln.ledger.tables import events

log = structlog.get_logger("kiln.ledger.projector")

EVENTS_PROJECTED = Counter("kiln_projector_events_total", "Events folded into the projections")
CHECKPOINT = Gauge("kiln_projector_checkpoint_position", "Last global position projected")


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

    async def run_once(self) -> int:
        """Project one batch; returns how many events it folded (0 = caught up)."""
        async with self.engine.begin() as conn:
            await lock_projector(conn)
            checkpoint = await read_checkpoint(conn)
            result = await conn.execute(
                select(events)
                .where(events.c.position > checkpoint)
                .order_by(events.c.position)
                .limit(self.batch_size)
            )
            batch = [_row_to_event(r) for r in result]
            if not batch:
                return 0
            for proj in self.projections:
                relevant = [e for e in batch if e.type in proj.handles]
                keys = {k for e in relevant if (k := proj.key_of(e)) is not None}
                rows = await load_rows(conn, proj.table, proj.key, keys)
                for event in relevant:
                    proj.apply(rows, event)
                await upsert_rows(conn, proj.table, proj.key, [rows[k] for k in keys if k in rows])
            await write_checkpoint(conn, batch[-1].position)
        EVENTS_PROJECTED.inc(len(batch))
        CHECKPOINT.set(batch[-1].position)
        return len(batch)

    async def catch_up(self) -> int:
        """Project until no events are left; returns the number folded."""
        total = 0
        while n := await self.run_once():
            total += n
        return total

    async def run(
        self, stop: asyncio.Event, notifier: CommitNotifier, poll_interval_s: float = 1.0
    ) -> None:
        """Catch up at every commit notification, or every ``poll_interval_s`` seconds; errors
        are logged and retried after a pause (the batch rolled back, nothing is lost)."""
        while not stop.is_set():
            try:
                await self.catch_up()
            except Exception:
                log.exception("projector batch failed; retrying")
                await asyncio.sleep(1.0)
                continue
            await notifier.wait(poll_interval_s)
