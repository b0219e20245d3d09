"""The projections' checkpoint row: the last global position folded into the live tables."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from kiln.ledger.tables import projection_checkpoints

CHECKPOINT_NAME = "projections"
PROJECTOR_LOCK_KEY = 0x6B696C6E02
"""pg_advisory_xact_lock key: one projector batch (or replay --apply) at a time per database."""


async def lock_projector(conn: AsyncConnection) -> None:
    """Serialise with every other projector batch until this transaction ends."""
    await conn.execute(select(func.pg_advisory_xact_lock(PROJECTOR_LOCK_KEY)))


async def read_checkpoint(conn: AsyncConnection) -> int:
    """The checkpoint position (0 before the first batch)."""
    value = await conn.scalar(
        select(projection_checkpoints.c.position).where(
            projection_checkpoints.c.name == CHECKPOINT_NAME
        )
    )
    return int(value or 0)


async def write_checkpoint(conn: AsyncConnection, position: int) -> None:
    """Set the checkpoint; call inside the transaction that wrote the projection rows."""
    stmt = insert(projection_checkpoints).values(name=CHECKPOINT_NAME, position=position)
    await conn.execute(
        stmt.on_conflict_do_update(
            index_elements=["name"], set_={"position": position, "updated_at": func.now()}
        )
    )
