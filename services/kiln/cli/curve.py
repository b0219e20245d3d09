"""``kiln compilations curve ID``: the best-so-far over time (one row per
``BestCandidateImproved``), as a table, JSON or CSV for plotting."""

from __future__ import annotations

import asyncio
import csv
import io
from typing import Annotated

import typer

from kiln.cli.compile_view import ENDED
from kiln.cli.compiler_call import call
from kiln.cli.errors import CliError
from kiln.cli.render import console, print_json_lines
from kiln.v1 import compiler_pb2

COLUMNS = (
    "elapsed_s",
    "experiments",
    "device_s",
    "tokens_per_s",
    "speedup",
    "candidate_id",
    "experiment_id",
)
"""The fields of a point (:class:`kiln.domain.curve.CurvePoint`), in output order."""


def curve_rows(snap: compiler_pb2.Compilation) -> list[dict[str, object]]:
    """The compilation's progress points as dicts with :data:`COLUMNS` keys."""
    return [{c: getattr(p, c) for c in COLUMNS} for p in snap.progress]


def to_csv(rows: list[dict[str, object]]) -> str:
    """CSV text with a header line (:data:`COLUMNS`)."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def curve(
    ctx: typer.Context,
    compilation_id: Annotated[str, typer.Argument(help="The compilation's id.")],
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per point.")] = False,
    as_csv: Annotated[bool, typer.Option("--csv", help="CSV with a header line.")] = False,
) -> None:
    """The best-so-far over time: seconds since submission, experiments and device seconds
    spent, tokens/s and speedup at each new best (full-tier confirmed)."""
    if as_json and as_csv:
        raise CliError("choose one of --json and --csv")
    response = asyncio.run(call(ctx, "Get", compiler_pb2.GetRequest(compilation_id=compilation_id)))
    assert isinstance(response, compiler_pb2.Compilation)
    rows = curve_rows(response)
    if as_json:
        print_json_lines(rows)
        return
    if as_csv:
        typer.echo(to_csv(rows), nl=False)
        return
    if not rows:
        yet = "" if response.status in ENDED else " yet"
        line = f"compilation {compilation_id}: no best candidate confirmed{yet}"
        console.print(line, markup=False)
        return
    console.print(
        f"{'elapsed s':>10} {'exps':>5} {'device s':>9} {'tokens/s':>12} {'speedup':>8}  candidate",
        markup=False,
        highlight=False,
    )
    for r in rows:
        console.print(
            f"{r['elapsed_s']:>10.1f} {r['experiments']:>5} {r['device_s']:>9.1f} "
            f"{r['tokens_per_s']:>12,.1f} {r['speedup']:>7.2f}x  {str(r['candidate_id'])[:16]}",
            markup=False,
            highlight=False,
        )
