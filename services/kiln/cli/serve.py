"""``kiln serve NAME``: run one service in the foreground (what ``kiln up`` and each container
run)."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

import typer

from kiln.cli.context import settings_for


class ServiceChoice(StrEnum):
    """The services ``kiln serve`` can run."""

    ledger = "ledger"
    engine_pool = "engine-pool"
    agent_runner = "agent-runner"
    cost_model = "cost-model"


def serve(
    ctx: typer.Context,
    name: Annotated[ServiceChoice, typer.Argument(help="Which service.")],
    listen: Annotated[
        str | None,
        typer.Option(help="Address to bind, e.g. 0.0.0.0:50051 (default: the service's address)."),
    ] = None,
    metrics_port: Annotated[
        int | None, typer.Option(help="Prometheus /metrics port (0 = off).")
    ] = None,
) -> None:
    """Run a service until SIGTERM / Ctrl-C (then shut down gracefully)."""
    from kiln.common.apps import app_factory
    from kiln.common.logging import configure_logging
    from kiln.common.server import run

    settings = settings_for(ctx, listen_addr=listen, metrics_port=metrics_port)
    settings = settings.with_embedded_endpoints()
    configure_logging(settings.log_level, settings.log_format, service=name.value)
    run(app_factory(name.value), settings)
