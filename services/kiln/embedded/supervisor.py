"""What ``kiln up``, ``kiln down`` and ``kiln status`` do.

``up`` starts the embedded PostgreSQL and NATS (unless their URLs are set) under ``state_dir``,
records the endpoints, migrates the ledger and starts the four services, waiting until each is
healthy, then (re)starts the supervisor (``kiln supervise``, :mod:`kiln.embedded.supervise`),
which restarts any of them that dies; ``down`` stops the supervisor first, then the rest,
cleanly. Layout of ``state_dir``::

    kiln.lock               held by a running up / down (and by the supervisor restarting)
    endpoints.json          URLs, which servers are embedded, service addresses (0600: the
                            database URL carries the password)
    pki/                    the CA and certificates (unless KILN_PKI_DIR puts them elsewhere)
    postgres/               PGDATA of the embedded PostgreSQL (server.log inside, 0600)
    postgres-credentials/postgres  its superuser's password (0600; in the database URL)
    nats/                   JetStream store, pid, log and configuration of the embedded NATS
    nats/credentials/<user> the embedded NATS's passwords (mode 0600; docs/design/security.md)
    logs/<service>.log      each service's output (logs/ 0700, its files 0600)
    logs/supervisor.log     what the supervisor saw and did
    run/<service>.pid       each service's pid
    run/supervisor.pid      the supervisor's pid; run/supervisor.json its report
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast
from urllib.parse import urlsplit

from kiln.common.pki import Issued, ensure_pki
from kiln.common.settings import SERVICE_NAMES, KilnSettings, ServiceName, split_host_port
from kiln.embedded.endpoints import Endpoints
from kiln.embedded.lock import state_lock
from kiln.embedded.nats import EmbeddedNats, nats_problem
from kiln.embedded.nats_auth import NatsPasswords
from kiln.embedded.postgres import EmbeddedPostgres
from kiln.embedded.process import port_open
from kiln.embedded.services import ServiceProcess, service_env
from kiln.embedded.watchdog import WatchdogProcess

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


def addr_env_var(service: str) -> str:
    """The variable that sets ``service``'s address, e.g. ``KILN_AGENT_RUNNER_ADDR``."""
    return f"KILN_{service.replace('-', '_').upper()}_ADDR"


