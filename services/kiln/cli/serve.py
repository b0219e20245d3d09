"""``kiln serve NAME``: run one service in the foreground (what ``kiln up`` and each container
run). It is the engine pool's composition root: the pool's engines measure baselines with
:func:`kiln.baselines.in_engine.measure_baseline` (:func:`service_app`).

Its stderr is the service's log. With ``KILN_LOG_FORMAT=json`` (the default) and stderr not a
terminal (a log file, a container), a failure is logged as one JSON line too, so every line of
the log parses; at a terminal it is the usual red ``error: ...`` line.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Callable
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Literal

import typer

from kiln.cli.context import settings_for
from kiln.cli.errors import CliError, describe

if TYPE_CHECKING:
    from kiln.common.server import ServiceApp
    from kiln.common.settings import KilnSettings


class ServiceChoice(StrEnum):
    """The services ``kiln serve`` can run."""

    ledger = "ledger"
    engine_pool = "engine-pool"
    agent_runner = "agent-runner"
    cost_model = "cost-model"


_LISTEN_HINT = "(set KILN_LISTEN_ADDR or --listen to another one)"
"""The runtime's hint when the address cannot be bound (kiln.common.server)."""


def listen_hint(service: str, listen_given: bool) -> str:
    """What to change when ``service`` cannot bind its address: ``--listen`` /
    ``KILN_LISTEN_ADDR`` when one of them chose it, else the service's own ``KILN_*_ADDR``
    (the variable ``kiln up`` passes to each service)."""
    if listen_given:
        return "(set --listen or KILN_LISTEN_ADDR to another address)"
    var = f"KILN_{service.replace('-', '_').upper()}_ADDR"
    return f"(set {var} to another address)"


_GRPC_BIND_NOISE = re.compile(r"\s*\[Failed to bind to address [^\]]*GRPC_VERBOSITY[^\]]*\]")
"""gRPC's generic bind error, which the runtime appends; the C-core's own log line before it
says why."""


def bind_error(message: str, service: str, listen_given: bool) -> str:
    """The runtime's "cannot listen" message with the right setting named, without gRPC's
    generic suffix."""
    message = message.replace(_LISTEN_HINT, listen_hint(service, listen_given))
    return _GRPC_BIND_NOISE.sub("", message)


def service_app(name: str) -> Callable[[KilnSettings], ServiceApp]:
    """The ``create_app(settings)`` ``kiln serve NAME`` runs: the service's own
    (:func:`kiln.common.apps.app_factory`), the engine pool's with the baselines' measure.

    Raises:
        ValueError: ``name`` is not a service.
    """
    from kiln.common.apps import app_factory

    if name != ServiceChoice.engine_pool:
        return app_factory(name)

    def create_engine_pool(settings: KilnSettings) -> ServiceApp:
        from kiln.baselines.in_engine import measure_baseline
        from kiln.engine_pool.app import EnginePoolApp

        return EnginePoolApp(settings, external_measure=measure_baseline)

    return create_engine_pool


def serve(
    ctx: typer.Context,
    name: Annotated[ServiceChoice, typer.Argument(help="Which service.")],
    listen: Annotated[
        str | None,
        typer.Option(help="Address to bind, e.g. 0.0.0.0:50051 (default: the service's address)."),
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            help="Prometheus /metrics port (0 = off; default 9401..9404 by service), bound on "
            "the host of the listen address."
        ),
    ] = None,
) -> None:
    """Run a service until SIGTERM / Ctrl-C (then shut down gracefully)."""
    from kiln.common.logging import configure_logging, parse_level
    from kiln.common.server import ServiceStartError, run

    fmt: Literal["json", "console"] = "json"  # KILN_LOG_FORMAT's, even when settings fail
    if os.environ.get("KILN_LOG_FORMAT", "").strip().lower() == "console":
        fmt = "console"
    configured = False
    try:
        settings = settings_for(ctx, listen_addr=listen, metrics_port=metrics_port)
        settings = settings.with_embedded_endpoints()
        fmt = settings.log_format
        configure_logging(settings.log_level, fmt, service=name.value)
        configured = True
        if parse_level(settings.log_level) > logging.DEBUG:
            # Alembic logs "setup plugin ..." at INFO when the ledger imports it.
            logging.getLogger("alembic").setLevel(logging.WARNING)
        try:
            run(service_app(name.value), settings)
        except ServiceStartError as exc:
            message = bind_error(str(exc), name.value, settings.listen_addr is not None)
            raise CliError(message) from None
    except (typer.Exit, typer.Abort, KeyboardInterrupt):
        raise
    except Exception as exc:
        if fmt != "json" or sys.stderr.isatty() or os.environ.get("KILN_DEBUG"):
            raise  # the CLI's one red line (or the traceback with KILN_DEBUG)
        if not configured:
            configure_logging("info", "json", service=name.value)
        from kiln.common.logging import get_logger

        unexpected = describe(exc).startswith("unexpected ")
        get_logger("kiln.serve").error(
            "service failed", error=describe(exc), exc_info=exc if unexpected else None
        )
        raise typer.Exit(1) from None
