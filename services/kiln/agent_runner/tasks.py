"""Cancelling tasks reliably.

On Python 3.11, ``asyncio.wait_for`` returns its result when the result arrives together with
the cancellation, and the cancellation is lost (fixed in 3.12). nats-py waits that way for every
message and reply, so a single ``task.cancel()`` of a task reading NATS may not stop it;
:func:`cancel_and_wait` cancels again until the task is done.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")


async def cancel_and_wait(task: asyncio.Task[Any], retry_s: float = 1.0) -> None:
    """Cancel ``task`` (again every ``retry_s`` seconds) until it is done; its outcome
    (result, exception or cancellation) is consumed, never raised."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=retry_s)
    if not task.cancelled():
        task.exception()  # mark retrieved


async def unless_set(awaitable: Awaitable[T], event: asyncio.Event) -> T | None:
    """``awaitable``'s result, or None (``awaitable`` cancelled) once ``event`` is set first."""
    answer = asyncio.ensure_future(awaitable)
    stop = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({answer, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_and_wait(stop)
    if answer.done():
        return answer.result()
    await cancel_and_wait(answer)
    return None
