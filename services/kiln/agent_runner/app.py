"""The agent runner service process (a placeholder until the agent runner is built).

It hosts the Compiler API; every RPC answers UNIMPLEMENTED with a message saying so. The
process is otherwise a real service (health, reflection, metrics), so
``kiln serve agent-runner`` and docker-compose work now.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import NoReturn

import grpc

from kiln.common.server import ServiceApp
from kiln.common.settings import KilnSettings
from kiln.v1 import compiler_pb2, compiler_pb2_grpc

_LATER = "the agent runner (Compiler API) arrives with a later issue"


async def _unimplemented(context: grpc.aio.ServicerContext, rpc: str) -> NoReturn:
    await context.abort(
        grpc.StatusCode.UNIMPLEMENTED, f"Compiler.{rpc} is not implemented yet: {_LATER}"
    )


class CompilerServicer(compiler_pb2_grpc.CompilerServicer):
    """``kiln.v1.Compiler``: every RPC is UNIMPLEMENTED for now."""

    async def Submit(
        self, request: compiler_pb2.SubmitRequest, context: grpc.aio.ServicerContext
    ) -> compiler_pb2.Compilation:
        """UNIMPLEMENTED."""
        await _unimplemented(context, "Submit")

    async def Watch(
        self, request: compiler_pb2.WatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[compiler_pb2.CompilationEvent]:
        """UNIMPLEMENTED (a server stream that ends before sending anything)."""
        await _unimplemented(context, "Watch")
        yield compiler_pb2.CompilationEvent()  # unreachable; makes this an async generator

    async def Get(
        self, request: compiler_pb2.GetRequest, context: grpc.aio.ServicerContext
    ) -> compiler_pb2.Compilation:
        """UNIMPLEMENTED."""
        await _unimplemented(context, "Get")

    async def List(
        self, request: compiler_pb2.ListRequest, context: grpc.aio.ServicerContext
    ) -> compiler_pb2.ListResponse:
        """UNIMPLEMENTED."""
        await _unimplemented(context, "List")

    async def Cancel(
        self, request: compiler_pb2.CancelRequest, context: grpc.aio.ServicerContext
    ) -> compiler_pb2.Compilation:
        """UNIMPLEMENTED."""
        await _unimplemented(context, "Cancel")


class AgentRunnerApp:
    """``ServiceApp`` of the agent runner (placeholder: always ready, nothing to connect)."""

    name = "agent-runner"
    grpc_service_names = ("kiln.v1.Compiler",)

    def __init__(self, settings: KilnSettings) -> None:
        self.settings = settings

    async def start(self, server: grpc.aio.Server) -> None:
        """Register the servicer."""
        compiler_pb2_grpc.add_CompilerServicer_to_server(CompilerServicer(), server)

    async def is_ready(self) -> bool:
        """Always True: nothing to wait for."""
        return True

    async def stop(self) -> None:
        """Nothing to release."""


def create_app(settings: KilnSettings) -> ServiceApp:
    """The agent runner's ``ServiceApp``."""
    return AgentRunnerApp(settings)
