"""State the root command hands to subcommands: global options and the resulting settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import typer

from kiln.common.client import RoleIdentity, set_default_client_identity
from kiln.common.settings import KilnSettings, ServiceName, load_settings
from kiln.common.tls import client_principal
from kiln.embedded.endpoints import Endpoints


@dataclass
class CliState:
    """Global options (``kiln --team T --ledger-addr A ...``); None = from the environment."""

    team: str | None = None
    ledger_addr: str | None = None


def state(ctx: typer.Context) -> CliState:
    """The global options of this invocation."""
    root = ctx.find_root()
    if not isinstance(root.obj, CliState):
        root.obj = CliState()
    return root.obj


def settings_for(ctx: typer.Context, **overrides: Any) -> KilnSettings:
    """Settings from the environment, the global options, then ``overrides`` (None = unset).
    The command's calls present the certificate of its team (or ``KILN_OPERATOR``) by these
    settings (kiln.common.tls), read when the first call is made."""
    opts = state(ctx)
    given: dict[str, Any] = {"team": opts.team, "ledger_addr": opts.ledger_addr}
    given.update({k: v for k, v in overrides.items() if v is not None})
    settings = load_settings(**given)
    set_default_client_identity(RoleIdentity(settings, client_principal(settings)))
    return settings


def service_addr(settings: KilnSettings, service: ServiceName) -> str:
    """The address to dial for ``service``: its ``KILN_*_ADDR`` (or flag) when given, else the
    one the last ``kiln up`` recorded, else the default."""
    field = service.replace("-", "_") + "_addr"
    if field not in settings.model_fields_set:
        recorded = Endpoints.read(settings.endpoints_file)
        if recorded is not None and recorded.services.get(service):
            return recorded.services[service]
    return settings.service_addr(service)


def ledger_addr(settings: KilnSettings) -> str:
    """The ledger address to dial (see :func:`service_addr`)."""
    return service_addr(settings, "ledger")