class Supervisor:
    """Starts, stops and reports the embedded default under ``settings.state_dir``."""

    def __init__(self, settings: KilnSettings) -> None:
        self.settings = settings
        self.state_dir = Path(settings.state_dir).expanduser().resolve()
        # Password authentication (docs/design/security.md, "PostgreSQL").
        self.postgres = EmbeddedPostgres(
            self.state_dir / "postgres",
            settings.embedded_postgres_port,
            credentials_dir=self.state_dir / "postgres-credentials",
        )
        # NATS users (docs/design/security.md, "NATS"): passwords under nats/credentials/.
        self.nats_passwords = NatsPasswords.of_state_dir(self.state_dir)
        self.nats = EmbeddedNats(
            self.state_dir / "nats",
            settings.embedded_nats_port,
            passwords=self.nats_passwords,
            prefix=settings.subject_prefix,
        )
        recorded = self.recorded()
        self.services = {name: self._service(name, recorded) for name in SERVICE_NAMES}
        self.watchdog = WatchdogProcess(self.state_dir)
        self.issued: list[Issued] = []
        """The certificates the last ``up`` issued (kiln.common.pki.ensure_pki)."""

    @property
    def endpoints_file(self) -> Path:
        """``state_dir/endpoints.json``."""
        return self.state_dir / "endpoints.json"

    def recorded(self) -> Endpoints | None:
        """What the last ``up`` recorded, if anything."""
        return Endpoints.read(self.endpoints_file)

    # ---------------------------------------------------------------------- up
    def up(self, start_services: bool = True) -> list[ComponentStatus]:
        """Start what is not running and return every component's status, holding ``kiln.lock``
        (StateDirBusy if held). RuntimeError when a server or service fails to start.
        """
        with state_lock(self.state_dir):
            return self._up(start_services)

    def _up(self, start_services: bool) -> list[ComponentStatus]:
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
        with _quiet_alembic():
            from kiln.ledger.migrate import upgrade

            upgrade(database_url)
        self.issued = ensure_pki(self.settings)  # before the services, which present them
        if start_services:
            notes.update(self._start_services(database_url, nats_url))
        started = self.watchdog.ensure(self.service_environment(database_url, nats_url))
        notes["supervisor"] = "started" if started else "already running"
        statuses = self.status()
        for row in statuses:
            row.note = notes.get(row.name, row.note)
        return statuses

    def service_environment(self, database_url: str, nats_url: str) -> dict[str, str]:
        """The environment of the services (and of the supervisor, which restarts them)."""
        env = service_env(
            dict(os.environ),
            {
                "KILN_DATABASE_URL": database_url,
                "KILN_NATS_URL": nats_url,
                "KILN_STATE_DIR": str(self.state_dir),
                **{addr_env_var(name): svc.addr for name, svc in self.services.items()},
            },
        )
        # The embedded deployment has one engine pool: it takes work for every kind its own
        # devices have (never one hardware's work on another: Submit refuses a kind no pool has).
        env.setdefault("KILN_ENGINE_HARDWARE", "*")
        return env

    def _start_services(self, database_url: str, nats_url: str) -> dict[str, str]:
        env = self.service_environment(database_url, nats_url)
        notes: dict[str, str] = {}
        to_start = []
        for name, svc in self.services.items():
            if svc.is_running():
                notes[name] = "already running"
            else:
                to_start.append(svc)
        taken = [_taken_message(svc) for svc in to_start if _answers(svc.addr)]
        taken += self._metrics_conflicts(to_start)
        if taken:
            raise RuntimeError("\n".join(taken))
        for svc in to_start:
            svc.spawn(self.env_for(svc.name, env), cwd=self.state_dir)
            notes[svc.name] = "started"

        async def wait_all() -> list[BaseException | None]:
            return await asyncio.gather(
                *(svc.wait_healthy(HEALTH_TIMEOUT_S) for svc in self.services.values()),
                return_exceptions=True,
            )

        failures = [exc for exc in asyncio.run(wait_all()) if exc is not None]
        if failures:
            for svc in to_start:
                svc.stop(timeout_s=5.0)
            raise RuntimeError("\n".join(str(exc) for exc in failures))
        return notes

    def env_for(self, service: str, env: dict[str, str]) -> dict[str, str]:
        """``env`` (:meth:`service_environment`) as ``service`` is started with it, by ``up`` and
        by the supervisor's restarts alike: with the service's NATS user on the embedded NATS (its
        password by file, so none sits in the environment); unchanged on an external NATS (the
        services then share the environment's ``KILN_NATS_*``)."""
        recorded = self.recorded()  # written by ``up`` before any service starts
        embedded = recorded.embedded.get("nats", False) if recorded else not self.settings.nats_url
        if not embedded or env.get("KILN_NATS_URL") != self.nats.url:
            return env
        own = {k: v for k, v in env.items() if k != "KILN_NATS_PASSWORD"}  # it would win
        own.update(self.nats_passwords.service_env(service))
        return own

    def _metrics_conflicts(self, to_start: list[ServiceProcess]) -> list[str]:
        """Why the services' metrics endpoints cannot start, if they cannot."""
        from kiln.common.metrics import metrics_host

        fixed = self.settings.metrics_port
        if fixed:
            return [
                f"KILN_METRICS_PORT={fixed} would give all four services the same metrics "
                "port: unset it (they use 9401..9404) or set it to 0 (off)"
            ]
        problems = []
        for svc in to_start:
            port = self.settings.service_metrics_port(cast(ServiceName, svc.name))
            if port and _answers(f"{metrics_host(svc.addr)}:{port}"):
                problems.append(
                    f"{svc.name}: metrics port {port} is already in use by another program "
                    "(another `kiln up`?); set KILN_METRICS_PORT=0 to turn the services' "
                    "metrics off, or stop that program"
                )
        return problems

    # -------------------------------------------------------------------- down
    def down(self) -> list[str]:
        """Stop the supervisor (so it restarts nothing), then the services (SIGTERM, SIGKILL
        after ``grace_period_s + 5`` s), then the embedded servers, holding ``kiln.lock``;
        return what was stopped.
        """
        if not self.state_dir.is_dir():
            return []
        supervisor = ["supervisor"] if self.watchdog.stop() else []
        with state_lock(self.state_dir):
            return supervisor + self._down()

    def _down(self) -> list[str]:
        signalled = {name: svc.stop_signal() for name, svc in self.services.items()}
        deadline = time.monotonic() + self.settings.grace_period_s + 5.0
        for name, svc in self.services.items():  # also clears stale pid files
            svc.wait_stopped(signalled[name], max(deadline - time.monotonic(), 0.0))
        stopped = [name for name, pid in signalled.items() if pid is not None]
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
        """What this state directory's ``up`` started and whether each answers at its recorded
        address (a component it did not start is never reported healthy), with what the
        supervisor says of each (restarts, a crash loop), and the supervisor itself.
        """
        recorded = self.recorded()

        async def check_all() -> list[ComponentStatus]:
            rows = [self._postgres_status(recorded), self._nats_status(recorded)]
            recorded_addrs = recorded.services if recorded is not None else {}
            rows += [
                self._service_status(svc, recorded_addrs.get(name, svc.addr))
                for name, svc in self.services.items()
            ]
            return list(await asyncio.gather(*rows))

        rows = asyncio.run(check_all())
        return [*_with_supervision(rows, self.watchdog.report()), self._supervisor_status()]

    def _supervisor_status(self) -> ComponentStatus:
        pid = self.watchdog.pid
        note = "keeps the rest alive" if pid else "not running (`kiln up` starts it)"
        return ComponentStatus("supervisor", pid, "", pid is not None, note)

    async def _postgres_status(self, recorded: Endpoints | None) -> ComponentStatus:
        if recorded is not None and not recorded.embedded.get("postgres", True):
            return await _external("postgres", recorded.database_url, _postgres_problem)
        pid = self.postgres.pid
        if pid is None:
            return _not_running("postgres", self.postgres.url, 5432)
        if recorded is None:
            self.postgres.adopt_running_port()
        url = recorded.database_url if recorded is not None else self.postgres.url
        problem = await _postgres_problem(url)
        return ComponentStatus(
            "postgres", pid, redact_url(url), problem is None, _note("embedded", problem)
        )

    async def _nats_status(self, recorded: Endpoints | None) -> ComponentStatus:
        if recorded is not None and not recorded.embedded.get("nats", True):
            try:
                credentials = self.settings.nats_credentials()
            except RuntimeError:
                credentials = None

            async def probe(url: str) -> str | None:
                return await nats_problem(url, credentials=credentials)

            return await _external("nats", recorded.nats_url, probe)
        pid = self.nats.pid
        if pid is None:
            return _not_running("nats", self.nats.url, 4222)
        if recorded is None:
            self.nats.adopt_running_port()
        url = recorded.nats_url if recorded is not None else self.nats.url
        problem = await nats_problem(url, credentials=self.nats.probe_credentials)
        return ComponentStatus("nats", pid, url, problem is None, _note("embedded", problem))

    async def _service_status(self, svc: ServiceProcess, addr: str) -> ComponentStatus:
        pid = svc.pid
        if pid is None:
            if await asyncio.to_thread(_answers, addr):
                note = f"not running (something else answers at {addr})"
            else:
                note = "not running"
            return ComponentStatus(svc.name, None, addr, False, note)
        healthy = await _healthy(addr)
        return ComponentStatus(svc.name, pid, addr, healthy, "" if healthy else "not SERVING")

    # ----------------------------------------------------------------- helpers
    def _service(self, name: str, recorded: Endpoints | None) -> ServiceProcess:
        """The service's process at the recorded address, unless ``KILN_<NAME>_ADDR`` is set and
        it is not running.
        """
        svc = ServiceProcess(
            name,
            self.settings.service_addr(cast(ServiceName, name)),
            self.state_dir / "run",
            self.state_dir / "logs",
        )
        explicit = f"{name.replace('-', '_')}_addr" in self.settings.model_fields_set
        if recorded and name in recorded.services and (not explicit or svc.is_running()):
            svc.addr = recorded.services[name]
        return svc


