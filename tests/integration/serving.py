"""Serving a ServiceApp in the test's event loop on a free port; a command run beside it."""

from __future__ import annotations

import asyncio
import os
import sys

from kiln.common.server import serve
from kiln.common.settings import KilnSettings

from ..unit.runtime_app import free_port


async def serve_in_task(app: object, cfg: KilnSettings) -> tuple[asyncio.Task[None], str]:
    """Start ``app`` with :func:`kiln.common.server.serve` on ``127.0.0.1:<free port>`` as a task
    of the running loop; returns the task and the address once it listens (20 s at most).

    Raises:
        TimeoutError: the server did not start within 20 s.
    """
    addr, started = f"127.0.0.1:{free_port()}", asyncio.Event()
    task = asyncio.create_task(
        serve(app, cfg, listen=addr, started=started, handle_signals=False)  # type: ignore[arg-type]
    )
    await asyncio.wait_for(started.wait(), 20)
    return task, addr


async def run_command(
    *argv: str, timeout_s: float = 120.0, env: dict[str, str] | None = None
) -> tuple[int, str]:
    """``argv`` run as a child process with this Python (``("-m", "kiln", ...)`` is the CLI),
    ``env`` over this process's environment; its exit code and its stdout then stderr.

    A child process, not a thread of this one: the client inside would run gRPC's asyncio
    support in a second event loop beside the servers of this one, which gRPC does not support
    (a server's shutdown then hangs now and then)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *argv,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, out.decode() + err.decode()
