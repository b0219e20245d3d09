"""The ledger service process: gRPC servicer, projector, commit listener and outbox publisher.

Appends depend on PostgreSQL only. NATS may be down: committed events wait in the outbox and the
publisher (re)connects in the background, so readiness means "PostgreSQL answers".
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any

import grpc
import structlog
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from kiln.common.settings import KilnSettings
from kiln.ledger.db import create_engine, libpq_dsn
from kiln.ledger.notifier import CommitNotifier
from kiln.ledger.projections.projector import Projector
from kiln.ledger.service import LedgerServicer
from kiln.ledger.store import EventStore
from kiln.v1 import ledger_pb2_grpc

log = structlog.get_logger("kiln.ledger")


class LedgerApp:
    """``ServiceApp`` of the ledger (see ``kiln.common.server``)."""

    name = "ledger"
    grpc_service_names = ("kiln.v1.Ledger",)

    def __init__(self, settings: KilnSettings) -> None:
        self.settings = settings
        self.database_url = settings.require_database_url()
        self.engine: AsyncEngine | None = None
        self.store: EventStore | None = None
        self.servicer: LedgerServicer | None = None
        self.notifier = CommitNotifier()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self, server: grpc.aio.Server) -> None:
        """Connect to PostgreSQL (the schema must be migrated), start the background loops and
        register the servicer. Raises RuntimeError when the schema is missing."""
        self.engine = create_engine(self.database_url)
        async with self.engine.connect() as conn:
            if await conn.scalar(text("SELECT to_regclass('public.events')")) is None:
                raise RuntimeError("the ledger database is not migrated: run `kiln migrate` first")
        self.store = store = EventStore(self.engine, max_event_bytes=self.settings.max_event_bytes)
        projector = Projector(self.engine)
        self._spawn(self.notifier.run(libpq_dsn(self.database_url), self._stop))
        self._spawn(projector.run(self._stop, self.notifier, self.settings.poll_interval_s * 5))
        self._spawn(self._publish_outbox())
        self.servicer = LedgerServicer(store, self.engine, self.notifier, self.settings)
        ledger_pb2_grpc.add_LedgerServicer_to_server(self.servicer, server)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        self._tasks.append(asyncio.create_task(coro))

    async def _publish_outbox(self) -> None:
        """Connect to NATS (retrying while it is down) and run the outbox publisher."""
        from kiln.common.nats import connect, ensure_streams, owned_streams
        from kiln.ledger.outbox import OutboxPublisher

        assert self.engine is not None
        prefix = self.settings.subject_prefix
        while not self._stop.is_set():
            nc = None
            try:
                credentials = self.settings.nats_credentials()
                url = self.settings.require_nats_url()
                nc = await connect(url, name="kiln-ledger-outbox", credentials=credentials)
                js = nc.jetstream()
                await ensure_streams(
                    js, prefix, owned_streams(self.name, open_server=credentials is None)
                )
                publisher = OutboxPublisher(
                    self.engine, js, prefix, poll_interval_s=self.settings.poll_interval_s
                )
                await publisher.run(self._stop)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("outbox publisher stopped; retrying", error=str(exc))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), timeout=2.0)
            finally:
                if nc is not None:
                    with contextlib.suppress(Exception):
                        await nc.close()

    async def is_ready(self) -> bool:
        """True when PostgreSQL answers within 2 s."""
        if self.engine is None:
            return False
        try:
            async with asyncio.timeout(2.0), self.engine.connect() as conn:
                await conn.execute(text("SELECT 1"))
            return True
        except Exception:
            return False

    async def draining(self) -> None:
        """End ReadAll followers' streams so the server drains without waiting them out."""
        if self.servicer is not None:
            self.servicer.closing.set()
            self.notifier.notify()

    async def stop(self) -> None:
        """Stop the loops (the outbox keeps anything unpublished) and close the pool."""
        self._stop.set()
        _, pending = await asyncio.wait(self._tasks, timeout=5.0) if self._tasks else ((), ())
        for task in pending:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.store is not None:
            await self.store.close()
        if self.engine is not None:
            await self.engine.dispose()


def create_app(settings: KilnSettings) -> LedgerApp:
    """The ledger service for ``kiln serve ledger``."""
    return LedgerApp(settings)
