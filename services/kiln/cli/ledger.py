"""``kiln ledger ...``: read streams and the global log, follow the published events (NATS),
query projections, replay."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import grpc
import typer
from rich.text import Text

from kiln.cli.context import ledger_addr, settings_for
from kiln.cli.errors import CliError, err_console
from kiln.cli.render import (
    console,
    event_dict,
    event_line,
    print_events,
    print_json_lines,
    replay_table,
    rows_table,
)
from kiln.common.errors import KilnError, NotFound, Unauthenticated, Unavailable

if TYPE_CHECKING:
    from kiln.ledger.client import LedgerClient

app = typer.Typer(
    help="Read the ledger: one stream, the global log, projections; rebuild and compare.",
    no_args_is_help=True,
)

T = TypeVar("T")

JsonOpt = Annotated[bool, typer.Option("--json", help="One JSON object per line.")]
AddrOpt = Annotated[
    str | None, typer.Option("--ledger-addr", help="Ledger address host:port.", show_default=False)
]
TeamOpt = Annotated[str | None, typer.Option("--team", help="Team identity.", show_default=False)]
OperatorOpt = Annotated[
    str,
    typer.Option(
        "--operator",
        envvar="KILN_OPERATOR",
        help="Operator identity (its certificate: operators/NAME of the PKI, or KILN_TLS_*).",
    ),
]


class ProjectionName(StrEnum):
    """The projections ``kiln ledger query`` reads."""

    compilations = "compilations"
    experiments = "experiments"
    best_candidates = "best-candidates"


@asynccontextmanager
async def open_ledger(
    ctx: typer.Context,
    addr: str | None = None,
    team: str | None = None,
    operator: str | None = None,
) -> AsyncIterator[LedgerClient]:
    """A LedgerClient for the configured ledger and team (``addr`` / ``team`` override the
    global options), presenting the team's certificate or ``operator``'s; an unreachable ledger
    becomes one readable error."""
    from kiln.ledger.client import LedgerClient

    # None = not given; "" is given (an empty --team fails like KILN_TEAM= does)
    settings = settings_for(ctx, ledger_addr=addr, team=team, operator=operator)
    addr = ledger_addr(settings)
    client = LedgerClient(addr, settings.team)
    try:
        yield client
    except (KilnError, grpc.RpcError) as exc:
        code = exc.code() if isinstance(exc, grpc.RpcError) and callable(exc.code) else None
        if isinstance(exc, Unavailable) or code == grpc.StatusCode.UNAVAILABLE:
            raise CliError(f"ledger at {addr} is not reachable; start it with `kiln up`") from None
        raise
    finally:
        await client.close()


def run_with_ledger(
    ctx: typer.Context,
    call: Callable[[LedgerClient], Awaitable[T]],
    addr: str | None = None,
    team: str | None = None,
    operator: str | None = None,
) -> T:
    """Open a client (as ``operator`` when given), await ``call(client)``, close the client."""

    async def go() -> T:
        async with open_ledger(ctx, addr, team, operator) as client:
            return await call(client)

    return asyncio.run(go())


@app.command()
def events(
    ctx: typer.Context,
    stream: Annotated[str, typer.Argument(help="Stream id, e.g. compilation-42.")],
    from_version: Annotated[
        int, typer.Option(min=1, help="First stream version to show (versions start at 1).")
    ] = 1,
    as_json: JsonOpt = False,
    ledger_addr: AddrOpt = None,
    team: TeamOpt = None,
) -> None:
    """Show the events of one stream, in version order."""
    found = run_with_ledger(
        ctx, lambda c: c.read_stream(stream, from_version=from_version), ledger_addr, team
    )
    if as_json:
        print_json_lines(event_dict(e) for e in found)
    else:
        print_events(found, title=f"{stream}: {len(found)} events")


@app.command()
def tail(
    ctx: typer.Context,
    after: Annotated[int, typer.Option(min=0, help="Show events after this global position.")] = 0,
    follow: Annotated[
        bool, typer.Option("--follow/--no-follow", help="Keep printing new events.")
    ] = True,
    types: Annotated[
        list[str] | None, typer.Option("--type", help="Only this event type (repeatable).")
    ] = None,
    stream_prefix: Annotated[str, typer.Option(help="Only streams starting with this.")] = "",
    max_count: Annotated[
        int, typer.Option(min=0, help="Stop after this many events (0 = all).")
    ] = 0,
    as_json: JsonOpt = False,
    ledger_addr: AddrOpt = None,
    team: TeamOpt = None,
) -> None:
    """Show the global log of events; with --follow (the default), keep printing new ones."""

    async def go(client: LedgerClient) -> list[Any]:
        seen: list[Any] = []
        stream = client.read_all(
            after_position=after,
            follow=follow,
            types=tuple(types or ()),
            stream_prefix=stream_prefix,
            max_count=max_count,
        )
        async for event in stream:
            if as_json:
                print_json_lines([event_dict(event)])
            elif follow:
                console.print(event_line(event), no_wrap=True, overflow="ellipsis")
            else:
                seen.append(event)
        return seen

    try:
        collected = run_with_ledger(ctx, go, ledger_addr, team)
    except KeyboardInterrupt:
        raise typer.Exit(0) from None
    if not follow and not as_json:
        print_events(collected, title=f"{len(collected)} events after position {after}")


@app.command()
def subscribe(
    ctx: typer.Context,
    category: Annotated[
        str | None,
        typer.Option(help="Only streams of this category, e.g. experiment.", show_default=False),
    ] = None,
    stream: Annotated[
        str | None, typer.Option(help="Only this stream, e.g. compilation-42.", show_default=False)
    ] = None,
    event_type: Annotated[
        str | None, typer.Option("--type", help="Only this event type.", show_default=False)
    ] = None,
    from_first: Annotated[
        bool, typer.Option("--all", help="Start from the first event the stream retains.")
    ] = False,
    since: Annotated[
        int | None,
        typer.Option(min=1, help="Start at this stream sequence (inclusive).", show_default=False),
    ] = None,
    count: Annotated[
        int | None, typer.Option(min=1, help="Stop after this many events.", show_default=False)
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Follow the events the ledger publishes to NATS JetStream, each once, in stream order.

    Reads NATS (KILN_NATS_URL, KILN_SUBJECT_PREFIX), not the ledger service; shows new events
    unless --all or --since says where to start. Human lines start with the stream sequence
    (#N) that --since takes.
    """
    from kiln.common.logging import configure_logging
    from kiln.common.nats import connect
    from kiln.ledger.convert import recorded_to_proto
    from kiln.ledger.events_feed import EventsFeed, Start, events_subject_filter

    if from_first and since is not None:
        raise CliError("give --all or --since, not both")
    start: Start = "all" if from_first else ("new" if since is None else since)
    settings = settings_for(ctx)
    prefix = settings.subject_prefix
    try:
        subject = events_subject_filter(prefix, category, stream, event_type)
    except KilnError as exc:
        raise CliError(exc.message) from None
    url = settings.require_nats_url()
    try:
        credentials = settings.nats_credentials()
    except RuntimeError as exc:
        raise CliError(str(exc)) from None
    configure_logging("error", "console", service="kiln-cli")  # not the client's retry warnings

    async def go() -> None:
        try:
            nc = await connect(url, "kiln-cli", credentials=credentials, attempts=2)
        except Unauthenticated as exc:
            raise CliError(f"{exc.message}; set KILN_NATS_USER and KILN_NATS_PASSWORD") from None
        except Unavailable:
            raise CliError(f"NATS at {url} is not reachable; start it with `kiln up`") from None
        try:
            feed = EventsFeed(
                nc.jetstream(),
                prefix,
                category=category,
                stream_id=stream,
                event_type=event_type,
                start=start,
            )
            async with feed:
                if not as_json:
                    where = {"new": "new events", "all": "from the first retained event"}
                    err_console.print(
                        f"following {subject} ({where.get(str(start), f'from sequence {start}')});"
                        " Ctrl-C stops",
                        style="dim",
                        markup=False,
                    )
                shown = 0
                async for published in feed:
                    event = recorded_to_proto(published.event)
                    if as_json:
                        print_json_lines([{"sequence": published.sequence, **event_dict(event)}])
                    else:
                        line = Text(f"#{published.sequence} ", style="dim") + event_line(event)
                        console.print(line, no_wrap=True, overflow="ellipsis")
                    shown += 1
                    if count is not None and shown >= count:
                        return
        except NotFound:
            raise CliError(
                f"NATS at {url} has no events stream for prefix {prefix!r}; "
                "start kiln with `kiln up`"
            ) from None
        finally:
            await nc.close()

    try:
        asyncio.run(go())
    except KeyboardInterrupt:
        raise typer.Exit(0) from None


