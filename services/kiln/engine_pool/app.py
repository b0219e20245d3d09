"""The engine pool service process: persistent engines behind gRPC and the NATS work queue.

``RunExperiment`` works as soon as the service starts (engines are built on first use), so the
service is ready without NATS; the work-queue consumer and the registry heartbeat connect in the
background and keep retrying while NATS is down or not configured. Engine settings come from
``KILN_ENGINE_*`` (:class:`~kiln.engine_pool.settings.EngineSettings`); devices from
``KILN_ENGINE_DEVICES`` (:mod:`kiln.engine_pool.devices`).

Several pools — on one host or many — share the work by pointing at the same NATS and ledger:
each registers itself (:mod:`kiln.engine_pool.registry`) and binds the same durable consumers
(:mod:`kiln.engine_pool.queue`); nothing else is configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
from typing import TYPE_CHECKING

import grpc
import structlog

from kiln.common.settings import KilnSettings
from kiln.engine_pool.microbench_service import MicrobenchResponder
from kiln.engine_pool.pool import EnginePool
from kiln.engine_pool.queue import WorkConsumer
from kiln.engine_pool.registry import DeviceRecord, PoolRecord, Registry, now
from kiln.engine_pool.service import EnginePoolServicer
from kiln.engine_pool.settings import EngineSettings
from kiln.v1 import engine_pool_pb2_grpc

if TYPE_CHECKING:
    from kiln.runtime.engine import ExternalMeasure

log = structlog.get_logger("kiln.engine_pool")


class EnginePoolApp:
    """``ServiceApp`` of the engine pool (see ``kiln.common.server``).

    Args:
        settings: kiln settings (NATS, subject prefix, ledger address).
        engine_settings: engine settings; default: read from ``KILN_ENGINE_*``.
        external_measure: what the engines measure baseline requests with (injected by the
            composition root, ``kiln serve engine-pool``); None: a baseline request is
            FAILED_PRECONDITION.
        pool: the engines (default: an :class:`EnginePool` of ``engine_settings`` and
            ``external_measure``), e.g. one whose engines are simulated in tests.

    Raises:
        kiln.engine_pool.devices.DeviceError: bad ``KILN_ENGINE_DEVICES``.
    """

    name = "engine-pool"
    grpc_service_names = ("kiln.v1.EnginePool",)

    def __init__(
        self,
        settings: KilnSettings,
        engine_settings: EngineSettings | None = None,
        *,
        external_measure: ExternalMeasure | None = None,
        pool: EnginePool | None = None,
    ) -> None:
        self.settings = settings
        self.pool = pool or EnginePool(
            engine_settings or EngineSettings(), external_measure=external_measure
        )
        self.engine_settings = self.pool.settings
        self.consumer = WorkConsumer(settings, self.engine_settings, self.pool)
        self.registry = Registry(settings, self.engine_settings, self.record)
        self.pool.on_change = self.registry.poke
        self.servicer = EnginePoolServicer(self.pool, self.engine_settings, self.registry)
        self.microbench = MicrobenchResponder(settings, self.pool)
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._preload: asyncio.Task[object] | None = None

    def record(self, ttl_s: float) -> PoolRecord:
        """This pool's registry record, now (``ttl_s``: the registry's TTL)."""
        pool = self.pool
        return PoolRecord(
            pool_id=pool.pool_id,
            host=pool.host,
            pid=os.getpid(),
            started_at=pool.started_at,
            heartbeat_at=now(),
            ttl_s=ttl_s,
            devices=[
                DeviceRecord(
                    device=slot.device.name,
                    kind=slot.device.kind,
                    label=slot.device.label,
                    busy=slot.busy,
                    experiments_done=slot.experiments_done,
                )
                for slot in pool.slots.values()
            ],
            engines=pool.engines(),
            hardware=self.consumer.hardware if self.engine_settings.consume else [],
            models=self.consumer.models,
            subjects=self.consumer.subjects,
            experiments_done=pool.experiments_done,
            local=True,
        )

    async def start(self, server: grpc.aio.Server) -> None:
        """Register the servicer, start the registry heartbeat and the work-queue consumer
        (unless ``KILN_ENGINE_CONSUME=false``)."""
        engine_pool_pb2_grpc.add_EnginePoolServicer_to_server(self.servicer, server)
        # Validating a workload imports torch (kiln.workloads.models.build): do it now, off the
        # event loop, rather than inside the first experiment's request.
        self._preload = asyncio.create_task(
            asyncio.to_thread(importlib.import_module, "kiln.workloads.models.build")
        )
        log.info(
            "engine_pool.devices",
            pool_id=self.pool.pool_id,
            devices=[f"{d.name} ({d.kind}, {d.label})" for d in self.pool.devices],
        )
        self._tasks.append(asyncio.create_task(self.registry.run(self._stop), name="kiln-reg"))
        self._tasks.append(asyncio.create_task(self.microbench.run(self._stop), name="kiln-mb"))
        if self.engine_settings.consume:
            self._tasks.append(asyncio.create_task(self.consumer.run(self._stop), name="kiln-work"))

    async def is_ready(self) -> bool:
        """Always True: RunExperiment needs nothing but this host."""
        return True

    async def draining(self) -> None:
        """Stop taking work from the queue (a message in progress is left unacked and comes
        back to another engine pool) and leave the registry."""
        self._stop.set()

    async def stop(self) -> None:
        """Stop the consumer and the registry, close the ledger clients and stop every engine
        process."""
        self._stop.set()
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=3.0)
            for task in pending:
                task.cancel()
            for task in self._tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        await self.consumer.close()
        await self.pool.close()
        if self._preload is not None:
            with contextlib.suppress(Exception):
                await self._preload


def create_app(settings: KilnSettings) -> EnginePoolApp:
    """The engine pool alone, measuring no baselines (``kiln serve engine-pool`` injects
    them: :func:`kiln.cli.serve.service_app`)."""
    return EnginePoolApp(settings)
