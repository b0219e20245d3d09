"""Fixtures for tests against the real PostgreSQL and NATS: an async engine, the event store,
a NATS connection and a private subject prefix with its streams, a ledger service per module."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from nats.aio.client import Client
from sqlalchemy.ext.asyncio import AsyncEngine

from kiln.common import nats as kn
from kiln.common.settings import KilnSettings
from kiln.ledger.app import LedgerApp
from kiln.ledger.db import create_engine
from kiln.ledger.store import EventStore

from .serving import serve_in_task

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


@pytest_asyncio.fixture(scope="module")
async def ledger_addr(settings: KilnSettings) -> AsyncIterator[str]:
    """A ledger service (gRPC) in this event loop for the module's tests; its address."""
    cfg = settings.model_copy(update={"metrics_port": 0, "grace_period_s": 1.0})
    task, addr = await serve_in_task(LedgerApp(cfg), cfg)
    yield addr
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
