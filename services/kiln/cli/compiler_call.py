"""One unary call to the agent runner's ``kiln.v1.Compiler`` API, shared by the CLI's
compilation commands."""

from __future__ import annotations

import grpc
import typer

from kiln.cli.context import service_addr, settings_for
from kiln.cli.errors import CliError
from kiln.common.errors import Unavailable, from_rpc_error
from kiln.v1 import compiler_pb2_grpc


async def call(ctx: typer.Context, method: str, request: object) -> object:
    """The response of ``Compiler.<method>(request)`` as this invocation's team (30 s timeout).

    Raises:
        CliError: the agent runner is not reachable (:func:`rpc_error`).
        KilnError: the RPC failed otherwise (its status code mapped by ``from_rpc_error``).
    """
    from kiln.common.client import team_channel

    settings = settings_for(ctx)
    async with team_channel(service_addr(settings, "agent-runner"), settings.team) as channel:
        stub = compiler_pb2_grpc.CompilerStub(channel)
        try:
            return await getattr(stub, method)(request, timeout=30)
        except grpc.RpcError as err:
            raise rpc_error(err, service_addr(settings, "agent-runner")) from None


def rpc_error(err: grpc.RpcError, addr: str) -> Exception:
    """``err`` as the CLI reports it: an unreachable agent runner as one line with the
    ``kiln up`` hint, any other status as ``from_rpc_error`` maps it."""
    exc = from_rpc_error(err)
    if isinstance(exc, Unavailable):
        return CliError(f"agent runner at {addr} is not reachable; start kiln with `kiln up`")
    return exc
