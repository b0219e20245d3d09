"""The consumer of the ledger's published events (``kiln.ledger.events_feed`` and
``kiln ledger subscribe``) against real PostgreSQL and NATS: events are appended through the
event store and published by the outbox, then read back from JetStream.

The module uses its own migrated database, so every outbox row it publishes is its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.js import JetStreamContext
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from kiln.common import nats as kn
from kiln.common.errors import InvalidArgument, NotFound
from kiln.ledger.db import create_engine
from kiln.ledger.events_feed import EventsFeed, PublishedEvent
from kiln.ledger.model import NewEvent, StoredEvent
from kiln.ledger.outbox import OutboxPublisher
from kiln.ledger.store import EventStore

from ..databases import scratch_database
from .events_factory import completed, requested, submitted

pytestmark = pytest.mark.integration


# --- fixtures --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def feed_db_url(postgres_server_url: str) -> Iterator[str]:
    with scratch_database(postgres_server_url, "kiln_feed") as url:
        yield url


@pytest_asyncio.fixture
async def db(feed_db_url: str) -> AsyncIterator[AsyncEngine]:
    eng = create_engine(feed_db_url, pool_size=5)
    async with eng.begin() as conn:  # nothing left over from an earlier test
        await conn.execute(text("DELETE FROM outbox"))
    try:
        yield eng
    finally:
        await eng.dispose()


@pytest_asyncio.fixture
async def store(db: AsyncEngine) -> AsyncIterator[EventStore]:
    s = EventStore(db)
    try:
        yield s
    finally:
        await s.close()


# --- helpers ---------------------------------------------------------------------------------
def new_id() -> str:
    return uuid.uuid4().hex[:12]


def story() -> list[tuple[str, list[NewEvent]]]:
    """A compilation and two of its experiments: (stream id, events) in append order."""
    comp, e1, e2 = new_id(), new_id(), new_id()
    return [
        (f"compilation-{comp}", [submitted()]),
        (f"experiment-{e1}", [requested(comp, e1, "cand-1")]),
        (f"experiment-{e2}", [requested(comp, e2, "cand-2")]),
        (f"experiment-{e1}", [completed(comp, e1, "cand-1", 120.0)]),
        (f"compilation-{comp}", [NewEvent("CompilationEnded", {"status": "succeeded"})]),
        (f"experiment-{e2}", [completed(comp, e2, "cand-2", 90.0, ok=False)]),
    ]


async def append_and_publish(
    store: EventStore, db: AsyncEngine, js: JetStreamContext, prefix: str
) -> list[StoredEvent]:
    """Append :func:`story` through the store, publish it through the outbox; the stored events."""
    positions: list[int] = []
    for stream_id, evs in story():
        positions += (await store.append(stream_id, evs, team="t1")).positions
    assert await OutboxPublisher(db, js, prefix).publish_pending() == len(positions)
    stored = await store.read_all(after_position=positions[0] - 1)
    assert [e.position for e in stored] == positions
    return stored


async def take(feed: EventsFeed, n: int, within: float = 10.0) -> list[PublishedEvent]:
    """The next ``n`` events of ``feed``."""
    async with asyncio.timeout(within):
        return [await anext(feed) for _ in range(n)]


async def quiet(feed: EventsFeed, for_s: float = 0.5) -> None:
    """Assert that ``feed`` yields nothing more for ``for_s`` seconds."""
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(for_s):
            extra = await anext(feed)
            pytest.fail(f"unexpected event {extra}")


async def consumers(js: JetStreamContext, prefix: str) -> int:
    return (await js.stream_info(kn.events_stream_name(prefix))).state.consumer_count


def kiln_env(nats_url: str, prefix: str, state_dir: Path) -> dict[str, str]:
    # KILN_PKI_DIR stays: the session's certificates (tests/pki.py)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_") or k == "KILN_PKI_DIR"}
    env.update(
        KILN_NATS_URL=nats_url,
        KILN_SUBJECT_PREFIX=prefix,
        KILN_STATE_DIR=str(state_dir),
        COLUMNS="200",
    )
    return env


# --- the feed --------------------------------------------------------------------------------
async def test_feed_yields_every_event_in_order_with_its_fields(
    store: EventStore, db: AsyncEngine, nc: Client, prefix: str
) -> None:
    js = nc.jetstream()
    stored = await append_and_publish(store, db, js, prefix)
    async with EventsFeed(js, prefix, start="all") as feed:
        got = await take(feed, len(stored))
        await quiet(feed)
    assert [p.sequence for p in got] == list(range(1, len(stored) + 1))
    for p, want in zip(got, stored, strict=True):
        e = p.event
        assert (e.position, e.event_id, e.stream_id, e.stream_version) == (
            want.position,
            want.event_id,
            want.stream_id,
            want.stream_version,
        )
        assert (e.type, e.schema_version, e.data) == (want.type, want.schema_version, want.data)
        assert e.recorded_at == want.recorded_at
        assert e.metadata["team"] == "t1"
        assert e.metadata["correlation_id"] == want.metadata["correlation_id"]


@pytest.mark.parametrize(
    ("filters", "matches"),
    [
        ({"category": "experiment"}, lambda e, s: e.stream_id.startswith("experiment-")),
        ({"stream_id": 1}, lambda e, s: e.stream_id == s[1].stream_id),
        ({"event_type": "ExperimentCompleted"}, lambda e, s: e.type == "ExperimentCompleted"),
        (
            {"category": "compilation", "event_type": "CompilationEnded"},
            lambda e, s: e.type == "CompilationEnded",
        ),
        (
            {"stream_id": 2, "event_type": "ExperimentRequested"},
            lambda e, s: e.stream_id == s[2].stream_id and e.type == "ExperimentRequested",
        ),
    ],
    ids=["category", "stream", "type", "category+type", "stream+type"],
)
async def test_filters_select_exactly_the_matching_events(
    store: EventStore, db: AsyncEngine, nc: Client, prefix: str, filters: dict, matches
) -> None:
    js = nc.jetstream()
    stored = await append_and_publish(store, db, js, prefix)
    # Stream filters name the stream of the story's n-th event.
    kwargs = {k: (stored[v].stream_id if k == "stream_id" else v) for k, v in filters.items()}
    want = [e.event_id for e in stored if matches(e, stored)]
    assert 0 < len(want) < len(stored)
    async with EventsFeed(js, prefix, start="all", **kwargs) as feed:
        got = await take(feed, len(want))
        await quiet(feed)
    assert [p.event.event_id for p in got] == want


async def test_new_by_default_and_since_a_sequence(
    store: EventStore, db: AsyncEngine, nc: Client, prefix: str
) -> None:
    js = nc.jetstream()
    first = await append_and_publish(store, db, js, prefix)
    async with EventsFeed(js, prefix) as feed:  # start="new"
        await quiet(feed, 0.3)
        second = await append_and_publish(store, db, js, prefix)
        got = await take(feed, len(second))
    assert [p.event.event_id for p in got] == [e.event_id for e in second]
    assert got[0].sequence == len(first) + 1

    async with EventsFeed(js, prefix, start=len(first)) as feed:
        got = await take(feed, len(second) + 1)
        await quiet(feed)
    assert [p.event.event_id for p in got] == [e.event_id for e in first[-1:] + second]


async def test_a_republished_event_is_yielded_once(
    store: EventStore, db: AsyncEngine, nc: Client, subject_prefix: str
) -> None:
    """The outbox's crash case beyond the duplicate window: the stream holds each event twice
    (same event id, so same ``Nats-Msg-Id``); the feed shows each once."""
    js = nc.jetstream()
    prefix = f"{subject_prefix}_{new_id()[:6]}"
    await kn.ensure_streams(js, prefix, events_duplicate_window_s=0.5)
    try:
        stored = await append_and_publish(store, db, js, prefix)
        await asyncio.sleep(2.0)  # JetStream has forgotten the message ids
        async with db.begin() as conn:  # a crash before the DELETE, noticed after the window
            for e in stored:
                await conn.execute(
                    text("INSERT INTO outbox (position) VALUES (:p)"), {"p": e.position}
                )
        again = OutboxPublisher(db, js, prefix, use_watermark=False)
        assert await again.publish_pending() == len(stored)
        info = await js.stream_info(kn.events_stream_name(prefix))
        assert info.state.messages == 2 * len(stored)

        async with EventsFeed(js, prefix, start="all") as feed:
            got = await take(feed, len(stored))
            await quiet(feed)
            assert feed.duplicates == len(stored)
        assert [p.event.event_id for p in got] == [e.event_id for e in stored]
        assert [p.sequence for p in got] == list(range(1, len(stored) + 1))
    finally:
        await kn.delete_streams(js, prefix)


async def test_the_consumer_is_gone_after_the_feed(nc: Client, prefix: str) -> None:
    js = nc.jetstream()
    async with EventsFeed(js, prefix, category="compilation"):
        assert await consumers(js, prefix) == 1
    assert await consumers(js, prefix) == 0


async def test_a_message_that_is_not_a_ledger_event_is_an_error(nc: Client, prefix: str) -> None:
    js = nc.jetstream()
    await js.publish(
        f"{prefix}.events.compilation.compilation-x.CompilationEnded",
        b"{}",
        headers={kn.MSG_ID: str(uuid.uuid4())},
    )
    async with EventsFeed(js, prefix, start="all") as feed:
        with pytest.raises(InvalidArgument, match=r"message 1 on \S+ is not a ledger event: no "):
            await take(feed, 1)


async def test_no_events_stream_is_not_found(nc: Client) -> None:
    with pytest.raises(NotFound, match="NOSUCH"):
        async with EventsFeed(nc.jetstream(), "nosuch"):
            pass


# --- the command -----------------------------------------------------------------------------
async def test_subscribe_prints_json_lines_and_stops_after_count(
    store: EventStore, db: AsyncEngine, nc: Client, prefix: str, nats_url: str, tmp_path: Path
) -> None:
    stored = await append_and_publish(store, db, nc.jetstream(), prefix)
    args = [sys.executable, "-m", "kiln", "ledger", "subscribe", "--all", "--json"]
    result = await asyncio.to_thread(
        subprocess.run,
        [*args, "--type", "ExperimentRequested", "--count", "2"],
        env=kiln_env(nats_url, prefix, tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    want = [(i + 1, e) for i, e in enumerate(stored) if e.type == "ExperimentRequested"]
    assert len(lines) == 2 == len(want)
    for line, (seq, e) in zip(lines, want, strict=True):
        assert line["sequence"] == seq
        assert line["position"] == e.position
        assert line["event_id"] == e.event_id
        assert line["stream_id"] == e.stream_id
        assert line["stream_version"] == e.stream_version
        assert line["type"] == e.type
        assert line["team"] == "t1"
        assert line["data"] == e.data


async def test_subscribe_shows_only_new_events_by_default(
    store: EventStore, db: AsyncEngine, nc: Client, prefix: str, nats_url: str, tmp_path: Path
) -> None:
    js = nc.jetstream()
    await append_and_publish(store, db, js, prefix)  # before: not shown
    proc = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "kiln", "ledger", "subscribe", "--count", "3"],
        env=kiln_env(nats_url, prefix, tmp_path),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        while await consumers(js, prefix) == 0:  # it has subscribed
            assert proc.returncode is None and time.monotonic() < deadline
            await asyncio.sleep(0.1)
        new = await append_and_publish(store, db, js, prefix)
        out, err = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()
    lines = out.decode().splitlines()
    assert len(lines) == 3
    for i, (line, e) in enumerate(zip(lines, new, strict=False)):
        assert line.startswith(f"#{len(new) + i + 1} ")
        assert f"{e.stream_id}@{e.stream_version} {e.type}" in line
    assert await consumers(js, prefix) == 0
