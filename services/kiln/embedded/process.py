"""Small helpers for the detached processes the embedded default runs: ports, pid files,
liveness, termination and log tails."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from pathlib import Path

import psutil


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it by binding port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_open(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """True when something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def read_pid(path: Path) -> int | None:
    """The pid in the first line of ``path``, or None when the file is missing or garbled."""
    try:
        first = path.read_text().split("\n", 1)[0].strip()
        return int(first)
    except (OSError, ValueError):
        return None


def process_alive(pid: int | None, cmdline_contains: str = "") -> bool:
    """True when ``pid`` runs (not a zombie) and, if given, its command line contains the text.

    The command-line check guards against a stale pid file whose pid was reused by another
    program.
    """
    if not pid:
        return False
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        if cmdline_contains:
            cmdline = proc.cmdline()
            for _ in range(20):  # empty while the process is between fork and exec: wait it out
                if cmdline:
                    break
                time.sleep(0.005)
                cmdline = proc.cmdline()
            return cmdline_contains in " ".join(cmdline)
        return True
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def wait_gone(pid: int, timeout_s: float) -> bool:
    """Wait until ``pid`` is gone (or a zombie); True if it went within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not process_alive(pid):
            return True
        time.sleep(0.05)
    return not process_alive(pid)


def terminate(pid: int, timeout_s: float = 10.0, sig: int = signal.SIGTERM) -> None:
    """Send ``sig`` (default SIGTERM) to ``pid``, wait up to ``timeout_s``, then SIGKILL."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
    if wait_gone(pid, timeout_s):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    wait_gone(pid, 5.0)


def describe_exit(code: int | None) -> str:
    """``exited with status 3`` / ``killed by SIGKILL`` / ``exited`` (status unknown)."""
    if code is None:
        return "exited"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def log_tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a log file ("" when it cannot be read)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])
