"""What ``kiln up``, ``kiln down`` and ``kiln status`` do.

``up`` starts the embedded PostgreSQL (unless ``KILN_DATABASE_URL`` is set) and NATS (unless
``KILN_NATS_URL`` is set) under ``state_dir``, records the endpoints, migrates the ledger's
database and starts the four services as detached processes, then waits until each is healthy.
``down`` stops the services (SIGTERM, then SIGKILL) and then the embedded servers, cleanly, so
their data survives. Layout of ``state_dir``::

    endpoints.json          URLs, which servers are embedded, service addresses
    postgres/               PGDATA of the embedded PostgreSQL (log: postgres/server.log)
    nats/                   JetStream store, pid and log of the embedded NATS
    logs/<service>.log      each service's stdout and stderr
    run/<service>.pid       each service's pid
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path
from typing import cast
from urllib.parse import urlsplit

from kiln.common.settings import SERVICE_NAMES, KilnSettings, ServiceName
from kiln.embedded.endpoints import Endpoints
from kiln.embedded.nats import EmbeddedNats
from kiln.embedded.postgres import EmbeddedPostgres
from kiln.embedded.process import port_open
from kiln.embedded.services import ServiceProcess, service_env

HEALTH_TIMEOUT_S = 60.0
"""How long ``up`` waits for each service to report healthy."""


@dataclass
class ComponentStatus:
    """One row of ``kiln status`` / the report of ``kiln up``."""

    name: str
    pid: int | None
    address: str
    healthy: bool
    note: str = ""


class Supervisor:
    """Starts, stops and reports the embedded default under ``settings.state_dir``."""

    def __init__(self, settings: KilnSettings) -> None:
        self.settings = settings
        self.state_dir = Path(settings.state_dir).expanduser().resolve()
        self.postgres = EmbeddedPostgres(
            self.state_dir / "postgres", settings.embedded_postgres_port
        )
        self.nats = EmbeddedNats(self.state_dir / "nats", settings.embedded_nats_port)
        self.services = {name: self._service(name) for name in SERVICE_NAMES}

    @property
    def endpoints_file(self) -> Path:
        """``state_dir/endpoints.json``."""
        return self.state_dir / "endpoints.json"

    def recorded(self) -> Endpoints | None:
        """What the last ``up`` recorded, if anything."""
        return Endpoints.read(self.endpoints_file)

    # ---------------------------------------------------------------------- up
    def up(self, start_services: bool = True) -> list[ComponentStatus]:
        """Start what is not running; return the status of every component.

        Raises RuntimeError (with log tails) when a server or service fails to start.
        """
        from kiln.ledger.migrate import upgrade

        self.state_dir.mkdir(parents=True, exist_ok=True)
        notes: dict[str, str] = {}
        database_url = self.settings.database_url
        if not database_url:
            notes["postgres"] = "already running" if self.postgres.is_running() else "started"
            database_url = self.postgres.start()
        nats_url = self.settings.nats_url
        if not nats_url:
            notes["nats"] = "already running" if self.nats.is_running() else "started"
            nats_url = self.nats.start()
        Endpoints(
            nats_url=nats_url,
            database_url=database_url,
            embedded={
                "postgres": not self.settings.database_url,
                "nats": not self.settings.nats_url,
            },
            services={name: svc.addr for name, svc in self.services.items()},
        ).write(self.endpoints_file)
        upgrade(database_url)
        if start_services:
            notes.update(self._start_services(database_url, nats_url))
        statuses = self.status()
        for row in statuses:
            row.note = notes.get(row.name, row.note)
        return statuses

    def _start_services(self, database_url: str, nats_url: str) -> dict[str, str]:
        env = service_env(
            dict(os.environ),
            {
                "KILN_DATABASE_URL": database_url,
                "KILN_NATS_URL": nats_url,
                "KILN_STATE_DIR": str(self.state_dir),
                **{
                    f"KILN_{name.replace('-', '_').upper()}_ADDR": svc.addr
                    for name, svc in self.services.items()
                },
            },
        )
        notes: dict[str, str] = {}
        started: list[ServiceProcess] = []
        for name, svc in self.services.items():
            if svc.is_running():
                notes[name] = "already running"
                continue
            svc.spawn(env, cwd=self.state_dir)
            started.append(svc)
            notes[name] = "started"

        async def wait_all() -> list[BaseException | None]:
            return await asyncio.gather(
                *(svc.wait_healthy(HEALTH_TIMEOUT_S) for svc in self.services.values()),
                return_exceptions=True,
            )

        failures = [exc for exc in asyncio.run(wait_all()) if exc is not None]
        if failures:
            for svc in started:
                svc.stop(timeout_s=5.0)
            raise RuntimeError("\n".join(str(exc) for exc in failures))
        return notes

    # -------------------------------------------------------------------- down
    def down(self) -> list[str]:
        """Stop the services, then the embedded servers; return what was stopped."""
        stopped: list[str] = []
        running = [svc for svc in self.services.values() if svc.stop_signal() is not None]
        grace = self.settings.grace_period_s + 5.0
        for svc in self.services.values():
            svc.stop(timeout_s=grace)  # also clears stale pid files
        stopped.extend(svc.name for svc in running)
        if self.nats.is_running():
            self.nats.stop()
            stopped.append("nats")
        if self.postgres.is_running():
            self.postgres.stop()
            stopped.append("postgres")
        self.endpoints_file.unlink(missing_ok=True)
        return stopped

    # ------------------------------------------------------------------ status
    def status(self) -> list[ComponentStatus]:
        """The backing servers' and services' pids, addresses and health."""
        recorded = self.recorded()
        rows = [
            self._server_status(
                "postgres", self.postgres.pid, self.settings.database_url, recorded,
                self.postgres.url,
            ),
            self._server_status(
                "nats", self.nats.pid, self.settings.nats_url, recorded, self.nats.url
            ),
        ]  # fmt: skip

        async def check_all() -> list[bool]:
            return list(await asyncio.gather(*(_healthy(s.addr) for s in self.services.values())))

        health = asyncio.run(check_all())
        for svc, healthy in zip(self.services.values(), health, strict=True):
            pid = svc.pid
            rows.append(
                ComponentStatus(svc.name, pid, svc.addr, healthy, "" if pid else "not running")
            )
        return rows

    # ----------------------------------------------------------------- helpers
    def _service(self, name: str) -> ServiceProcess:
        addr = self.settings.service_addr(cast(ServiceName, name))
        recorded = self.recorded()
        explicit = f"{name.replace('-', '_')}_addr" in self.settings.model_fields_set
        if recorded and name in recorded.services and not explicit:
            addr = recorded.services[name]
        return ServiceProcess(name, addr, self.state_dir / "run", self.state_dir / "logs")

    def _server_status(
        self,
        name: str,
        pid: int | None,
        configured: str | None,
        recorded: Endpoints | None,
        embedded_url: str,
    ) -> ComponentStatus:
        recorded_url = None
        if recorded is not None:
            recorded_url = recorded.database_url if name == "postgres" else recorded.nats_url
        if not configured and recorded is not None and not recorded.embedded.get(name, True):
            configured = recorded_url  # `up` ran against an external server
        if configured:
            return ComponentStatus(
                name, None, redact_url(configured), _reachable(configured), "external"
            )
        if pid is None:
            return ComponentStatus(name, None, redact_url(embedded_url), False, "not running")
        url = recorded_url or embedded_url
        return ComponentStatus(name, pid, redact_url(url), _reachable(url), "embedded")


def redact_url(url: str) -> str:
    """``url`` without a password."""
    parts = urlsplit(url)
    if parts.password:
        netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
        return parts._replace(netloc=netloc).geturl()
    return url


def _reachable(url: str) -> bool:
    """True when the host and port of ``url`` accept TCP connections."""
    parts = urlsplit(url)
    default = 4222 if parts.scheme.startswith("nats") else 5432
    try:
        return port_open(parts.hostname or "127.0.0.1", parts.port or default)
    except ValueError:
        return False


async def _healthy(addr: str) -> bool:
    from kiln.common.client import wait_healthy

    try:
        await wait_healthy(addr, 1.0)
        return True
    except Exception:
        return False
