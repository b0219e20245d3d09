"""Loading and upserting projection rows (shared by the projector and replay)."""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import Table, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from kiln.ledger.projections.base import Row, Rows


async def load_rows(
    conn: AsyncConnection, table: Table, key: str, keys: Iterable[str] | None
) -> Rows:
    """Rows of ``table`` by key; ``keys`` None loads the whole table."""
    query = select(table)
    if keys is not None:
        wanted = list(keys)
        if not wanted:
            return {}
        query = query.where(table.c[key].in_(wanted))
    return {r._mapping[key]: dict(r._mapping) for r in await conn.execute(query)}


async def upsert_rows(conn: AsyncConnection, table: Table, key: str, rows: list[Row]) -> None:
    """INSERT ... ON CONFLICT (key) DO UPDATE every column."""
    if not rows:
        return
    stmt = insert(table).values(rows)
    stmt = stmt.on_conflict_do_update(
        index_elements=[key],
        set_={c.name: stmt.excluded[c.name] for c in table.columns if c.name != key},
    )
    await conn.execute(stmt)
