"""The cost model service process: the hardware catalogue and the roofline planner over gRPC.

Stateless and self-contained (no database, no NATS), so it is ready as soon as it starts.
"""

from __future__ import annotations

import grpc

from kiln.common.settings import KilnSettings
from kiln.cost_model.service import CostModelServicer
from kiln.v1 import cost_model_pb2_grpc


class CostModelApp:
    """``ServiceApp`` of the cost model (see ``kiln.common.server``)."""

    name = "cost-model"
    grpc_service_names = ("kiln.v1.CostModel",)

    def __init__(self, settings: KilnSettings) -> None:
        self.settings = settings
        self.servicer = CostModelServicer()

    async def start(self, server: grpc.aio.Server) -> None:
        """Register the servicer."""
        cost_model_pb2_grpc.add_CostModelServicer_to_server(self.servicer, server)

    async def is_ready(self) -> bool:
        """Always True: the catalogue and planner are in-process."""
        return True

    async def stop(self) -> None:
        """Stop the planner threads."""
        self.servicer.close()


def create_app(settings: KilnSettings) -> CostModelApp:
    """The cost model's ``ServiceApp`` (``kiln serve cost-model``)."""
    return CostModelApp(settings)
