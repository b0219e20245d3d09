"""The ``kiln`` command: ``kiln compile``, ``kiln compilations``, ``kiln up`` / ``down`` /
``status``, ``kiln serve``, ``kiln migrate``, ``kiln ledger ...`` and ``kiln credentials ...``.
Every user error is one red line on stderr and a non-zero exit."""

from __future__ import annotations

import sys
from typing import Annotated

import structlog
import typer

from kiln.cli import (
    compilations,
    credentials,
    deployments,
    health,
    ledger,
    migrate,
    serve,
    traffic,
    up,
)
from kiln.cli.compile import compile as compile_command
from kiln.cli.context import CliState
from kiln.cli.dashboard import dashboard as dashboard_command
from kiln.cli.errors import KilnGroup
from kiln.cli.export import export as export_command
from kiln.cli.plan import plan as plan_command

app = typer.Typer(
    name="kiln",
    cls=KilnGroup,
    help="kiln: continual compilation for AI inference.",
    no_args_is_help=True,
    rich_markup_mode="markdown",
    add_completion=False,
    pretty_exceptions_enable=False,
)
"""The root command (console script ``kiln``)."""


@app.callback()
def main(
    ctx: typer.Context,
    team: Annotated[
        str | None,
        typer.Option(help="Team identity sent on every call.", envvar="KILN_TEAM"),
    ] = None,
    ledger_addr: Annotated[
        str | None,
        typer.Option(help="Ledger address host:port.", envvar="KILN_LEDGER_ADDR"),
    ] = None,
) -> None:
    """kiln: continual compilation for AI inference. Start with `kiln up`."""
    _logs_to_stderr()
    ctx.obj = CliState(team=team, ledger_addr=ledger_addr)


class _Stderr:
    """Whatever ``sys.stderr`` is when written to (test runners swap it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _logs_to_stderr() -> None:
    """Unless something configured structlog already (a service in this process), send its
    lines to stderr: stdout is the command's output (``--json`` included)."""
    if not structlog.is_configured():
        structlog.configure(logger_factory=structlog.PrintLoggerFactory(_Stderr()))  # type: ignore[arg-type]


app.command()(up.up)
app.command()(up.down)
app.command()(up.status)
app.command(hidden=True)(up.supervise)
app.command()(serve.serve)
app.command()(migrate.migrate)
app.command()(health.health)
app.command("compile")(compile_command)
app.command("export")(export_command)
app.command("plan")(plan_command)
app.command("dashboard")(dashboard_command)
app.add_typer(compilations.app, name="compilations")
app.add_typer(deployments.app, name="deployments")
app.add_typer(traffic.app, name="traffic")
app.add_typer(ledger.app, name="ledger")
app.add_typer(credentials.app, name="credentials")

if __name__ == "__main__":
    app(prog_name="kiln")
