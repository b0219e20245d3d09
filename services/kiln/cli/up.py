"""``kiln up``, ``kiln down``, ``kiln status``: the embedded default's lifecycle; ``kiln
supervise``, the process ``kiln up`` leaves to keep it alive."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated

import typer

from kiln.cli.context import settings_for
from kiln.cli.errors import err_console
from kiln.cli.render import console, status_table
from kiln.embedded.supervisor import Supervisor

StateDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--state-dir", help="Where embedded servers keep data and logs \\[env KILN_STATE_DIR]."
    ),
]


def up(
    ctx: typer.Context,
    state_dir: StateDirOpt = None,
    no_services: Annotated[
        bool, typer.Option("--no-services", help="Start only NATS and PostgreSQL, and migrate.")
    ] = False,
) -> None:
    """Start NATS, PostgreSQL and the four services, and a supervisor that restarts any of
    them that dies; a no-op for what already runs.

    NATS and PostgreSQL are embedded unless KILN_NATS_URL / KILN_DATABASE_URL name existing
    servers; the database is migrated before the services start.
    """
    supervisor = Supervisor(settings_for(ctx, state_dir=state_dir))
    with err_console.status("starting kiln..."):
        rows = supervisor.up(start_services=not no_services)
    console.print(status_table(rows))
    if supervisor.issued:
        names = ", ".join(i.principal.uri for i in supervisor.issued)
        console.print(f"issued certificates: {names}", markup=False)
    if state_dir is None:
        console.print(f"state: {supervisor.state_dir}  (stop with `kiln down`)", markup=False)
    else:  # the other commands find it only when told
        where = shlex.quote(str(supervisor.state_dir))
        console.print(
            f"state: {supervisor.state_dir}  (for the other commands: export "
            f"KILN_STATE_DIR={where}; stop with `kiln down --state-dir {where}`)",
            markup=False,
        )


def down(ctx: typer.Context, state_dir: StateDirOpt = None) -> None:
    """Stop the supervisor, the services, then the embedded NATS and PostgreSQL (their data is
    kept)."""
    supervisor = Supervisor(settings_for(ctx, state_dir=state_dir))
    with err_console.status("stopping kiln..."):
        stopped = supervisor.down()
    console.print(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")


def supervise(ctx: typer.Context, state_dir: StateDirOpt = None) -> None:
    """Keep what `kiln up` started alive, restarting what dies (`kiln up` starts this)."""
    import os

    from kiln.embedded.supervise import supervise as run

    run(settings_for(ctx, state_dir=state_dir), dict(os.environ))


def status(ctx: typer.Context, state_dir: StateDirOpt = None) -> None:
    """Show each component's pid, address and health; exits 3 when one is not healthy."""
    rows = Supervisor(settings_for(ctx, state_dir=state_dir)).status()
    console.print(status_table(rows))
    if not all(row.healthy for row in rows):
        raise typer.Exit(3)
