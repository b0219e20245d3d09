"""The engine pool service process (a placeholder until the engine pool is built).

Every RPC answers UNIMPLEMENTED with a message saying so; the process is otherwise a real
service (health, reflection, metrics), so ``kiln serve engine-pool`` and docker-compose work now.
"""

from __future__ import annotations

from typing import NoReturn

import grpc

from kiln.common.server import ServiceApp
from kiln.common.settings import KilnSettings
from kiln.v1 import common_pb2, engine_pool_pb2, engine_pool_pb2_grpc

_LATER = "the engine pool arrives with issue 3"


async def _unimplemented(context: grpc.aio.ServicerContext, rpc: str) -> NoReturn:
    await context.abort(
        grpc.StatusCode.UNIMPLEMENTED, f"EnginePool.{rpc} is not implemented yet: {_LATER}"
    )


class EnginePoolServicer(engine_pool_pb2_grpc.EnginePoolServicer):
    """``kiln.v1.EnginePool``: every RPC is UNIMPLEMENTED for now."""

    async def ListEngines(
        self, request: engine_pool_pb2.ListEnginesRequest, context: grpc.aio.ServicerContext
    ) -> engine_pool_pb2.ListEnginesResponse:
        """UNIMPLEMENTED."""
        await _unimplemented(context, "ListEngines")

    async def RunExperiment(
        self, request: engine_pool_pb2.RunExperimentRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.Measurement:
        """UNIMPLEMENTED."""
        await _unimplemented(context, "RunExperiment")


class EnginePoolApp:
    """``ServiceApp`` of the engine pool (placeholder: always ready, nothing to connect)."""

    name = "engine-pool"
    grpc_service_names = ("kiln.v1.EnginePool",)

    def __init__(self, settings: KilnSettings) -> None:
        self.settings = settings

    async def start(self, server: grpc.aio.Server) -> None:
        """Register the servicer."""
        engine_pool_pb2_grpc.add_EnginePoolServicer_to_server(EnginePoolServicer(), server)

    async def is_ready(self) -> bool:
        """Always True: nothing to wait for."""
        return True

    async def stop(self) -> None:
        """Nothing to release."""


def create_app(settings: KilnSettings) -> ServiceApp:
    """The engine pool's ``ServiceApp``."""
    return EnginePoolApp(settings)
