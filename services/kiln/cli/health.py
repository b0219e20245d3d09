"""``kiln health ADDR``: exit 0 when a kiln service answers gRPC health checks as SERVING (the
containers' healthcheck)."""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer

from kiln.cli.errors import CliError


def health(
    addr: Annotated[str, typer.Argument(help="host:port of a kiln service.")],
    service: Annotated[
        str, typer.Option(help='Health service name ("" = overall, "readiness", ...).')
    ] = "",
    timeout: Annotated[float, typer.Option(help="Seconds to wait.")] = 3.0,
) -> None:
    """Check a service's gRPC health; exit 1 with one line when it is not SERVING."""
    from kiln.common.client import wait_healthy

    try:
        asyncio.run(wait_healthy(addr, timeout, service=service))
    except TimeoutError as exc:
        raise CliError(str(exc)) from None
    print(f"{addr}: SERVING")
