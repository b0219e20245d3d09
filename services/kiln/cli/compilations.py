"""``kiln compilations list|show|cancel|curve``: compilations through the Compiler API."""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer

from kiln.cli.compile_view import STATUS_NAMES, summary_table
from kiln.cli.compiler_call import call
from kiln.cli.context import settings_for
from kiln.cli.curve import curve
from kiln.cli.dashboard import report
from kiln.cli.render import console
from kiln.v1 import compiler_pb2

app = typer.Typer(help="List and show compilations.", no_args_is_help=True)
app.command()(curve)
app.command()(report)

_STATUS_BY_NAME = {name: value for value, name in STATUS_NAMES.items()}


@app.command("list")
def list_(
    ctx: typer.Context,
    team: Annotated[str, typer.Option(help="Whose (default: your team; '*' for every team).")] = "",
    status: Annotated[str, typer.Option(help="pending, running, succeeded, ...")] = "",
    limit: Annotated[int, typer.Option(min=0, help="At most this many (0 = server default).")] = 0,
) -> None:
    """Compilations of a team, oldest first (the order the server pages them in)."""
    if status and status not in _STATUS_BY_NAME:
        raise typer.BadParameter(f"one of {', '.join(_STATUS_BY_NAME)}", param_hint="--status")
    request = compiler_pb2.ListRequest(team=team, limit=limit)
    if status:
        request.status = _STATUS_BY_NAME[status]
    response = asyncio.run(call(ctx, "List", request))
    assert isinstance(response, compiler_pb2.ListResponse)
    # One line each, the id first and whole (it is typed back into `show`), the workload last
    # so that only it wraps on a narrow terminal.
    if not response.compilations:
        whose = "any team" if team == "*" else f"team {team or settings_for(ctx).team!r}"
        hint = "" if team == "*" else " (--team '*' lists every team's)"
        console.print(f"no compilations of {whose}{hint}", markup=False)
        return
    console.print(f"{'id':<32}  {'team':<12} {'status':<10} {'exps':>5} {'speedup':>8}  workload")
    for c in response.compilations:
        speedup = f"{c.best.speedup:.2f}x" if c.HasField("best") else "-"
        console.print(
            f"{c.compilation_id:<32}  {c.team:<12} {STATUS_NAMES.get(c.status, '?'):<10} "
            f"{c.experiments_done:>5} {speedup:>8}  "
            f"{c.workload.model.name} on {c.workload.hardware.name}",
            markup=False,
            highlight=False,
        )


@app.command()
def show(
    ctx: typer.Context,
    compilation_id: Annotated[str, typer.Argument(help="The compilation's id.")],
) -> None:
    """One compilation: status, baseline, best, speedup, experiments, plan."""
    response = asyncio.run(call(ctx, "Get", compiler_pb2.GetRequest(compilation_id=compilation_id)))
    assert isinstance(response, compiler_pb2.Compilation)
    console.print(summary_table(response))


@app.command()
def cancel(
    ctx: typer.Context,
    compilation_id: Annotated[str, typer.Argument(help="The compilation's id.")],
    reason: Annotated[str, typer.Option(help="Why (recorded in the ledger).")] = "",
) -> None:
    """Stop a running compilation of your team (its experiments are settled, the best so far
    is kept). Exits 1 with one line when it belongs to another team or has ended."""
    request = compiler_pb2.CancelRequest(compilation_id=compilation_id, reason=reason)
    response = asyncio.run(call(ctx, "Cancel", request))
    assert isinstance(response, compiler_pb2.Compilation)
    status = STATUS_NAMES.get(response.status, "?")
    console.print(
        f"{compilation_id}: {status}" + (f" ({response.reason})" if response.reason else ""),
        markup=False,
        highlight=False,
    )
