"""Following the ledger's published events: a consumer of the events stream the outbox fills
(``{prefix}.events.{category}.{stream_id}.{event_type}``, :mod:`kiln.ledger.outbox`).

:class:`EventsFeed` is an ordered, ephemeral JetStream consumer (deleted on exit; nothing durable
stays on the server) over one subject filter; it yields each event once as a
:class:`PublishedEvent`, in stream order. Who uses it and why: docs/design/ledger.md, "Outbox".
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Final, Literal

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy

from kiln.common import nats as kn
from kiln.common.errors import InvalidArgument, NotFound, Unavailable
from kiln.events.registry import event_categories
from kiln.ledger.model import StoredEvent

Start = int | Literal["all", "new"]
"""Where a feed begins: ``"new"`` (events published after it subscribed), ``"all"`` (the first
event the stream retains) or a stream sequence (that message on, inclusive; from 1)."""

REMEMBER: Final = 100_000
"""Event ids a feed remembers to drop copies (a few MB); an older copy is yielded again."""

_REQUIRED: Final = (
    kn.MSG_ID,
    kn.H_POSITION,
    kn.H_STREAM_ID,
    kn.H_STREAM_VERSION,
    kn.H_EVENT_TYPE,
    kn.H_SCHEMA_VERSION,
    kn.H_RECORDED_AT,
)
_NATS_ERRORS = (nats.errors.Error, TimeoutError, OSError)


@dataclass(frozen=True)
class PublishedEvent:
    """One event read from the events stream: its JetStream stream ``sequence`` (from 1; what
    :data:`Start` takes to resume) and the ``event`` as the ledger recorded it (``metadata``: team,
    correlation_id, causation_id, None when not published)."""

    sequence: int
    event: StoredEvent


def events_subject_filter(
    prefix: str,
    category: str | None = None,
    stream_id: str | None = None,
    event_type: str | None = None,
) -> str:
    """The subject filter of the events of ``category``, ``stream_id`` and ``event_type`` (None =
    any), e.g. ``kiln.events.experiment.*.ExperimentCompleted``.

    Raises:
        InvalidArgument: a malformed value (:func:`kiln.common.nats.events_filter`), a category or
            event type no registered event has, or a type that belongs to another category.
    """
    subject = kn.events_filter(
        prefix, category=category, stream_id=stream_id, event_type=event_type
    )
    categories = event_categories()
    if event_type is not None and event_type not in categories:
        known = ", ".join(sorted(categories))
        raise InvalidArgument(f"unknown event type {event_type!r} (known: {known})")
    wanted = category or (stream_id.partition("-")[0] if stream_id else None)
    if wanted is not None:
        known_categories = sorted(set(categories.values()))
        if wanted not in known_categories:
            raise InvalidArgument(
                f"unknown category {wanted!r} (known: {', '.join(known_categories)})"
            )
        if event_type is not None and categories[event_type] != wanted:
            raise InvalidArgument(
                f"{event_type} events are in '{categories[event_type]}-*' streams, "
                f"not in category {wanted!r}"
            )
    return subject


def decode(msg: Msg) -> PublishedEvent:
    """The event a message of the events stream carries (headers as
    :func:`kiln.ledger.outbox.event_headers` writes them, body its data as JSON).

    Raises:
        InvalidArgument: not a JetStream message, a missing or malformed header, or a body that
            is not a JSON object.
    """
    try:
        sequence = msg.metadata.sequence.stream
    except nats.errors.Error:
        raise InvalidArgument(f"message on {msg.subject} is not from a stream") from None
    where = f"message {sequence} on {msg.subject} is not a ledger event"
    h = msg.headers or {}
    missing = [k for k in _REQUIRED if not h.get(k)]
    if missing:
        raise InvalidArgument(f"{where}: no {', '.join(missing)} header")
    try:
        data = json.loads(msg.data)
        if not isinstance(data, dict):
            raise ValueError("its data is not a JSON object")
        event = StoredEvent(
            position=int(h[kn.H_POSITION]),
            stream_id=h[kn.H_STREAM_ID],
            stream_version=int(h[kn.H_STREAM_VERSION]),
            event_id=h[kn.MSG_ID],
            type=h[kn.H_EVENT_TYPE],
            schema_version=int(h[kn.H_SCHEMA_VERSION]),
            data=data,
            metadata={
                "team": h.get(kn.H_TEAM),
                "correlation_id": h.get(kn.H_CORRELATION_ID),
                "causation_id": h.get(kn.H_CAUSATION_ID),
            },
            recorded_at=datetime.fromisoformat(h[kn.H_RECORDED_AT]),
        )
    except ValueError as exc:  # bad JSON, UTF-8, number or time
        raise InvalidArgument(f"{where}: {exc}") from None
    return PublishedEvent(sequence, event)


class EventsFeed:
    """The published events of one subject filter, each event id once, in stream order::

        async with EventsFeed(js, prefix, category="experiment", start="all") as feed:
            async for published in feed:  # never ends by itself
                ...

    Args:
        js: a JetStream context.
        prefix: the subject prefix (``settings.subject_prefix``).
        category, stream_id, event_type: the filter (:func:`events_subject_filter`).
        start: where to begin (:data:`Start`).
        remember: how many recent event ids are kept to drop copies (the outbox may publish an
            event twice across a crash).

    Raises:
        InvalidArgument: constructing, a bad filter or start; iterating, a message that is not a
            ledger event (:func:`decode`).
        NotFound: entering, ``prefix`` has no events stream.
        Unavailable: entering, JetStream did not answer.
    """

    def __init__(
        self,
        js: JetStreamContext,
        prefix: str,
        *,
        category: str | None = None,
        stream_id: str | None = None,
        event_type: str | None = None,
        start: Start = "new",
        remember: int = REMEMBER,
    ) -> None:
        self.subject = events_subject_filter(prefix, category, stream_id, event_type)
        if isinstance(start, bool) or not (
            start in ("all", "new") or (isinstance(start, int) and start >= 1)
        ):
            raise InvalidArgument(
                f"invalid start {start!r}: expected 'all', 'new' or a sequence >= 1"
            )
        self._js = js
        self._stream = kn.events_stream_name(prefix)
        self._start = start
        self._remember = max(1, remember)
        self._seen: dict[str, None] = {}  # insertion-ordered: the oldest id goes first
        self._sub: JetStreamContext.PushSubscription | None = None
        self.duplicates = 0
        """Copies dropped so far."""

    async def __aenter__(self) -> EventsFeed:
        config = ConsumerConfig()
        if self._start == "new":
            policy = DeliverPolicy.NEW
        elif self._start == "all":
            policy = DeliverPolicy.ALL
        else:
            policy = DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = int(self._start)
        try:
            self._sub = await self._js.subscribe(
                self.subject,
                stream=self._stream,
                config=config,
                deliver_policy=policy,
                ordered_consumer=True,
            )
        except nats.js.errors.NotFoundError:
            raise NotFound(f"no events stream {self._stream}") from None
        except _NATS_ERRORS as exc:
            raise Unavailable(f"cannot subscribe to {self.subject}: {exc!r}") from exc
        return self

    async def __aexit__(self, *exc: object) -> None:
        sub, self._sub = self._sub, None
        if sub is None:
            return
        # NATS gone: the server drops an ephemeral consumer without interest by itself.
        with contextlib.suppress(*_NATS_ERRORS):
            name = (await sub.consumer_info()).name
            await sub.unsubscribe()
            await self._js.delete_consumer(self._stream, name)

    def __aiter__(self) -> EventsFeed:
        return self

    async def __anext__(self) -> PublishedEvent:
        if self._sub is None:
            raise RuntimeError("iterate an EventsFeed inside `async with`")
        while True:
            published = decode(await self._sub.next_msg(timeout=None))
            event_id = published.event.event_id
            if event_id in self._seen:
                self.duplicates += 1
                continue
            self._seen[event_id] = None
            if len(self._seen) > self._remember:
                del self._seen[next(iter(self._seen))]
            return published
