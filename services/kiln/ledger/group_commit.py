"""Group commit: many concurrent appends share one transaction and one WAL flush.

The committer drains the appends waiting (up to ``max_group``) and in one transaction takes the
advisory lock, decides each append (idempotent retry, AlreadyExists, Aborted or accepted, seeing
earlier appends of the group), inserts events and outbox rows, notifies and commits. A rejected
append writes nothing and does not disturb the others; a failed commit stores none of the group.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

import structlog
from prometheus_client import Histogram
from sqlalchemy import func, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from kiln.common.errors import Aborted, AlreadyExists, InvalidArgument, KilnError, Unavailable
from kiln.ledger.model import AppendResult, ExpectedVersion
from kiln.ledger.tables import events, outbox

log = structlog.get_logger("kiln.ledger.group_commit")

APPEND_LOCK_KEY = 0x6B696C6E01
"""pg_advisory_xact_lock key serialising position assignment (b'kiln' + 1)."""

GROUP_SIZE = Histogram(
    "kiln_ledger_group_commit_appends",
    "Appends per group-commit transaction",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)


@dataclass
class PendingAppend:
    """One validated append waiting for its group (rows lack position, stream id and version)."""

    stream_id: str
    rows: list[dict[str, Any]]
    expected: ExpectedVersion
    future: asyncio.Future[AppendResult] = field(repr=False)


@dataclass
class _Stored:
    """An event id already decided: stored (``position``) or accepted earlier in the group
    (``slot``).
    """

    stream_id: str
    type: str
    data: Any
    position: int | None = None
    slot: int | None = None


class GroupCommitter:
    """Single writer task that commits queued appends in groups of at most ``max_group``."""

    def __init__(self, engine: AsyncEngine, max_group: int = 256) -> None:
        self.engine = engine
        self.max_group = max_group
        self._queue: asyncio.Queue[PendingAppend] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    async def submit(
        self, stream_id: str, rows: list[dict[str, Any]], expected: ExpectedVersion
    ) -> AppendResult:
        """Queue one append and wait for its group; raises its own KilnError or the commit's
        error.
        """
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="kiln-ledger-group-commit")
        future: asyncio.Future[AppendResult] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(PendingAppend(stream_id, rows, expected, future))
        return await asyncio.shield(future)

    async def close(self) -> None:
        """Stop the writer; appends still queued fail with ``Unavailable``."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        while not self._queue.empty():
            pending = self._queue.get_nowait()
            if not pending.future.done():
                pending.future.set_exception(Unavailable("the ledger is shutting down; retry"))

    async def _run(self) -> None:
        while True:
            group = [await self._queue.get()]
            while len(group) < self.max_group and not self._queue.empty():
                group.append(self._queue.get_nowait())
            try:
                await self._commit_group(group)
            except asyncio.CancelledError:
                for pending in group:
                    if not pending.future.done():
                        pending.future.set_exception(
                            Unavailable("the ledger is shutting down; retry")
                        )
                raise

    async def _commit_group(self, group: list[PendingAppend]) -> None:
        """Commit ``group`` in one transaction, else each append alone."""
        try:
            async with self.engine.begin() as conn:
                outcomes = await self._commit(conn, group)
        except Exception as exc:
            if len(group) == 1:
                log.warning("append failed", stream_id=group[0].stream_id, error=str(exc))
                if not group[0].future.done():
                    group[0].future.set_exception(_as_kiln_error(exc, group[0].stream_id))
                return
            log.warning(
                "group commit failed; committing its appends one by one",
                appends=len(group),
                error=str(exc),
            )
            for pending in group:
                await self._commit_group([pending])
            return
        GROUP_SIZE.observe(len(group))
        for pending, outcome in zip(group, outcomes, strict=True):
            if pending.future.done():
                continue
            if isinstance(outcome, KilnError):
                pending.future.set_exception(outcome)
            else:
                pending.future.set_result(outcome)

    async def _commit(
        self, conn: AsyncConnection, group: list[PendingAppend]
    ) -> list[AppendResult | KilnError]:
        await conn.execute(select(func.pg_advisory_xact_lock(APPEND_LOCK_KEY)))
        ids = [row["event_id"] for p in group for row in p.rows]
        stored = {
            str(r.event_id): _Stored(r.stream_id, r.type, r.data, position=r.position)
            for r in await conn.execute(
                select(
                    events.c.event_id,
                    events.c.position,
                    events.c.stream_id,
                    events.c.type,
                    events.c.data,
                ).where(events.c.event_id.in_(ids))
            )
        }
        versions: dict[str, int] = {p.stream_id: 0 for p in group}
        for r in await conn.execute(
            select(events.c.stream_id, func.max(events.c.stream_version))
            .where(events.c.stream_id.in_(list(versions)))
            .group_by(events.c.stream_id)
        ):
            versions[r[0]] = int(r[1])

        accepted: list[dict[str, Any]] = []
        decisions: list[list[_Stored] | KilnError | tuple[int, int]] = []
        for pending in group:
            try:
                prior = _prior(pending, stored)
                if prior is not None:
                    decisions.append(prior)
                    continue
                current = versions[pending.stream_id]
                check_expected(pending.stream_id, current, pending.expected)
            except KilnError as exc:
                decisions.append(exc)
                continue
            first = len(accepted)
            for i, row in enumerate(pending.rows):
                version = current + i + 1
                accepted.append({**row, "stream_id": pending.stream_id, "stream_version": version})
                stored[row["event_id"]] = _Stored(
                    pending.stream_id, row["type"], row["data"], slot=first + i
                )
            versions[pending.stream_id] = current + len(pending.rows)
            decisions.append((first, len(pending.rows)))

        positions: list[int] = []
        if accepted:
            positions = sorted(
                (
                    await conn.execute(
                        text("SELECT nextval('events_position_seq') FROM generate_series(1, :n)"),
                        {"n": len(accepted)},
                    )
                ).scalars()
            )
            for row, pos in zip(accepted, positions, strict=True):
                row["position"] = pos
            await conn.execute(events.insert(), accepted)
            await conn.execute(outbox.insert(), [{"position": p} for p in positions])
            await conn.execute(
                text("SELECT pg_notify('kiln_events', :p), pg_notify('kiln_outbox', :p)"),
                {"p": str(positions[-1])},
            )

        outcomes: list[AppendResult | KilnError] = []
        for pending, decision in zip(group, decisions, strict=True):
            if isinstance(decision, KilnError):
                outcomes.append(decision)
            elif isinstance(decision, tuple):
                first, n = decision
                outcomes.append(
                    AppendResult(
                        positions[first : first + n],
                        accepted[first + n - 1]["stream_version"],
                        already_stored=False,
                    )
                )
            else:
                found = [
                    s.position if s.position is not None else positions[s.slot or 0]
                    for s in decision
                ]
                outcomes.append(AppendResult(found, versions[pending.stream_id], True))
        return outcomes


