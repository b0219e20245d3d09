"""``kiln compilations list|show|cancel|curve``: compilations through the Compiler API."""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer
from google.protobuf.json_format import MessageToDict

from kiln.cli.compile_view import STATUS_NAMES, summary_table
from kiln.cli.compiler_call import call
from kiln.cli.context import settings_for
from kiln.cli.curve import curve
from kiln.cli.dashboard import report
from kiln.cli.render import console, print_json_lines
from kiln.v1 import compiler_pb2

app = typer.Typer(help="List and show compilations.", no_args_is_help=True)
app.command()(curve)
app.command()(report)

_STATUS_BY_NAME = {name: value for value, name in STATUS_NAMES.items()}


OUTCOME_NAMES = {
    "confirmed": "confirmed",
    "none_beat_the_baseline": "no win",
    "unconfirmed": "unconfirmed",
    "lost_on_full_tier": "lost (full)",
}
"""CompilationEnded.outcome values as the list's result column shows them."""

JsonOpt = Annotated[bool, typer.Option("--json", help="One JSON object per line.")]


def result_text(c: compiler_pb2.Compilation) -> str:
    """A listed compilation's result: its status, or for a succeeded one what the search came
    to (its outcome: ``confirmed``, ``no win``, ...)."""
    status = STATUS_NAMES.get(c.status, "?")
    if c.status == compiler_pb2.COMPILATION_STATUS_SUCCEEDED and c.outcome:
        return OUTCOME_NAMES.get(c.outcome, c.outcome)
    return status


def list_lines(compilations: list[compiler_pb2.Compilation], width: int) -> list[str]:
    """The listing's lines for a terminal ``width`` wide: a header, then one line per
    compilation (id first and whole: it is typed back into ``show``), its workload at the end
    of the line where it fits and on an indented line of its own where it does not."""
    head = f"{'id':<32}  {'team':<12} {'result':<11} {'exps':>5} {'speedup':>7}"
    lines = [head + "  workload" if width >= len(head) + 10 else head]
    for c in compilations:
        speedup = f"{c.best.speedup:.2f}x" if c.HasField("best") else "-"
        row = (
            f"{c.compilation_id:<32}  {c.team:<12} {result_text(c):<11} "
            f"{c.experiments_done:>5} {speedup:>7}"
        )
        workload = f"{c.workload.model.name} on {c.workload.hardware.name}"
        if len(row) + 2 + len(workload) <= width:
            lines.append(f"{row}  {workload}")
        else:
            lines += [row, f"    {workload}"]
    return lines


@app.command("list")
def list_(
    ctx: typer.Context,
    team: Annotated[str, typer.Option(help="Whose (default: your team; '*' for every team).")] = "",
    status: Annotated[str, typer.Option(help="pending, running, succeeded, ...")] = "",
    limit: Annotated[int, typer.Option(min=0, help="At most this many (0 = server default).")] = 0,
    as_json: JsonOpt = False,
) -> None:
    """Compilations of a team, oldest first (the order the server pages them in); for a
    succeeded one the result says what the search came to (confirmed, no win, ...)."""
    if status and status not in _STATUS_BY_NAME:
        raise typer.BadParameter(f"one of {', '.join(_STATUS_BY_NAME)}", param_hint="--status")
    request = compiler_pb2.ListRequest(team=team, limit=limit)
    if status:
        request.status = _STATUS_BY_NAME[status]
    response = asyncio.run(call(ctx, "List", request))
    assert isinstance(response, compiler_pb2.ListResponse)
    if as_json:
        print_json_lines(_as_dict(c) for c in response.compilations)
        return
    if not response.compilations:
        whose = "any team" if team == "*" else f"team {team or settings_for(ctx).team!r}"
        hint = "" if team == "*" else " (--team '*' lists every team's)"
        console.print(f"no compilations of {whose}{hint}", markup=False)
        return
    for line in list_lines(list(response.compilations), console.width):
        console.print(line, markup=False, highlight=False, overflow="ignore", crop=False)


@app.command()
def show(
    ctx: typer.Context,
    compilation_id: Annotated[str, typer.Argument(help="The compilation's id.")],
    as_json: JsonOpt = False,
) -> None:
    """One compilation: status, baseline, best, speedup, experiments, plan."""
    response = asyncio.run(call(ctx, "Get", compiler_pb2.GetRequest(compilation_id=compilation_id)))
    assert isinstance(response, compiler_pb2.Compilation)
    if as_json:
        print_json_lines([_as_dict(response)])
        return
    console.print(summary_table(response))


def _as_dict(c: compiler_pb2.Compilation) -> dict[str, object]:
    return MessageToDict(c, preserving_proto_field_name=True)


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
