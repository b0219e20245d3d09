"""Database engine for the ledger (SQLAlchemy 2 async over psycopg 3)."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from kiln.ledger.migrate import sync_url

CONNECT_TIMEOUT_S = 5
"""libpq's ``connect_timeout`` of the ledger's connections, seconds."""


def create_engine(database_url: str, *, pool_size: int = 10) -> AsyncEngine:
    """An async engine on ``database_url`` (any postgresql URL form; psycopg 3 is used).

    ``pool_pre_ping`` makes a restarted PostgreSQL cost one failed checkout, not a failed call;
    ``connect_timeout`` (seconds) bounds a connection attempt to a server that does not answer.
    """
    return create_async_engine(
        sync_url(database_url),
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_pre_ping=True,
        connect_args={"connect_timeout": CONNECT_TIMEOUT_S},
    )


def libpq_dsn(database_url: str) -> str:
    """The URL as a libpq connection string for raw psycopg connections (LISTEN/NOTIFY)."""
    return sync_url(database_url).replace("postgresql+psycopg://", "postgresql://", 1)
