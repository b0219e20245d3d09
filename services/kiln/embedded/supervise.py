"""``kiln supervise``: the process ``kiln up`` leaves behind to keep what it started alive.

It watches, in this order, the embedded PostgreSQL and NATS (when ``endpoints.json`` says
``kiln up`` runs them) and each service whose pid file ``kiln up`` wrote (``kiln down`` removes
them), and restarts any that died (:class:`~kiln.embedded.watchdog.Watchdog`). Its environment
is the one ``kiln up`` gave the services, so a restarted service gets the same settings. SIGTERM
or SIGINT stop it after the restart under way, if any; SIGHUP (``kiln up`` again) makes it
forget its crash loops.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from types import FrameType
from urllib.parse import urlsplit

from kiln.common.settings import KilnSettings
from kiln.embedded.lock import state_lock
from kiln.embedded.services import ServiceProcess
from kiln.embedded.supervisor import Supervisor
from kiln.embedded.watchdog import Component, Watchdog, WatchdogProcess


def components(supervisor: Supervisor, env: dict[str, str]) -> list[Component]:
    """The embedded servers and the services of ``supervisor``'s state directory, as the
    watchdog sees them; services are restarted with ``env``."""

    def embedded(name: str) -> bool:
        recorded = supervisor.recorded()
        return recorded is not None and recorded.embedded.get(name, False)

    def start_postgres() -> None:
        recorded = supervisor.recorded()
        if recorded is not None:
            supervisor.postgres.port = _port(recorded.database_url, supervisor.postgres.port)
        supervisor.postgres.start()

    def start_nats() -> None:
        recorded = supervisor.recorded()
        if recorded is not None:
            supervisor.nats.port = _port(recorded.nats_url, supervisor.nats.port)
        supervisor.nats.start()

    found = [
        Component(
            "postgres",
            lambda: embedded("postgres"),
            supervisor.postgres.is_running,
            start_postgres,
        ),
        Component("nats", lambda: embedded("nats"), supervisor.nats.is_running, start_nats),
    ]
    for svc in supervisor.services.values():
        found.append(
            Component(svc.name, svc.pid_file.exists, svc.is_running, _spawner(svc, env, supervisor))
        )
        found[-1].ended = svc.ended
    return found


def _spawner(
    svc: ServiceProcess, env: dict[str, str], supervisor: Supervisor
) -> Callable[[], None]:
    def spawn() -> None:
        recorded = supervisor.recorded()
        if recorded is not None and svc.name in recorded.services:
            svc.addr = recorded.services[svc.name]
        svc.spawn(supervisor.env_for(svc.name, env), cwd=supervisor.state_dir)

    return spawn


def _port(url: str, default: int) -> int:
    """The port a recorded URL names (``default`` when it names none)."""
    try:
        return urlsplit(url.split(",")[0]).port or default
    except ValueError:
        return default


def supervise(settings: KilnSettings, env: dict[str, str]) -> None:
    """Run the watchdog of ``settings.state_dir`` until SIGTERM / SIGINT."""
    supervisor = Supervisor(settings)
    handle = WatchdogProcess(supervisor.state_dir)
    stop: list[int] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.append(signum)

    def log(line: str) -> None:
        sys.stdout.write(line)
        sys.stdout.flush()

    watchdog = Watchdog(
        components(supervisor, env),
        lock=lambda: state_lock(supervisor.state_dir, wait_s=0),
        report_path=handle.report_path,
        log=log,
    )

    def on_hangup(_signum: int, _frame: FrameType | None) -> None:
        watchdog.reset_requested = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_hangup)
    watchdog.run(lambda: bool(stop))
