"""The outbox publisher: every committed event reaches JetStream exactly once, in position order
(why: docs/design/ledger.md, "Outbox").

The append transaction inserts the events and one ``outbox`` row each, then ``NOTIFY kiln_outbox``.
One publisher per database (session advisory lock :data:`LOCK_KEY`) reads the outbox joined to
``events`` in position order, publishes each to ``{prefix}.events.{category}.{stream_id}.{type}``
with ``Nats-Msg-Id`` = event id, waits for each PubAck, then deletes the rows. Rows at or below the
*watermark* (the stream's last ``Kiln-Position``) are skipped. A row is never deleted
unacknowledged; NATS down raises :class:`kiln.common.errors.Unavailable` and ``run`` retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from datetime import UTC
from typing import Any, Final

import nats.errors
import nats.js.errors
import structlog
from nats.js import JetStreamContext
from prometheus_client import Counter, Gauge, Histogram
from sqlalchemy import func, select, text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from kiln.common import nats as kn
from kiln.common.errors import InvalidArgument, Unavailable
from kiln.ledger.model import StoredEvent
from kiln.ledger.store import row_to_event
from kiln.ledger.tables import events, outbox

log = structlog.get_logger(__name__)

NOTIFY_CHANNEL: Final = "kiln_outbox"
IDLE_POLL_STEPS: Final = 3
"""Doublings of the poll interval while the outbox stays empty (0.2 s -> 1.6 s by default)."""
"""The channel the append transaction notifies (payload: its last position)."""
LOCK_KEY: Final = 0x6B696C6E_6F757462
"""``pg_try_advisory_lock`` key electing the one publisher per database ("kilnoutb")."""

PUBLISHED = Counter("kiln_outbox_published", "Events published to JetStream by the outbox")
SKIPPED = Counter(
    "kiln_outbox_skipped", "Outbox rows deleted without publishing (already on the stream)"
)
PENDING = Gauge("kiln_outbox_pending", "Outbox rows waiting to be published (after the last pass)")
LEADER = Gauge("kiln_outbox_leader", "1 while this process is the database's outbox publisher")
PUBLISH_SECONDS = Histogram(
    "kiln_outbox_publish_seconds",
    "Time from publishing one event to its JetStream PubAck, seconds",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)

_NATS_ERRORS = (nats.errors.Error, TimeoutError, OSError)


class PublishFailed(Unavailable):
    """A pass stopped at a row it could not publish; ``done``: the positions before it now on the
    stream (deleted; the rest stay).
    """

    def __init__(self, message: str, done: list[int]) -> None:
        super().__init__(message)
        self.done = list(done)


def event_headers(event: StoredEvent) -> dict[str, str]:
    """The message headers of ``event``: ``Nats-Msg-Id`` = event id and the ``Kiln-*`` headers (null
    or empty metadata left out).
    """
    recorded = event.recorded_at
    if recorded.tzinfo is None:
        recorded = recorded.replace(tzinfo=UTC)
    h = {
        kn.MSG_ID: str(event.event_id),
        kn.H_POSITION: str(event.position),
        kn.H_STREAM_ID: event.stream_id,
        kn.H_STREAM_VERSION: str(event.stream_version),
        kn.H_EVENT_TYPE: event.type,
        kn.H_SCHEMA_VERSION: str(event.schema_version),
        kn.H_RECORDED_AT: recorded.astimezone(UTC).isoformat(),
    }
    for key, name in (
        (kn.H_TEAM, "team"),
        (kn.H_CORRELATION_ID, "correlation_id"),
        (kn.H_CAUSATION_ID, "causation_id"),
    ):
        value = (event.metadata or {}).get(name)
        if value not in (None, ""):
            h[key] = str(value)
    return h


def event_body(event: StoredEvent) -> bytes:
    """The message body: the event data as compact UTF-8 JSON."""
    return json.dumps(event.data, separators=(",", ":"), ensure_ascii=False).encode()


class OutboxPublisher:
    """Publishes the ledger's outbox to the JetStream events stream (module doc).

    Args:
        engine: the ledger database.
        js: a JetStream context; the events stream must exist
            (:func:`kiln.common.nats.ensure_streams`).
        prefix: the subject prefix (``settings.subject_prefix``).
        poll_interval_s: longest wait for a NOTIFY before looking anyway, seconds; doubled after
            each empty pass, up to :data:`IDLE_POLL_STEPS` doublings.
        lock_retry_s: how often a non-leader tries to lead, seconds.
        ack_timeout_s: longest wait for one PubAck, seconds.
        max_backoff_s: longest pause after a failed pass, seconds.
        use_watermark: skip rows at or below the stream's last ``Kiln-Position`` (False, tests only:
            the duplicate window is the only guard).
    """

    def __init__(
        self,
        engine: AsyncEngine,
        js: JetStreamContext,
        prefix: str = "kiln",
        *,
        poll_interval_s: float = 0.2,
        lock_retry_s: float = 2.0,
        ack_timeout_s: float = 5.0,
        max_backoff_s: float = 5.0,
        use_watermark: bool = True,
    ) -> None:
        self._engine = engine
        self._js = js
        self._prefix = prefix
        self._stream = kn.events_stream_name(prefix)
        self._poll_interval_s = poll_interval_s
        self._lock_retry_s = lock_retry_s
        self._ack_timeout_s = ack_timeout_s
        self._max_backoff_s = max_backoff_s
        self._use_watermark = use_watermark
        self._watermark: int | None = None  # None = not read from the stream yet
        self._leader = False

    # --- state -------------------------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        """True while this publisher holds the database's outbox lock (inside :meth:`run`)."""
        return self._leader

    @property
    def watermark(self) -> int:
        """Highest position found on the stream by the last :meth:`sync_watermark` (0 before); not
        advanced while publishing.
        """
        return self._watermark or 0

    # --- one pass ------------------------------------------------------------------------
    async def sync_watermark(self) -> int:
        """Read the highest published position back: the stream's last message's ``Kiln-Position``
        if the database holds that position with the same event id, else 0.

        Raises:
            Unavailable: JetStream did not answer.
        """
        if not self._use_watermark:
            self._watermark = 0
            return 0
        try:
            info = await self._js.stream_info(self._stream)
            msg = None
            if info.state.messages > 0 and info.state.last_seq > 0:
                with contextlib.suppress(nats.js.errors.NotFoundError):
                    msg = await self._js.get_msg(self._stream, seq=info.state.last_seq)
        except _NATS_ERRORS as exc:
            raise Unavailable(f"cannot read the events stream {self._stream}: {exc!r}") from exc
        mark = 0
        pos = kn.header(msg.headers if msg else None, kn.H_POSITION)
        event_id = kn.header(msg.headers if msg else None, kn.MSG_ID)
        if pos and pos.isdigit() and event_id:
            async with self._engine.connect() as conn:
                stored = await conn.scalar(
                    select(events.c.event_id).where(events.c.position == int(pos))
                )
            if stored is not None and str(stored) == event_id:
                mark = int(pos)
            else:
                log.warning(
                    "outbox.watermark_mismatch",
                    stream=self._stream,
                    position=pos,
                    event_id=event_id,
                    stored=stored,
                )
        self._watermark = mark
        log.info("outbox.watermark", stream=self._stream, position=mark)
        return mark

    async def fetch_pending(self, limit: int = 500) -> list[StoredEvent]:
        """The events of the first ``limit`` outbox rows, in position order."""
        stmt = (
            select(events)
            .select_from(outbox.join(events, outbox.c.position == events.c.position))
            .order_by(outbox.c.position)
            .limit(limit)
        )
        async with self._engine.connect() as conn:
            return [row_to_event(r) for r in await conn.execute(stmt)]

    async def publish(self, rows: list[StoredEvent]) -> list[int]:
        """Publish ``rows`` in order, one PubAck at a time, skipping rows at or below the watermark;
        deletes nothing; stops at the first failure.

        Returns:
            The positions now on the stream (acknowledged or skipped), in order.

        Raises:
            PublishFailed: NATS or JetStream failed (or a row cannot be published); ``done`` holds
                the positions handled before.
            Unavailable: the watermark could not be read (nothing was sent).
        """
        if self._watermark is None:
            await self.sync_watermark()
        done: list[int] = []
        for row in rows:
            if self._use_watermark and row.position <= self.watermark:
                SKIPPED.inc()
                done.append(row.position)
                continue
            try:
                subject = kn.events_subject(self._prefix, row.stream_id, row.type)
            except InvalidArgument as exc:  # cannot happen for validated appends; never drop it
                log.error("outbox.unpublishable", position=row.position, error=exc.message)
                raise PublishFailed(f"position {row.position}: {exc.message}", done) from exc
            started = time.perf_counter()
            try:
                ack = await self._js.publish(
                    subject,
                    event_body(row),
                    timeout=self._ack_timeout_s,
                    stream=self._stream,
                    headers=event_headers(row),
                )
            except _NATS_ERRORS as exc:
                msg = f"publishing position {row.position} to {subject}: {exc!r}"
                raise PublishFailed(msg, done) from exc
            PUBLISH_SECONDS.observe(time.perf_counter() - started)
            PUBLISHED.inc()
            if ack.duplicate:
                log.info("outbox.duplicate", position=row.position, event_id=row.event_id)
            done.append(row.position)
        return done

    async def delete(self, positions: list[int]) -> None:
        """Delete these outbox rows (their events are on the stream)."""
        if not positions:
            return
        async with self._engine.begin() as conn:
            await conn.execute(outbox.delete().where(outbox.c.position.in_(positions)))

    async def pending_count(self) -> int:
        """Rows in the outbox now."""
        async with self._engine.connect() as conn:
            n = await conn.scalar(select(func.count()).select_from(outbox))
        return int(n or 0)

    async def publish_pending(self, limit: int = 500) -> int:
        """One pass: publish up to ``limit`` outbox rows in order, then delete them. Safe without
        :meth:`run`.

        Returns:
            How many rows left the outbox (published, duplicate, or already on the stream).

        Raises:
            Unavailable: NATS failed mid-pass; rows acknowledged before it are deleted, the rest
                stay.
        """
        rows = await self.fetch_pending(limit)
        if not rows:
            PENDING.set(0)
            return 0
        try:
            done = await self.publish(rows)
        except PublishFailed as exc:
            await self.delete(exc.done)
            PENDING.set(await self.pending_count())
            raise
        except Unavailable:
            PENDING.set(await self.pending_count())
            raise
        await self.delete(done)
        PENDING.set(await self.pending_count() if len(rows) >= limit else 0)
        return len(done)

    # --- the loop -------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event, *, batch: int = 500) -> None:
        """Publish until ``stop`` is set: elect a leader, then drain on NOTIFY or every poll. Never
        raises for NATS or database outages (logs, backs off, retries); releases the lock on return.
        """
        failures = 0
        while not stop.is_set():
            conn: AsyncConnection | None = None
            try:
                conn = await self._try_lock()
                if conn is None:
                    await _wait(stop, self._lock_retry_s)
                    continue
                failures = 0
                await self._lead(conn, stop, batch)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # DB or NATS trouble: step down, back off, retry
                failures += 1
                log.warning("outbox.step_down", error=repr(exc), failures=failures)
                await _wait(stop, self._backoff(failures))
            finally:
                await self._release(conn)

    async def _try_lock(self) -> AsyncConnection | None:
        conn = await self._engine.connect()
        try:
            conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
            got = await conn.scalar(text("SELECT pg_try_advisory_lock(:k)"), {"k": LOCK_KEY})
        except BaseException:
            await conn.close()
            raise
        if not got:
            await conn.close()
            return None
        return conn

    async def _release(self, conn: AsyncConnection | None) -> None:
        if self._leader:
            log.info("outbox.leader_lost", stream=self._stream)
        self._leader = False
        LEADER.set(0)
        if conn is None:
            return
        # The lock and the LISTEN belong to the session: discard the connection instead of
        # returning it to the pool still holding them.
        with contextlib.suppress(Exception):
            await conn.invalidate()
        with contextlib.suppress(Exception):
            await conn.close()

    async def _lead(self, conn: AsyncConnection, stop: asyncio.Event, batch: int) -> None:
        raw = await conn.get_raw_connection()
        pg = raw.driver_connection
        assert pg is not None
        await pg.execute(f"LISTEN {NOTIFY_CHANNEL}")
        self._leader = True
        LEADER.set(1)
        log.info("outbox.leader", stream=self._stream)
        self._watermark = None  # another leader may have published since we last looked
        failures = idle = 0
        while not stop.is_set():
            try:
                n = await self.publish_pending(batch)
                failures = 0
            except (Unavailable, SQLAlchemyError) as exc:
                failures += 1
                log.warning("outbox.pass_failed", error=str(exc), failures=failures)
                await _wait(stop, self._backoff(failures))
                continue
            idle = idle + 1 if n == 0 else 0
            if n < batch:
                timeout = self._poll_interval_s * 2 ** min(idle, IDLE_POLL_STEPS)
                await self._wait_notify(pg, stop, timeout)

    async def _wait_notify(self, pg: Any, stop: asyncio.Event, timeout_s: float) -> None:
        """Return on a NOTIFY, on ``stop`` or after ``timeout_s``; raises if the session died."""

        async def notified() -> None:
            gen = pg.notifies(timeout=timeout_s, stop_after=1)
            async with contextlib.aclosing(gen):
                async for _ in gen:
                    break

        waiter = asyncio.create_task(notified())
        stopper = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            if not waiter.done():
                waiter.cancel()  # only on stop; the connection is discarded right after
            await asyncio.gather(waiter, stopper, return_exceptions=True)
        if not waiter.cancelled() and waiter.exception() is not None:
            raise waiter.exception()  # type: ignore[misc]

    def _backoff(self, failures: int) -> float:
        return float(min(self._max_backoff_s, 0.1 * 2 ** min(failures, 10)))


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)
