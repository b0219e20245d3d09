"""Waiting out the ledger or NATS being away (docs/design/security.md, "Recovery").

A compilation's runner calls the ledger (appends, reads) and NATS (work, the board) at every
step. When one of them is down — restarting, PostgreSQL behind the ledger restarting — the call
is tried again with growing, jittered pauses until it answers, instead of failing an agent,
closing an experiment as timed out or ending the compilation: an outage is nobody's result.
Nothing bounds the wait but the compilation itself (its wall clock cancels the search; its end
waits until the ledger can record it). Errors that are answers (refused, conflict, bad input)
come back at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors
import nats.js.errors

from kiln.common.backoff import backoff_s
from kiln.common.errors import DeadlineExceeded, Unavailable
from kiln.common.logging import get_logger

log = get_logger("kiln.agent_runner.outage")

T = TypeVar("T")

MAX_PAUSE_S = 5.0
"""Longest pause between two tries, seconds (a service restarts in a few)."""

_OUTAGES: tuple[type[BaseException], ...] = (
    Unavailable,  # the ledger (or its database) cannot be reached
    DeadlineExceeded,  # a call that got no answer in time: its outcome is retried idempotently
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,  # JetStream not (yet) answering
    nats.errors.StaleConnectionError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.FlushTimeoutError,
    nats.errors.OutboundBufferLimitError,  # reconnecting, its buffer full
    nats.js.errors.ServiceUnavailableError,
    OSError,
    TimeoutError,
)


def is_outage(exc: BaseException) -> bool:
    """True when ``exc`` says the ledger or NATS is away (try again later), not that the call
    was refused; a NATS connection closed by this process (shutting down) is not an outage."""
    if isinstance(exc, nats.errors.ConnectionClosedError):
        return False
    return isinstance(exc, _OUTAGES)


async def ride_out(call: Callable[[], Awaitable[T]], *, what: str, compilation: str = "") -> T:
    """``await call()``, tried again after each outage (:func:`is_outage`) until it answers;
    other errors, and cancellation, at once. ``call`` must be safe to repeat (kiln's appends
    carry deterministic event ids, its publishes message ids)."""
    failures = 0
    while True:
        try:
            result = await call()
        except Exception as exc:
            if not is_outage(exc):
                raise
            failures += 1
            if failures == 1 or failures % 10 == 0:
                log.warning(
                    "waiting out an outage",
                    call=what,
                    compilation=compilation or None,
                    failures=failures,
                    error=str(exc) or repr(exc),
                )
            await asyncio.sleep(backoff_s(failures, first_s=0.2, max_s=MAX_PAUSE_S))
            continue
        if failures:
            log.info("outage over", call=what, compilation=compilation or None, failures=failures)
        return result
