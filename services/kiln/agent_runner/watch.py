"""``Compiler.Watch``: a compilation's events from the ledger, history first, then live.

The stream is the ledger's global order (``ReadAll`` with follow, from the compilation's
submission) filtered to the compilation's own events and its experiments' events; each is sent
with its payload and the compilation folded up to it. It ends after ``CompilationEnded``, or
with UNAVAILABLE when the service shuts down (watch again with ``after_position`` = the last
position received).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from kiln.agent_runner.ledger_access import LedgerPool
from kiln.agent_runner.lookup import compilation_events
from kiln.agent_runner.snapshot import WATCHED_TYPES, Snapshot
from kiln.common.errors import Unavailable
from kiln.v1 import compiler_pb2

T = TypeVar("T")


async def until_closed(source: AsyncIterator[T], closing: asyncio.Event) -> AsyncIterator[T]:
    """Items of ``source`` until it ends, or until ``closing`` is set (then raises
    :class:`Unavailable`)."""
    closed: asyncio.Future[Any] = asyncio.ensure_future(closing.wait())
    try:
        while True:
            nxt: asyncio.Future[Any] = asyncio.ensure_future(anext(source))
            waiting: set[asyncio.Future[Any]] = {nxt, closed}
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if nxt not in done:
                nxt.cancel()
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                    await nxt
                raise Unavailable("the agent runner is shutting down")
            try:
                item = nxt.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        closed.cancel()
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()


async def watch(
    ledger: LedgerPool, compilation_id: str, after_position: int, closing: asyncio.Event
) -> AsyncIterator[compiler_pb2.CompilationEvent]:
    """The events of one compilation with position > ``after_position`` (earlier ones are
    folded into the snapshot but not sent), until its ``CompilationEnded``.

    Raises:
        InvalidArgument: a malformed compilation id.
        NotFound: no such compilation.
        Unavailable: the service is shutting down, or the ledger went away; watch again with
            ``after_position`` = the last position received.
    """
    first = (await compilation_events(ledger, compilation_id))[0]
    snap = Snapshot(compilation_id)
    source = ledger.system.read_all(first.position - 1, follow=True, types=WATCHED_TYPES)
    last = after_position
    try:
        async for event in until_closed(source, closing):
            if not snap.belongs(event):
                continue
            snap.apply(event)
            if event.position > after_position:
                last = event.position
                yield snap.event(event)
            if snap.ended and event.stream_id == snap.stream_id:
                return
    except Unavailable as exc:
        raise Unavailable(f"{exc.message}; watch again with after_position={last}") from None
