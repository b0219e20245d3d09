"""``kiln health ADDR``: exit 0 when a kiln service answers gRPC health checks as SERVING (the
containers' healthcheck)."""

from __future__ import annotations

import asyncio
import time
from typing import Annotated

import grpc
import typer

from kiln.cli.errors import CliError


async def check_health(addr: str, service: str, timeout_s: float) -> None:
    """Poll the gRPC health ``Check`` of ``service`` at ``addr`` until it is SERVING.

    Raises:
        CliError: the server has no status for ``service`` (NOT_FOUND is final: a kiln service
            registers its health names before it listens), or it is not SERVING within
            ``timeout_s`` (the message names the last status seen).
    """
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kiln.common.client import channel

    deadline = time.monotonic() + timeout_s
    last = "no answer"
    async with channel(addr) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CliError(
                    f"{addr} is not healthy (health service {service!r}) after {timeout_s:g} s; "
                    f"last status: {last}"
                )
            try:
                reply = await stub.Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=min(remaining, 1.0)
                )
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    raise CliError(f"no health status for service {service!r} at {addr}") from None
                details = (err.details() or "").strip()
                last = err.code().name + (f": {details}" if details else "")
            await asyncio.sleep(min(0.1, max(deadline - time.monotonic(), 0)))


def health(
    addr: Annotated[str, typer.Argument(help="host:port of a kiln service.")],
    service: Annotated[
        str, typer.Option(help='Health service name ("" = overall, "readiness", ...).')
    ] = "",
    timeout: Annotated[float, typer.Option(min=0, help="Seconds to wait.")] = 3.0,
) -> None:
    """Check a service's gRPC health; exit 1 with one line when it is not SERVING."""
    asyncio.run(check_health(addr, service, timeout))
    print(f"{addr}: SERVING")
