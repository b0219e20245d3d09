"""``kiln dashboard`` (the web page, :mod:`kiln.dashboard`) and ``kiln compilations report ID``
(one self-contained HTML file, optionally PNG plots). Both read through the Compiler,
Deployments and Ledger APIs as this invocation's team. Bad input: one line, exit 2 (usage) or
1 (the compilation is not found, no browser for ``--png``)."""

from __future__ import annotations

import asyncio
import os
import secrets
from pathlib import Path
from typing import Annotated

import typer

from kiln.cli.context import ledger_addr, service_addr, settings_for
from kiln.cli.errors import USAGE, CliError, err_console
from kiln.common.errors import KilnError, NotFound
from kiln.dashboard.access import Access, is_loopback
from kiln.dashboard.server import DEFAULT_LISTEN, parse_listen, serve
from kiln.dashboard.source import Source


def _source(ctx: typer.Context) -> Source:
    settings = settings_for(ctx)
    return Source(settings, service_addr(settings, "agent-runner"), ledger_addr(settings))


def _token(token_file: Path | None) -> str:
    if token_file is not None:
        try:
            token = token_file.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise CliError(f"--token-file {token_file}: {exc.strerror or exc}", USAGE) from None
        return token
    return os.environ.get("KILN_DASHBOARD_TOKEN", "").strip()


def dashboard(
    ctx: typer.Context,
    listen: Annotated[
        str,
        typer.Option(help="HOST:PORT to serve on (loopback by default; port 0 = any free)."),
    ] = DEFAULT_LISTEN,
    token_file: Annotated[
        Path | None,
        typer.Option(
            help="File holding the page's access token [env KILN_DASHBOARD_TOKEN]; required "
            "off loopback (one is generated and printed when neither is given)."
        ),
    ] = None,
) -> None:
    """Serve the web dashboard: compilations, live best-so-far per agent, experiments,
    baselines, the board, deployments; what this team may see."""
    try:
        host, port = parse_listen(listen)
    except ValueError as exc:
        raise CliError(str(exc), USAGE) from None
    token = _token(token_file)
    if not token and not is_loopback(host):
        token = secrets.token_urlsafe(24)
        err_console.print(f"dashboard token (the page asks for it): {token}", markup=False)
    try:
        access = Access(host, token, port)
    except ValueError as exc:
        where = "--token-file" if token_file is not None else "KILN_DASHBOARD_TOKEN"
        raise CliError(f"{where}: {exc}", USAGE) from None
    source = _source(ctx)

    def ready(url: str) -> None:
        err_console.print(
            f"kiln dashboard for team {source.settings.team} at {url} (Ctrl-C stops it)",
            markup=False,
        )

    try:
        asyncio.run(serve(source, access, port, ready))
    except OSError as exc:
        raise CliError(f"cannot listen on {listen}: {exc.strerror or exc}") from None


def report(
    ctx: typer.Context,
    compilation_id: Annotated[str, typer.Argument(help="The compilation's id.")],
    out: Annotated[Path, typer.Option("--out", help="The HTML file to write.")],
    png: Annotated[
        Path | None,
        typer.Option("--png", help="Also write the plots as PNG into this directory (chromium)."),
    ] = None,
) -> None:
    """One self-contained HTML report of a compilation (inline SVG and CSS, no script, no
    external asset) for sharing; ``--png DIR`` adds the plots as PNG."""
    from kiln.dashboard.compilation_page import plot_svg, report_html
    from kiln.dashboard.png import PngUnavailable, find_browser, write_pngs

    if out.is_dir():
        raise CliError(f"--out {out}: is a directory; name the HTML file", USAGE)
    if png is not None and find_browser() is None:
        raise CliError(
            "--png needs a headless chromium (apt-get install chromium, or set KILN_CHROMIUM)"
        )
    source = _source(ctx)

    async def go() -> tuple[str, str]:
        async with source:
            view = await source.compilation(compilation_id, board=True)
            return report_html(view), plot_svg(view)

    try:
        html, svg = asyncio.run(go())
    except NotFound as exc:
        raise CliError(f"NOT_FOUND: {exc.message}") from None
    except KilnError:
        raise
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(html, encoding="utf-8")
    except OSError as exc:
        raise CliError(f"--out {out}: {exc.strerror or exc}") from None
    typer.echo(f"wrote {out} ({len(html):,} bytes)")
    if png is not None:
        try:
            paths = write_pngs({"best_so_far": svg}, png)
        except PngUnavailable as exc:
            raise CliError(str(exc)) from None
        for p in paths:
            typer.echo(f"wrote {p}")
