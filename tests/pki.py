"""The test session's PKI: a real CA and certificates, so every test runs over mutual TLS.

:func:`install` (called by ``tests/conftest.py`` before any test) creates the CA and the four
services' certificates in a temporary directory, points ``KILN_PKI_DIR`` at it (services in this
process and in child processes find their certificates there by role) and makes this process's
client identity :class:`TeamsOnDemand`: a channel acting for team T presents T's certificate,
issued on first use and written to the PKI (so a CLI child process with ``KILN_TEAM=T`` finds
it too). Tests that play a service (appending events as the engine pool does) pass
``tls=service_tls(...)`` explicitly.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

from kiln.common.client import set_default_client_identity
from kiln.common.identity import Principal
from kiln.common.pki import (
    CA_CERT,
    CERT,
    KEY,
    CertificateAuthority,
    ensure_deployment,
    identity_dir,
)
from kiln.common.settings import SERVICE_NAMES
from kiln.common.tls import TlsMaterial, load_material

DEFAULT_TEAM = "test-team"
"""The team of a channel that names none (health checks)."""

_dir: Path | None = None


def pki_dir() -> Path:
    """The session's PKI directory (created by :func:`install`)."""
    assert _dir is not None, "tests.pki.install() has not run"
    return _dir


@cache
def authority() -> CertificateAuthority:
    """The session's CA."""
    return CertificateAuthority.open(pki_dir())


@cache
def tls_of(principal: Principal) -> TlsMaterial:
    """``principal``'s material, issued by the session's CA on first use."""
    authority().ensure(principal)
    path = identity_dir(pki_dir(), principal)
    return load_material(path / CA_CERT, path / CERT, path / KEY, fix="tests.pki")


def service_tls(name: str) -> TlsMaterial:
    """A service's certificate (``ledger``, ``engine-pool``, ``agent-runner``, ``cost-model``)."""
    return tls_of(Principal("service", name))


def team_tls(team: str) -> TlsMaterial:
    """A team's client certificate."""
    return tls_of(Principal("team", team))


def operator_tls(name: str = "admin") -> TlsMaterial:
    """An operator's certificate."""
    return tls_of(Principal("operator", name))


class TeamsOnDemand:
    """The test process's client identity: the certificate of the team a channel acts for."""

    def material(self, team: str | None) -> TlsMaterial | None:
        """``team``'s certificate (:data:`DEFAULT_TEAM`'s for a channel without a team)."""
        return team_tls(team or DEFAULT_TEAM)


def install() -> None:
    """Create the session's PKI, export ``KILN_PKI_DIR`` and install :class:`TeamsOnDemand`."""
    global _dir
    if _dir is not None:
        return
    _dir = Path(tempfile.mkdtemp(prefix="kiln-test-pki-"))
    ensure_deployment(_dir, (*SERVICE_NAMES, "runtime-test"), teams=(DEFAULT_TEAM, "default"))
    os.environ["KILN_PKI_DIR"] = str(_dir)
    os.environ.pop("KILN_TLS", None)
    set_default_client_identity(TeamsOnDemand())


def reset_client_identity() -> None:
    """Make :class:`TeamsOnDemand` this process's client identity again."""
    set_default_client_identity(TeamsOnDemand())


def remove() -> None:
    """Delete the session's PKI directory."""
    if _dir is not None:
        shutil.rmtree(_dir, ignore_errors=True)


class ServiceLedger:
    """A ledger client for tests that write the record as kiln's services do: an append of
    ``ExperimentCompleted`` events goes as the engine pool, any other as the agent runner
    (kiln.common.policy.DEFAULT_APPEND), both acting for ``team``; reads go as the agent runner
    (every team's records), :meth:`replay` as the operator ``admin``."""

    def __init__(self, addr: str, team: str, *, timeout_s: float = 30.0) -> None:
        from kiln.ledger.client import LedgerClient

        self.addr = addr
        self.runner = LedgerClient(addr, team, timeout_s=timeout_s, tls=service_tls("agent-runner"))
        self.engine = LedgerClient(addr, team, timeout_s=timeout_s, tls=service_tls("engine-pool"))
        self.operator = LedgerClient(addr, team, timeout_s=timeout_s, tls=operator_tls())

    async def append(self, stream_id: str, events: Any, expected: Any = "any") -> Any:
        """``LedgerClient.append`` as the service that appends such events; a batch mixing the
        two services' events goes as consecutive appends, one per service (``expected`` holds
        for the first), and the result joins their positions."""
        from kiln.ledger.model import AppendResult

        runs: list[tuple[Any, list[Any]]] = []
        for event in events:
            client = self.engine if event.type == "ExperimentCompleted" else self.runner
            if runs and runs[-1][0] is client:
                runs[-1][1].append(event)
            else:
                runs.append((client, [event]))
        positions: list[int] = []
        result = None
        for i, (client, batch) in enumerate(runs):
            result = await client.append(stream_id, batch, expected if i == 0 else "any")
            positions += result.positions
        assert result is not None, "an append needs at least one event"
        return AppendResult(positions, result.stream_version, result.already_stored)

    async def replay(self, *args: Any, **kwargs: Any) -> Any:
        """``LedgerClient.replay`` as the operator."""
        return await self.operator.replay(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # read_stream, read_all, query
        return getattr(self.runner, name)

    async def close(self) -> None:
        """Close the three channels."""
        for client in (self.runner, self.engine, self.operator):
            await client.close()

    async def __aenter__(self) -> ServiceLedger:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
