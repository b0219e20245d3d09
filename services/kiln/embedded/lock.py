"""The state directory's lock: one ``kiln up`` / ``kiln down`` at a time per ``state_dir``.

An exclusive ``flock`` on ``state_dir/kiln.lock``; the holder writes its pid there so a second
caller can say who holds it. The kernel drops the lock when the holder exits, however it exits,
so a stale file never blocks anyone.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

from kiln.embedded.process import read_pid

LOCK_NAME = "kiln.lock"
LOCK_WAIT_S = 3.0
"""How long a second ``kiln up`` / ``kiln down`` waits for the first before giving up."""


class StateDirBusy(RuntimeError):
    """Another process holds the state directory's lock."""


@contextlib.contextmanager
def state_lock(state_dir: Path, wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
    """Hold the exclusive lock of ``state_dir`` (created if missing) for the block.

    Raises:
        StateDirBusy: another process held it for all of ``wait_s`` seconds; the message
            names the state directory and that process's pid.
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = read_pid(path)
                    raise StateDirBusy(
                        f"another kiln up/down is running for {state_dir} "
                        f"(pid {holder if holder is not None else '?'})"
                    ) from None
                time.sleep(0.1)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
