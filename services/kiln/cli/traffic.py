"""``kiln traffic observe NAME FILE [--speed X]``: replay a trace (any format kiln reads) as a
deployment's observed traffic through ``Deployments.ObserveTraffic``, its timestamps ``--speed``
times faster (0: as fast as possible). Arrival times go as the trace has them; the windows are
cut by those, never by wall clock, so any speed gives the same windows. ``--continue`` (the
default) shifts them to just after the last record the deployment has seen, so several files
play one after another; ``--close`` closes the open windows at the end of the file."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kiln.cli.errors import CliError
from kiln.cli.render import console
from kiln.v1 import deployments_pb2

if TYPE_CHECKING:
    from kiln.workloads.traffic import Trace

app = typer.Typer(help="Observed traffic of deployments.", no_args_is_help=True)


def _read(path: Path) -> Trace:
    """The trace at ``path``; CliError (one line) when it cannot be read."""
    from kiln.workloads.traffic import TraceError, read_trace

    try:
        return read_trace(path)
    except FileNotFoundError:
        raise CliError(f"traffic trace {path} does not exist") from None
    except (OSError, TraceError) as exc:
        raise CliError(str(exc)) from None


async def _records(
    name: str, trace: Trace, speed: float, scale_isl: float, cont: bool, close: bool
) -> AsyncIterator[deployments_pb2.TrafficRecord]:
    started = time.monotonic()
    first = trace.requests[0].arrival_s if trace.requests else 0.0
    for i, r in enumerate(trace.requests):
        if speed > 0:
            wait = (r.arrival_s - first) / speed - (time.monotonic() - started)
            if wait > 0:
                await asyncio.sleep(wait)
        yield deployments_pb2.TrafficRecord(
            deployment=name if i == 0 else "",
            arrival_s=r.arrival_s,
            isl=max(0, round(r.isl * scale_isl)),
            osl=r.osl,
            hash_ids=list(r.hash_ids),
            continue_clock=cont and i == 0,
            close_windows=close and i == 0,
        )


@app.command()
def observe(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="The deployment's name.")],
    file: Annotated[
        Path, typer.Argument(help="A trace: Azure CSV, Mooncake JSONL or ServeGen file.")
    ],
    speed: Annotated[
        float, typer.Option(min=0, help="Replay this many times faster (0: at once).")
    ] = 600.0,
    scale_isl: Annotated[
        float, typer.Option("--scale-isl", min=0, help="Multiply prompt lengths (drill: 1.8).")
    ] = 1.0,
    cont: Annotated[
        bool, typer.Option("--continue/--restart-clock", help="Continue the traffic clock.")
    ] = True,
    close: Annotated[bool, typer.Option(help="Close the open windows at the end.")] = False,
) -> None:
    """Send a trace's requests as the deployment's observed traffic."""
    from kiln.cli.deployments import call_stream

    trace = _read(file)  # before the stream opens: an error inside it would not reach here
    response = asyncio.run(
        call_stream(ctx, "ObserveTraffic", _records(name, trace, speed, scale_isl, cont, close))
    )
    assert isinstance(response, deployments_pb2.ObserveTrafficResponse)
    console.print(
        f"{name}: {response.accepted} records sent to {response.subject}"
        + (f" (arrivals shifted {response.offset_s:+.1f} s)" if response.offset_s else ""),
        markup=False,
        highlight=False,
    )