def _as_kiln_error(exc: Exception, stream_id: str) -> Exception:
    """A constraint violation of one append as Aborted (a writer outside the lock won); anything
    else unchanged.
    """
    if isinstance(exc, IntegrityError):
        return Aborted(f"concurrent append to {stream_id!r} lost: {exc.orig}")
    return exc


def _prior(pending: PendingAppend, stored: dict[str, _Stored]) -> list[_Stored] | None:
    """The earlier copies of an exact retry, None for a new append; AlreadyExists for a partial
    retry or an id reused with other content.
    """
    found = [stored.get(row["event_id"]) for row in pending.rows]
    if not any(found):
        return None
    if not all(found):
        some = next(row["event_id"] for row, f in zip(pending.rows, found, strict=True) if f)
        raise AlreadyExists(
            f"part of this batch was stored before (e.g. event {some}); "
            "a retry must repeat the original batch exactly"
        )
    out: list[_Stored] = []
    for row, old in zip(pending.rows, found, strict=True):
        assert old is not None
        if old.stream_id != pending.stream_id or old.type != row["type"] or old.data != row["data"]:
            where = f"position {old.position}" if old.position is not None else "this group"
            raise AlreadyExists(
                f"event id {row['event_id']} is already stored at {where} in stream "
                f"{old.stream_id!r} as {old.type} with other content"
            )
        out.append(old)
    return out


def check_expected(stream_id: str, current: int, expected: ExpectedVersion) -> None:
    """Raise Aborted unless a stream at version ``current`` satisfies ``expected``;
    InvalidArgument for a malformed expectation."""
    if expected == "any":
        return
    if expected == "no_stream" or expected == 0:
        ok, want = current == 0, "no stream"
    elif expected == "stream_exists":
        ok, want = current > 0, "an existing stream"
    elif isinstance(expected, int) and expected > 0:
        ok, want = current == expected, f"version {expected}"
    else:
        raise InvalidArgument(f"invalid expected version {expected!r}")
    if not ok:
        raise Aborted(
            f"wrong expected version for stream {stream_id!r}: expected {want}, "
            f"but the stream is at version {current}"
        )
