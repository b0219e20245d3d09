"""The supervisor's loop (``kiln supervise``) and its handle for ``kiln up`` / ``down`` /
``status``.

:class:`Watchdog` looks at every component twice a second. One that should run (``wanted``) and
does not is restarted on :class:`~kiln.embedded.restarts.Restarts`' schedule, holding the state
directory's lock (``kiln up`` and ``down`` hold it too, so they never race a restart; while one
runs, the restart waits for the next look). After each look it writes its report,
``run/supervisor.json``, which ``kiln status`` reads. Why our own loop and not supervisord or
systemd: docs/design/security.md, "Recovery".

:class:`WatchdogProcess` starts the loop as a detached process (pid ``run/supervisor.pid``, log
``logs/supervisor.log``), stops it, and reads its report.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.embedded.lock import StateDirBusy
from kiln.embedded.private import open_private_log
from kiln.embedded.process import process_alive, read_pid, wait_gone
from kiln.embedded.restarts import RestartPolicy, Restarts
from kiln.embedded.services import supervisor_line

POLL_S = 0.5
"""Seconds between two looks at the components."""
MARKER = "kiln supervise"
"""Text in the supervisor's command line (tells it apart from a process with a reused pid)."""


@dataclass
class Component:
    """Something the supervisor keeps alive.

    Attributes:
        name: as ``kiln status`` names it. wanted: whether it should run now (``kiln up``
            started it and ``kiln down`` did not stop it). alive: whether it runs. start:
            start it (may block until it is up; raises when it cannot start). ended: how its
            last run ended, as far as the supervisor can tell.
    """

    name: str
    wanted: Callable[[], bool]
    alive: Callable[[], bool]
    start: Callable[[], None]
    ended: Callable[[], str] = lambda: "exited"


@dataclass
class Watchdog:
    """Keeps ``components`` alive (in order: servers before the services that need them).

    Args:
        components: what to watch. lock: the state directory's lock, tried without waiting
            (raises StateDirBusy). report_path: where each look's report goes (None: nowhere).
        log: one line per event (JSON lines, the services' format). policy: the restart
            schedule. clock: monotonic seconds.
    """

    components: list[Component]
    lock: Callable[[], AbstractContextManager[None]]
    report_path: Path | None = None
    log: Callable[[str], None] = lambda line: None
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    clock: Callable[[], float] = time.monotonic
    restarts: dict[str, Restarts] = field(init=False)
    reset_requested: bool = False
    """Set (e.g. by a signal handler) to forget every crash loop at the next look."""

    def __post_init__(self) -> None:
        self.restarts = {c.name: Restarts(self.policy) for c in self.components}

    def run(self, stopping: Callable[[], bool], poll_s: float = POLL_S) -> None:
        """Look every ``poll_s`` until ``stopping()``."""
        self._event("supervisor", "supervising", components=[c.name for c in self.components])
        while not stopping():
            self.look()
            deadline = time.monotonic() + poll_s
            while not stopping() and time.monotonic() < deadline:
                time.sleep(min(0.05, poll_s))
        self._event("supervisor", "stopped supervising")

    def look(self) -> None:
        """One look: restart what is due, then write the report."""
        if self.reset_requested:
            self.reset_requested = False
            for restarts in self.restarts.values():
                restarts.reset()
            self._event("supervisor", "crash loops forgotten (kiln up ran)")
        for component in self.components:
            self._look_at(component)
        self.write_report()

    def _look_at(self, c: Component) -> None:
        r = self.restarts[c.name]
        if not c.wanted():
            r.up_since = r.retry_at = None
            return
        if c.alive():
            r.running(self.clock())
            return
        if r.died(self.clock(), c.ended()):
            if r.gave_up:
                self._event(c.name, "crash loop", level="error", why=r.gave_up)
            else:
                pause = (r.retry_at or 0.0) - self.clock()
                self._event(c.name, "died", how=r.last_exit, restart_in_s=round(pause, 2))
        if not r.due(self.clock()):
            return
        try:
            with self.lock():
                if not c.wanted() or c.alive():  # `kiln up` / `down` acted meanwhile
                    return
                self._event(c.name, "restarting", attempt=r.in_a_row + 1)
                started = self.clock()
                try:
                    c.start()
                except Exception as exc:
                    r.restarted(started)
                    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                    r.died(self.clock(), f"restart failed: {first}")
                    self._event(c.name, "restart failed", level="warning", error=first)
                    return
                r.restarted(started)
                self._event(c.name, "restarted", took_s=round(self.clock() - started, 2))
        except StateDirBusy:
            return  # `kiln up` or `kiln down` runs: look again next time

    def report(self) -> dict[str, Any]:
        """What ``kiln status`` shows: per component, restarts and a note."""
        now = self.clock()
        return {
            "pid": os.getpid(),
            "components": {
                name: {
                    "restarts": r.total,
                    "crash_loop": bool(r.gave_up),
                    "note": r.describe(now),
                }
                for name, r in self.restarts.items()
            },
        }

    def write_report(self) -> None:
        """Write :meth:`report` atomically to ``report_path``."""
        if self.report_path is None:
            return
        tmp = self.report_path.with_suffix(".tmp")
        with contextlib.suppress(OSError):
            tmp.write_text(json.dumps(self.report()) + "\n")
            os.replace(tmp, self.report_path)

    def _event(self, name: str, event: str, level: str = "info", **fields: Any) -> None:
        self.log(supervisor_line(name, event, level, **fields))


class WatchdogProcess:
    """The ``kiln supervise`` process of one state directory."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.pid_file = state_dir / "run" / "supervisor.pid"
        self.report_path = state_dir / "run" / "supervisor.json"
        self.log_path = state_dir / "logs" / "supervisor.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """Its pid when it runs, else None."""
        pid = read_pid(self.pid_file)
        return pid if process_alive(pid, MARKER) else None

    def ensure(self, env: dict[str, str]) -> bool:
        """Start ``python -m kiln supervise`` detached, with ``env`` (what it gives the services
        it restarts), unless it runs; one running is told (SIGHUP) to forget its crash loops
        and keeps the environment it was started with. True when it was started."""
        pid = self.pid
        if pid is not None:
            if self.report_path.exists():  # written after its signal handlers are in place
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGHUP)
            return False
        self.pid_file.parent.mkdir(parents=True, exist_ok=True)
        self.report_path.unlink(missing_ok=True)
        with open_private_log(self.log_path) as log:
            self._proc = proc = subprocess.Popen(
                [sys.executable, "-m", "kiln", "supervise", "--state-dir", str(self.state_dir)],
                env=env,
                cwd=str(self.state_dir),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        self.pid_file.write_text(f"{proc.pid}\n")
        return True

    def stop(self, timeout_s: float = 90.0) -> bool:
        """SIGTERM it and wait until it exited (it finishes a restart under way first; SIGKILL
        after ``timeout_s``); True when one was running."""
        pid = self.pid
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            if not wait_gone(pid, timeout_s):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                wait_gone(pid, 5.0)
        if self._proc is not None:  # reap our own child
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=1)
            self._proc = None
        self.pid_file.unlink(missing_ok=True)
        self.report_path.unlink(missing_ok=True)
        return pid is not None

    def report(self) -> dict[str, Any]:
        """Its last report ({} when there is none or it does not run)."""
        if self.pid is None:
            return {}
        try:
            data = json.loads(self.report_path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}
