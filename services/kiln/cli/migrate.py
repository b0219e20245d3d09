"""``kiln migrate``: bring the ledger's database to the newest schema."""

from __future__ import annotations

from typing import Annotated

import typer

from kiln.cli.context import settings_for
from kiln.cli.render import console


def migrate(
    ctx: typer.Context,
    database_url: Annotated[
        str | None,
        typer.Option(help="SQLAlchemy URL (default: KILN_DATABASE_URL, else the embedded one)."),
    ] = None,
) -> None:
    """Run the Alembic migrations to head (safe to repeat)."""
    from kiln.embedded.supervisor import redact_url
    from kiln.ledger.migrate import current, upgrade

    url = settings_for(ctx, database_url=database_url).require_database_url()
    upgrade(url)
    console.print(f"{redact_url(url)}: at revision {current(url)}", markup=False)
