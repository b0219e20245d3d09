"""``kiln credentials ...``: the deployment's CA and the certificates it issues
(:mod:`kiln.common.pki`; docs/design/security.md, "Identity")."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from kiln.cli.context import settings_for
from kiln.cli.errors import CliError
from kiln.cli.render import console
from kiln.common.identity import Principal, parse_principal
from kiln.common.pki import CertificateAuthority, Issued, PkiError, ensure_pki
from kiln.common.settings import SERVICE_NAMES

app = typer.Typer(
    help="Issue and list the mTLS certificates of teams, services and operators.",
    no_args_is_help=True,
)

PkiDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--pki-dir", help="The deployment's PKI \\[env KILN_PKI_DIR; default STATE_DIR/pki]."
    ),
]


def _principal(team: str | None, operator: str | None, service: str | None) -> Principal:
    given = [(k, v) for k, v in (("team", team), ("operator", operator), ("service", service)) if v]
    if len(given) != 1:
        raise typer.BadParameter("give exactly one of --team, --operator, --service")
    kind, name = given[0]
    try:
        return parse_principal(f"spiffe://kiln/{kind}/{name}")
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint=f"--{kind}") from None


def _print(issued: list[Issued], title: str) -> None:
    table = Table("principal", "directory", "valid until", "server names", title=title)
    for i in issued:
        table.add_row(i.principal.uri, str(i.path), f"{i.not_after:%Y-%m-%d}", ", ".join(i.hosts))
    console.print(table)


@app.command()
def issue(
    ctx: typer.Context,
    team: Annotated[str | None, typer.Option(help="A team's client certificate.")] = None,
    operator: Annotated[str | None, typer.Option(help="An operator's certificate.")] = None,
    service: Annotated[
        str | None, typer.Option(help=f"A service's certificate ({', '.join(SERVICE_NAMES)}).")
    ] = None,
    host: Annotated[
        list[str] | None,
        typer.Option(help="Another DNS name or IP a service answers at (repeatable)."),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(help="Write ca.pem, cert.pem, key.pem here instead of the PKI's directory."),
    ] = None,
    pki_dir: PkiDirOpt = None,
) -> None:
    """Issue (or re-issue, with a new key) one certificate from the deployment's CA."""
    principal = _principal(team, operator, service)
    if host and principal.kind != "service":
        raise typer.BadParameter(
            "only a service certificate carries host names", param_hint="--host"
        )
    settings = settings_for(ctx, pki_dir=pki_dir)
    try:
        ca = CertificateAuthority.open(settings.pki_path)
        issued = ca.issue(principal, host or (), out_dir=out)
    except (PkiError, OSError) as exc:
        raise CliError(str(exc)) from None
    _print([issued], f"issued by the CA in {settings.pki_path}")
    console.print(
        f"clients use: KILN_TLS_CA_FILE={issued.path / 'ca.pem'} "
        f"KILN_TLS_CERT_FILE={issued.path / 'cert.pem'} "
        f"KILN_TLS_KEY_FILE={issued.path / 'key.pem'}",
        markup=False,
        soft_wrap=True,
    )


@app.command("list")
def list_(ctx: typer.Context, pki_dir: PkiDirOpt = None) -> None:
    """The certificates under the PKI directory, with their principals and expiry."""
    settings = settings_for(ctx, pki_dir=pki_dir)
    try:
        ca = CertificateAuthority.open(settings.pki_path)
    except PkiError as exc:
        raise CliError(str(exc)) from None
    _print(ca.identities(), f"CA {ca.cert.subject.rfc4514_string()} in {settings.pki_path}")


@app.command()
def init(ctx: typer.Context, pki_dir: PkiDirOpt = None) -> None:
    """Create what `kiln up` creates, where missing: the CA, the four services' certificates,
    KILN_TEAM's and the operator's (KILN_OPERATOR, default admin). For deployments whose
    services `kiln up` does not start (docker-compose's one-shot `pki` service runs this)."""
    settings = settings_for(ctx, pki_dir=pki_dir)
    if settings.tls == "off":
        raise CliError("KILN_TLS=off: no certificates are needed")
    try:
        issued = ensure_pki(settings)
    except (PkiError, OSError) as exc:
        raise CliError(str(exc)) from None
    if issued:
        _print(issued, f"issued in {settings.pki_path}")
    else:
        console.print(f"{settings.pki_path}: every certificate is there already", markup=False)
