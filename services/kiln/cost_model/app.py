"""The cost model service process: the hardware catalogue and the tiered planner over gRPC.

Ready as soon as it starts: without the ledger or NATS it answers from the roofline tier. In
the background it follows the ledger (:class:`~kiln.cost_model.knowledge.Knowledge`:
microbenchmark tables, measured passes) and asks engine pools over NATS for the
microbenchmarks a request lacks (``KILN_COST_*``: :class:`~kiln.cost_model.knowledge.CostSettings`).
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from kiln.common.settings import KilnSettings
from kiln.cost_model.knowledge import CostSettings, Knowledge
from kiln.cost_model.service import CostModelServicer
from kiln.v1 import cost_model_pb2_grpc


class CostModelApp:
    """``ServiceApp`` of the cost model (see ``kiln.common.server``)."""

    name = "cost-model"
    grpc_service_names = ("kiln.v1.CostModel",)

    def __init__(self, settings: KilnSettings, cost: CostSettings | None = None) -> None:
        self.settings = settings
        self.knowledge = Knowledge(settings, cost)
        self.servicer = CostModelServicer(knowledge=self.knowledge)
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self, server: grpc.aio.Server) -> None:
        """Register the servicer and start following the ledger."""
        cost_model_pb2_grpc.add_CostModelServicer_to_server(self.servicer, server)
        self._task = asyncio.create_task(self.knowledge.run(self._stop), name="kiln-cost-know")

    async def is_ready(self) -> bool:
        """Always True: the catalogue and planner are in-process (tiers 2 and 3 join later)."""
        return True

    async def stop(self) -> None:
        """Stop the follower and the planner threads."""
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        await self.knowledge.close()
        self.servicer.close()


def create_app(settings: KilnSettings) -> CostModelApp:
    """The cost model's ``ServiceApp`` (``kiln serve cost-model``)."""
    return CostModelApp(settings)