def _parse_filters(pairs: list[str]) -> dict[str, str]:
    parsed: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise CliError(f"--filter wants KEY=VALUE, got {pair!r}")
        if key in parsed:
            raise CliError(
                f"--filter {key} given twice ({key}={parsed[key]!r}, {key}={value!r}): "
                "filters are ANDed equalities, give each column once"
            )
        parsed[key] = value
    return parsed


@app.command()
def query(
    ctx: typer.Context,
    projection: Annotated[ProjectionName, typer.Argument(help="Which projection.")],
    filters: Annotated[
        list[str] | None,
        typer.Option("--filter", help="Column equality, KEY=VALUE (repeatable)."),
    ] = None,
    limit: Annotated[
        int, typer.Option(min=0, help="At most this many rows (0 = all of them).")
    ] = 0,
    as_json: Annotated[
        bool, typer.Option("--json", help="One JSON object per line, with every column.")
    ] = False,
    ledger_addr: AddrOpt = None,
    team: TeamOpt = None,
) -> None:
    """Show rows of a projection (compilations, experiments, best-candidates).

    People get one table, a row per result and the projection's main columns; --json gives
    every column.
    """
    wanted = _parse_filters(filters or [])
    rows = run_with_ledger(
        ctx, lambda c: c.query(projection.value, wanted, limit=limit), ledger_addr, team
    )
    if as_json:
        print_json_lines(rows)
        return
    title = f"{projection.value}: {len(rows)} rows"
    if wanted:
        title += " where " + ", ".join(f"{k}={v}" for k, v in wanted.items())
    if not rows:
        console.print(title, markup=False)
        return
    table, hidden = rows_table(rows, projection.value, title=title, width=console.width)
    console.print(table)
    if hidden:
        console.print(
            f"(not shown: {', '.join(hidden)}; --json shows every column)",
            style="dim",
            markup=False,
        )


@app.command()
def replay(
    ctx: typer.Context,
    apply: Annotated[
        bool, typer.Option("--apply", help="Replace live projections that differ.")
    ] = False,
    ledger_addr: AddrOpt = None,
    team: TeamOpt = None,
    operator: OperatorOpt = "admin",
) -> None:
    """Rebuild the projections from the events and compare them with the live ones (an
    operator's call: `kiln up` issues the operator `admin`).

    Exits 1 when a projection differs and was not replaced (--apply replaces it).
    """
    response = run_with_ledger(ctx, lambda c: c.replay(apply=apply), ledger_addr, team, operator)
    console.print(replay_table(response))
    for proj in response.projections:
        for line in list(proj.differences)[:10]:
            console.print(f"  {proj.name}: {line}", markup=False)
    unresolved = [p.name for p in response.projections if not p.equal and not p.applied]
    if unresolved:
        console.print(
            f"differs: {', '.join(unresolved)} (run `kiln ledger replay --apply` to rebuild)",
            style="red",
            markup=False,
        )
        raise typer.Exit(1)
