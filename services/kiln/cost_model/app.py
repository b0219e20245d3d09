"""The cost model service process (a placeholder until the cost model is built).

Every RPC answers UNIMPLEMENTED with a message saying so; the process is otherwise a real
service (health, reflection, metrics), so ``kiln serve cost-model`` and docker-compose work now.
"""

from __future__ import annotations

from typing import NoReturn

import grpc

from kiln.common.server import ServiceApp
from kiln.common.settings import KilnSettings
from kiln.v1 import cost_model_pb2, cost_model_pb2_grpc

_LATER = "the cost model arrives with a later issue"


async def _unimplemented(context: grpc.aio.ServicerContext, rpc: str) -> NoReturn:
    await context.abort(
        grpc.StatusCode.UNIMPLEMENTED, f"CostModel.{rpc} is not implemented yet: {_LATER}"
    )


class CostModelServicer(cost_model_pb2_grpc.CostModelServicer):
    """``kiln.v1.CostModel``: every RPC is UNIMPLEMENTED for now."""

    async def Plan(
        self, request: cost_model_pb2.PlanRequest, context: grpc.aio.ServicerContext
    ) -> cost_model_pb2.PlanResponse:
        """UNIMPLEMENTED."""
        await _unimplemented(context, "Plan")

    async def Explain(
        self, request: cost_model_pb2.ExplainRequest, context: grpc.aio.ServicerContext
    ) -> cost_model_pb2.ExplainResponse:
        """UNIMPLEMENTED."""
        await _unimplemented(context, "Explain")


class CostModelApp:
    """``ServiceApp`` of the cost model (placeholder: always ready, nothing to connect)."""

    name = "cost-model"
    grpc_service_names = ("kiln.v1.CostModel",)

    def __init__(self, settings: KilnSettings) -> None:
        self.settings = settings

    async def start(self, server: grpc.aio.Server) -> None:
        """Register the servicer."""
        cost_model_pb2_grpc.add_CostModelServicer_to_server(CostModelServicer(), server)

    async def is_ready(self) -> bool:
        """Always True: nothing to wait for."""
        return True

    async def stop(self) -> None:
        """Nothing to release."""


def create_app(settings: KilnSettings) -> ServiceApp:
    """The cost model's ``ServiceApp``."""
    return CostModelApp(settings)
