"""One kiln service (``kiln serve NAME``) run as a detached process with a pid file and a log."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kiln.embedded.private import open_private_log
from kiln.embedded.process import describe_exit, log_tail, process_alive, read_pid, wait_gone

SUPERVISOR_LOGGER = "kiln.supervisor"
"""The ``logger`` of the lines the supervisor itself writes into a service's log."""


def supervisor_line(service: str, event: str, level: str = "info", **fields: Any) -> str:
    """One JSON log line (the services' own key order) that the supervisor writes into a
    service's log (or its own), so the file stays one JSON object per line."""
    stamp = datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")
    record = {
        "timestamp": stamp,
        "level": level,
        "service": service,
        "logger": SUPERVISOR_LOGGER,
        "event": event,
        **fields,
    }
    return json.dumps(record, default=str) + "\n"


def last_run_lines(text: str) -> list[str]:
    """The lines of a service log since the supervisor last started the service."""
    lines = text.rstrip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if SUPERVISOR_LOGGER in lines[i] and '"starting service"' in lines[i]:
            return lines[i + 1 :]
    return lines


def failure_summary(lines: list[str]) -> str | None:
    """The error a service logged before it exited (``kiln serve`` logs a failure as a JSON
    line with ``level`` ``error``, or prints ``error: ...``), or None when there is none."""
    for line in reversed(lines):
        if line.startswith("error: "):
            return line[len("error: ") :]
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("level") in ("error", "critical"):
            detail = record.get("error") or record.get("event")
            return str(detail)
    return None


class ServiceProcess:
    """The process of service ``name``: pid in ``run_dir/<name>.pid``, output appended to
    ``log_dir/<name>.log``, reachable at ``addr``."""

    def __init__(self, name: str, addr: str, run_dir: Path, log_dir: Path) -> None:
        self.name = name
        self.addr = addr
        self.pid_file = run_dir / f"{name}.pid"
        self.log_path = log_dir / f"{name}.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def marker(self) -> str:
        """Text in the service's command line that tells it apart from other processes."""
        return f"kiln serve {self.name}"

    @property
    def pid(self) -> int | None:
        """The pid when the service runs; None otherwise (a stale pid file reads as None)."""
        pid = read_pid(self.pid_file)
        return pid if process_alive(pid, self.marker) else None

    def is_running(self) -> bool:
        """True when the service process is alive."""
        return self.pid is not None

    def spawn(self, env: dict[str, str], cwd: Path) -> int:
        """Start ``python -m kiln serve NAME`` in its own session; returns its pid."""
        self.pid_file.parent.mkdir(parents=True, exist_ok=True)
        with open_private_log(self.log_path) as log:  # every team's ids and errors: 0600
            log.write(supervisor_line(self.name, "starting service", addr=self.addr).encode())
            log.flush()
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "kiln", "serve", self.name],
                env=env,
                cwd=str(cwd),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        self.pid_file.write_text(f"{self._proc.pid}\n")
        return self._proc.pid

    async def wait_healthy(self, timeout_s: float) -> None:
        """Wait until the service answers gRPC health checks as SERVING.

        Raises RuntimeError (with the tail of its log) when the process exits first or
        ``timeout_s`` passes.
        """
        from kiln.common.client import wait_healthy

        deadline = time.monotonic() + timeout_s
        last = ""
        while True:
            if not self.is_running():
                raise self._failure("exited")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._failure(f"not healthy at {self.addr} after {timeout_s:g}s ({last})")
            try:
                await wait_healthy(self.addr, min(1.0, remaining))
                return
            except TimeoutError as exc:
                last = str(exc)
            await asyncio.sleep(0)

    def ended(self) -> str:
        """How its last run ended: the exit status when this process started it, else
        "exited" (a process started by another ``kiln up`` is not our child)."""
        if self._proc is not None and self._proc.poll() is not None:
            return describe_exit(self._proc.returncode)
        return "exited"

    def stop_signal(self) -> int | None:
        """Send SIGTERM (graceful shutdown) if running; returns the pid signalled. Follow with
        :meth:`wait_stopped` (signalling again would only log "shutdown already in
        progress")."""
        pid = self.pid
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        return pid

    def wait_stopped(self, pid: int | None, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for ``pid`` (signalled by :meth:`stop_signal`) to exit,
        SIGKILL it only then; reap our own child and drop the pid file."""
        if pid is not None and not wait_gone(pid, timeout_s):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            wait_gone(pid, 5.0)
        if self._proc is not None:  # reap our own child
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=1)
            self._proc = None
        self.pid_file.unlink(missing_ok=True)

    def stop(self, timeout_s: float) -> None:
        """Stop the service: SIGTERM once, wait up to ``timeout_s``, then SIGKILL; drop the pid
        file."""
        self.wait_stopped(self.stop_signal(), timeout_s)

    def _failure(self, what: str) -> RuntimeError:
        """A short error: what happened, the error the service logged (else the tail of
        this run's log), and where the log is."""
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=0.2)
        lines = last_run_lines(log_tail(self.log_path, lines=200))
        logged = failure_summary(lines)
        if logged:
            return RuntimeError(f"service {self.name} {what}: {logged} (log: {self.log_path})")
        tail = "\n".join(lines[-10:])
        return RuntimeError(f"service {self.name} {what}\n--- {self.log_path} ---\n{tail}")


_SHARED_BY_MISTAKE = (
    "KILN_LISTEN_ADDR",
    "KILN_TLS_CA_FILE",
    "KILN_TLS_CERT_FILE",
    "KILN_TLS_KEY_FILE",
)


def service_env(base: dict[str, str], updates: dict[str, str]) -> dict[str, str]:
    """The environment of a service process: ``base`` plus ``updates``, without variables that
    would make the four services collide (one shared listen address, one certificate: each
    presents its own from the PKI)."""
    env = {k: v for k, v in base.items() if k not in _SHARED_BY_MISTAKE}
    env.update(updates)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env
