"""Services as real child processes (``python -m kiln serve NAME``) for end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from kiln.common.client import wait_healthy

from ..pki import team_tls


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServiceProcess:
    """One ``kiln serve NAME`` process: start, wait healthy, SIGKILL, stop.

    Args:
        name: "ledger", "engine-pool", "agent-runner" or "cost-model".
        addr: host:port it listens on.
        env: its environment (URLs, prefix, the other services' addresses).
        log_path: stdout and stderr are appended here (shown when it fails to start).
    """

    def __init__(self, name: str, addr: str, env: dict[str, str], log_path: Path) -> None:
        self.name, self.addr, self.env, self.log_path = name, addr, env, log_path
        self.proc: subprocess.Popen[bytes] | None = None

    async def start(self, timeout_s: float = 60.0) -> None:
        """Start and wait until its readiness is SERVING. Raises AssertionError with the log."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kiln", "serve", self.name, "--listen", self.addr],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            await wait_healthy(self.addr, timeout_s=timeout_s)
        except TimeoutError:
            raise AssertionError(f"{self.name} did not start:\n{self.log_tail()}") from None

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        """SIGTERM and wait (SIGKILL after 20 s)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def log_tail(self, chars: int = 4000) -> str:
        """The end of its log."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def service_env(
    database_url: str, nats_url: str, prefix: str, state_dir: Path, addrs: dict[str, str]
) -> dict[str, str]:
    """The environment every service of one test deployment shares (and the CLI run beside it,
    as team ``e2e``, whose certificate this issues into the session's PKI)."""
    team_tls("e2e")
    # KILN_PKI_DIR stays: the session's certificates (tests/pki.py)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_") or k == "KILN_PKI_DIR"}
    env.update(
        KILN_DATABASE_URL=database_url,
        KILN_NATS_URL=nats_url,
        KILN_SUBJECT_PREFIX=prefix,
        KILN_STATE_DIR=str(state_dir),
        KILN_METRICS_PORT="0",
        KILN_TEAM="e2e",
    )
    for name, addr in addrs.items():
        env[f"KILN_{name.upper().replace('-', '_')}_ADDR"] = addr
    return env
