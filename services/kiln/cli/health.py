"""``kiln health ADDR``: exit 0 when a kiln service answers gRPC health checks as SERVING (the
containers' healthcheck)."""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer

from kiln.cli.errors import CliError
from kiln.common.errors import NotFound


async def check_health(addr: str, service: str, timeout_s: float) -> None:
    """Wait until ``service`` at ``addr`` is SERVING (:func:`kiln.common.client.wait_healthy`).

    Raises:
        CliError: the server has no status for ``service`` (final at once), or it is not
            SERVING within ``timeout_s`` (the message names the last status seen).
    """
    from kiln.common.client import wait_healthy

    try:
        await wait_healthy(addr, timeout_s, service, unknown_is_final=True)
    except (TimeoutError, NotFound) as exc:
        raise CliError(str(exc)) from None


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
