"""Fixtures for tests against the real PostgreSQL and NATS: an async engine, the event store,
a NATS connection and a private subject prefix with its streams."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from nats.aio.client import Client
from sqlalchemy.ext.asyncio import AsyncEngine

from kiln.common import nats as kn
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


@pytest_asyncio.fixture
async def nc(nats_url: str) -> AsyncIterator[Client]:
    """A NATS connection for one test."""
    client = await kn.connect(nats_url, "kiln-test")
    try:
        yield client
    finally:
        await client.close()


@pytest_asyncio.fixture
async def prefix(nc: Client, subject_prefix: str) -> AsyncIterator[str]:
    """A subject prefix private to this test, with its streams; deleted afterwards."""
    p = f"{subject_prefix}_{uuid.uuid4().hex[:6]}"
    await kn.ensure_streams(nc.jetstream(), p)
    try:
        yield p
    finally:
        await kn.delete_streams(nc.jetstream(), p)
