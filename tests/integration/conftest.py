"""Fixtures for tests against the real PostgreSQL: an async engine and the event store."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from sqlalchemy.ext.asyncio import AsyncEngine

from kiln.ledger.db import create_engine
from kiln.ledger.store import EventStore

pytestmark = pytest.mark.integration


@pytest_asyncio.fixture(scope="session")
async def engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    eng = create_engine(database_url, pool_size=12)
    try:
        yield eng
    finally:
        await eng.dispose()


@pytest_asyncio.fixture(scope="session")
async def store(engine: AsyncEngine) -> AsyncIterator[EventStore]:
    s = EventStore(engine, max_event_bytes=64 * 1024)
    yield s
    await s.close()
