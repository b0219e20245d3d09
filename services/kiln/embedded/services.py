"""One kiln service (``kiln serve NAME``) run as a detached process with a pid file and a log."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kiln.embedded.process import log_tail, process_alive, read_pid, terminate


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
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S%z')} starting {self.name}\n".encode())
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

    def stop_signal(self) -> int | None:
        """Send SIGTERM (graceful shutdown) if running; returns the pid signalled."""
        pid = self.pid
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)  # the caller waits via stop()
        return pid

    def stop(self, timeout_s: float) -> None:
        """Stop the service: SIGTERM, wait up to ``timeout_s``, then SIGKILL; drop the pid
        file."""
        pid = self.pid
        if pid is not None:
            terminate(pid, timeout_s=timeout_s)
        if self._proc is not None:  # reap our own child
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=1)
        self.pid_file.unlink(missing_ok=True)

    def _failure(self, what: str) -> RuntimeError:
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=0.2)
        return RuntimeError(
            f"service {self.name} {what}\n--- {self.log_path} ---\n{log_tail(self.log_path)}"
        )


def service_env(base: dict[str, str], updates: dict[str, str]) -> dict[str, str]:
    """The environment of a service process: ``base`` plus ``updates``, without variables that
    would make the four services collide (one shared listen address)."""
    env = {k: v for k, v in base.items() if k != "KILN_LISTEN_ADDR"}
    env.update(updates)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env
