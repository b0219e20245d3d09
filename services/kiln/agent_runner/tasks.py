"""Cancelling tasks reliably.

On Python 3.11, ``asyncio.wait_for`` returns its result when the result arrives together with
the cancellation, and the cancellation is lost (fixed in 3.12). nats-py waits that way for every
message and reply, so a single ``task.cancel()`` of a task reading NATS may not stop it;
:func:`cancel_and_wait` cancels again until the task is done.
"""

from __future__ import annotations

import asyncio
from typing import Any


async def cancel_and_wait(task: asyncio.Task[Any], retry_s: float = 1.0) -> None:
    """Cancel ``task`` (again every ``retry_s`` seconds) until it is done; its outcome
    (result, exception or cancellation) is consumed, never raised."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=retry_s)
    if not task.cancelled():
        task.exception()  # mark retrieved
