"""Wake-ups on commit: one LISTEN connection per ledger process fans out to every waiter.

Appends ``NOTIFY kiln_events`` in their transaction, so a notification arrives only after the
commit. Followers (ReadAll with follow, the projector) wait on :meth:`CommitNotifier.wait` with
a timeout, so a lost notification or a dropped LISTEN connection costs latency, never events.
"""

from __future__ import annotations

import asyncio

import psycopg
import structlog

log = structlog.get_logger("kiln.ledger.notifier")

CHANNEL = "kiln_events"


class CommitNotifier:
    """Broadcasts "something committed" to any number of asyncio waiters."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        """Wake every current waiter."""
        event, self._event = self._event, asyncio.Event()
        event.set()

    async def wait(self, timeout_s: float) -> None:
        """Return at the next commit notification or after ``timeout_s`` seconds."""
        try:
            await asyncio.wait_for(self._event.wait(), timeout=timeout_s)
        except TimeoutError:
            pass

    async def run(self, dsn: str, stop: asyncio.Event) -> None:
        """LISTEN on ``kiln_events`` until ``stop``; reconnects with a pause after errors.

        Args:
            dsn: libpq connection string (``kiln.ledger.db.libpq_dsn``).
        """
        while not stop.is_set():
            try:
                async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
                    await conn.execute(f"LISTEN {CHANNEL}")
                    while not stop.is_set():
                        async for _ in conn.notifies(timeout=1.0):
                            self.notify()
            except (psycopg.Error, OSError) as exc:
                log.warning("commit listener lost its connection; reconnecting", error=str(exc))
                self.notify()
                try:
                    await asyncio.wait_for(stop.wait(), timeout=1.0)
                except TimeoutError:
                    pass
