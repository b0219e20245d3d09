"""Serving a ServiceApp in the test's event loop on a free loopback port."""

from __future__ import annotations

import asyncio

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