@contextlib.contextmanager
def _quiet_alembic() -> Iterator[None]:
    """Alembic's loggers at WARNING for the block (it logs "setup plugin ..." at INFO)."""
    logger = logging.getLogger("alembic")
    before = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(before)


def _with_supervision(
    rows: list[ComponentStatus], report: dict[str, object]
) -> list[ComponentStatus]:
    """``rows`` with the supervisor's note on each component appended (restarts, crash loop)."""
    seen = report.get("components")
    if not isinstance(seen, dict):
        return rows
    for row in rows:
        entry = seen.get(row.name)
        note = str(entry.get("note") or "") if isinstance(entry, dict) else ""
        if note:
            row.note = f"{row.note}; {note}" if row.note else note
    return rows


def _note(kind: str, problem: str | None) -> str:
    return kind if problem is None else f"{kind}: {problem}"


async def _external(
    name: str, url: str, probe: Callable[[str], Awaitable[str | None]]
) -> ComponentStatus:
    problem = await probe(url)
    return ComponentStatus(name, None, redact_url(url), problem is None, _note("external", problem))


def _not_running(name: str, url: str, default_port: int) -> ComponentStatus:
    """An embedded server that does not run; says so when something else holds its port."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or default_port
    note = "not running"
    if port_open(host, port):
        note = f"not running (something else answers at {host}:{port})"
    return ComponentStatus(name, None, redact_url(url), False, note)


def _taken_message(svc: ServiceProcess) -> str:
    return (
        f"{svc.name}: {svc.addr} is already in use by another program; set "
        f"{addr_env_var(svc.name)} to a free address (or stop that program) and run "
        "`kiln up` again"
    )


def _answers(addr: str) -> bool:
    """True when something accepts TCP connections at the gRPC address ``addr``."""
    try:
        host, port = split_host_port(addr)
    except ValueError:
        return False
    if host in ("0.0.0.0", "::", "*"):
        host = "127.0.0.1"
    return port_open(host, port)


def redact_url(url: str) -> str:
    """``url`` without a password."""
    try:
        parts = urlsplit(url)
        if parts.password:
            netloc = f"{parts.username}:***@{parts.hostname}" + (
                f":{parts.port}" if parts.port else ""
            )
            return parts._replace(netloc=netloc).geturl()
    except ValueError:
        pass
    return url


async def _postgres_problem(url: str) -> str | None:
    """None when PostgreSQL at ``url`` answers a query, else why not in a few words."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        return f"invalid URL: {redact_url(url)!r}"
    if not parsed.drivername.startswith("postgresql"):
        return f"not a PostgreSQL URL: {redact_url(url)!r}"
    conninfo = parsed.set(drivername="postgresql").render_as_string(hide_password=False)

    def probe() -> str | None:
        import psycopg

        try:
            with psycopg.connect(conninfo, connect_timeout=3) as conn:
                conn.execute("SELECT 1")
            return None
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            return f"cannot connect: {first}"

    return await asyncio.to_thread(probe)


async def _healthy(addr: str) -> bool:
    from kiln.common.client import wait_healthy

    try:
        await wait_healthy(addr, 1.0)
        return True
    except Exception:
        return False
