"""The engine pool service process: persistent engines behind gRPC and the NATS work queue.

``RunExperiment`` works as soon as the service starts (engines are built on first use), so the
service is ready without NATS; the work-queue consumer connects in the background and keeps
retrying while NATS is down or not configured. Engine settings come from ``KILN_ENGINE_*``
(:class:`~kiln.engine_pool.settings.EngineSettings`).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib

import grpc
import structlog

from kiln.common.settings import KilnSettings
from kiln.engine_pool.pool import EnginePool
from kiln.engine_pool.queue import WorkConsumer
from kiln.engine_pool.service import EnginePoolServicer
from kiln.engine_pool.settings import EngineSettings
from kiln.v1 import engine_pool_pb2_grpc

log = structlog.get_logger("kiln.engine_pool")


class EnginePoolApp:
    """``ServiceApp`` of the engine pool (see ``kiln.common.server``).

    Args:
        settings: kiln settings (NATS, subject prefix, ledger address).
        engine_settings: engine settings; default: read from ``KILN_ENGINE_*``.
    """

    name = "engine-pool"
    grpc_service_names = ("kiln.v1.EnginePool",)

    def __init__(
        self, settings: KilnSettings, engine_settings: EngineSettings | None = None
    ) -> None:
        self.settings = settings
        self.engine_settings = engine_settings or EngineSettings()
        self.pool = EnginePool(self.engine_settings)
        self.servicer = EnginePoolServicer(self.pool, self.engine_settings)
        self.consumer = WorkConsumer(settings, self.engine_settings, self.pool)
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._preload: asyncio.Task[object] | None = None

    async def start(self, server: grpc.aio.Server) -> None:
        """Register the servicer and start the work-queue consumer (unless
        ``KILN_ENGINE_CONSUME=false``)."""
        engine_pool_pb2_grpc.add_EnginePoolServicer_to_server(self.servicer, server)
        # Validating a workload imports torch (kiln.workloads.models.build): do it now, off the
        # event loop, rather than inside the first experiment's request.
        self._preload = asyncio.create_task(
            asyncio.to_thread(importlib.import_module, "kiln.workloads.models.build")
        )
        if self.engine_settings.consume:
            self._task = asyncio.create_task(self.consumer.run(self._stop), name="kiln-work")

    async def is_ready(self) -> bool:
        """Always True: RunExperiment needs nothing but this host."""
        return True

    async def draining(self) -> None:
        """Stop taking work from the queue (a message in progress is left unacked and comes
        back to another engine pool)."""
        self._stop.set()

    async def stop(self) -> None:
        """Stop the consumer, close the ledger clients and stop every engine process."""
        self._stop.set()
        if self._task is not None:
            _, pending = await asyncio.wait({self._task}, timeout=2.0)
            for task in pending:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        await self.consumer.close()
        await self.pool.close()
        if self._preload is not None:
            with contextlib.suppress(Exception):
                await self._preload


def create_app(settings: KilnSettings) -> EnginePoolApp:
    """The engine pool for ``kiln serve engine-pool``."""
    return EnginePoolApp(settings)
