"""The outbox publisher against real PostgreSQL and NATS JetStream (no mocks).

The module uses its own migrated database so that no other test's outbox rows or running
publisher (the advisory lock is per database) can interfere.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.js import JetStreamContext
from prometheus_client import REGISTRY
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from kiln.common import nats as kn
from kiln.common.errors import Unavailable
from kiln.ledger.group_commit import APPEND_LOCK_KEY
from kiln.ledger.migrate import sync_url
from kiln.ledger.outbox import OutboxPublisher

from ..databases import scratch_database

pytestmark = pytest.mark.integration


# --- fixtures --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def outbox_db_url(postgres_server_url: str) -> Iterator[str]:
    """A fresh migrated database for this module only."""
    with scratch_database(postgres_server_url, "kiln_outbox") as url:
        yield url


@pytest_asyncio.fixture
async def db(outbox_db_url: str) -> AsyncIterator[AsyncEngine]:
    eng = create_async_engine(sync_url(outbox_db_url), pool_size=5)
    async with eng.begin() as conn:  # each test starts with an empty outbox
        await conn.execute(text("DELETE FROM outbox"))
    try:
        yield eng
    finally:
        await eng.dispose()


# --- helpers ---------------------------------------------------------------------------------
async def append(
    engine: AsyncEngine, n: int, category: str = "compilation"
) -> list[dict[str, Any]]:
    """Commit ``n`` events of one new stream plus their outbox rows in one transaction."""
    stream_id = f"{category}-{uuid.uuid4().hex[:12]}"
    out: list[dict[str, Any]] = []
    async with engine.begin() as conn:
        # Like the store: positions are taken under the append lock held to commit.
        await conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": APPEND_LOCK_KEY})
        for v in range(1, n + 1):
            event_id = str(uuid.uuid4())
            data = {"n": v, "note": "héllo"}
            meta = {"team": "t1", "correlation_id": f"corr-{v}", "causation_id": None}
            pos = await conn.scalar(
                text(
                    "INSERT INTO events (position, stream_id, stream_version, event_id, type, "
                    "schema_version, data, metadata) VALUES (nextval('events_position_seq'), "
                    ":s, :v, :e, 'ThingHappened', 1, CAST(:d AS jsonb), CAST(:m AS jsonb)) "
                    "RETURNING position"
                ),
                {
                    "s": stream_id,
                    "v": v,
                    "e": event_id,
                    "d": json.dumps(data),
                    "m": json.dumps(meta),
                },
            )
            await conn.execute(text("INSERT INTO outbox (position) VALUES (:p)"), {"p": pos})
            out.append(
                {"position": pos, "event_id": event_id, "stream_id": stream_id, "data": data}
            )
        last = str(out[-1]["position"])
        await conn.execute(text("SELECT pg_notify('kiln_outbox', :p)"), {"p": last})
    return out


async def reinsert_outbox(engine: AsyncEngine, positions: list[int]) -> None:
    async with engine.begin() as conn:
        for p in positions:
            await conn.execute(text("INSERT INTO outbox (position) VALUES (:p)"), {"p": p})


async def outbox_positions(engine: AsyncEngine) -> list[int]:
    async with engine.connect() as conn:
        rows = await conn.execute(text("SELECT position FROM outbox ORDER BY position"))
        return [r[0] for r in rows]


async def stream_messages(js: JetStreamContext, prefix: str) -> list[Any]:
    """Every message on the events stream, in stream order."""
    name = kn.events_stream_name(prefix)
    state = (await js.stream_info(name)).state
    if state.messages == 0:
        return []
    return [await js.get_msg(name, seq=s) for s in range(state.first_seq, state.last_seq + 1)]


def msg_ids(msgs: list[Any]) -> list[str]:
    return [m.headers[kn.MSG_ID] for m in msgs]


def metric(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


async def eventually(cond: Any, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if await cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not met in time")


# --- tests -----------------------------------------------------------------------------------
async def test_pass_publishes_every_event_in_position_order(
    db: AsyncEngine, nc: Client, prefix: str
) -> None:
    js = nc.jetstream()
    before = metric("kiln_outbox_published_total")
    evs = await append(db, 5) + await append(db, 3, category="experiment")
    pub = OutboxPublisher(db, js, prefix)

    assert await pub.publish_pending() == 8
    assert await outbox_positions(db) == []
    msgs = await stream_messages(js, prefix)
    assert msg_ids(msgs) == [e["event_id"] for e in evs]
    assert [int(m.headers[kn.H_POSITION]) for m in msgs] == [e["position"] for e in evs]
    first, last = msgs[0], msgs[-1]
    assert first.subject == f"{prefix}.events.compilation.{evs[0]['stream_id']}.ThingHappened"
    assert last.subject == f"{prefix}.events.experiment.{evs[-1]['stream_id']}.ThingHappened"
    assert json.loads(first.data) == evs[0]["data"]
    assert "héllo".encode() in first.data and b" " not in first.data  # compact UTF-8
    h = first.headers
    assert h[kn.H_STREAM_ID] == evs[0]["stream_id"]
    assert h[kn.H_STREAM_VERSION] == "1"
    assert h[kn.H_EVENT_TYPE] == "ThingHappened"
    assert h[kn.H_TEAM] == "t1"
    assert h[kn.H_CORRELATION_ID] == "corr-1"
    assert kn.H_CAUSATION_ID not in h  # null metadata is left out, not sent empty
    assert h[kn.H_RECORDED_AT].endswith("+00:00")
    assert metric("kiln_outbox_published_total") - before == 8
    assert await pub.publish_pending() == 0


@pytest.mark.parametrize("use_watermark", [False, True], ids=["dedupe", "watermark"])
async def test_crash_between_publish_and_delete_duplicates_nothing(
    db: AsyncEngine, nc: Client, prefix: str, use_watermark: bool
) -> None:
    js = nc.jetstream()
    evs = await append(db, 4)
    crashed = OutboxPublisher(db, js, prefix)
    rows = await crashed.fetch_pending()
    await crashed.publish(rows[:3])  # published and acknowledged, never deleted: the "crash"
    assert len(await outbox_positions(db)) == 4

    restarted = OutboxPublisher(db, js, prefix, use_watermark=use_watermark)
    assert await restarted.publish_pending() == 4
    assert await outbox_positions(db) == []
    ids = msg_ids(await stream_messages(js, prefix))
    assert ids == [e["event_id"] for e in evs]
    assert set(Counter(ids).values()) == {1}


async def test_watermark_prevents_republishing_beyond_the_duplicate_window(
    db: AsyncEngine, nc: Client, subject_prefix: str
) -> None:
    js = nc.jetstream()
    prefix = f"{subject_prefix}_{uuid.uuid4().hex[:6]}"
    await kn.ensure_streams(js, prefix, events_duplicate_window_s=0.5)
    try:
        evs = await append(db, 3)
        assert await OutboxPublisher(db, js, prefix).publish_pending() == 3
        await asyncio.sleep(2.5)  # JetStream has forgotten the message ids by now
        positions = [e["position"] for e in evs]

        # A crash before the DELETE, noticed only after the window: the watermark saves us.
        await reinsert_outbox(db, positions)
        skipped = metric("kiln_outbox_skipped_total")
        restarted = OutboxPublisher(db, js, prefix)
        assert await restarted.publish_pending() == 3
        assert restarted.watermark == positions[-1]
        assert metric("kiln_outbox_skipped_total") - skipped == 3
        assert await outbox_positions(db) == []
        assert len(await stream_messages(js, prefix)) == 3

        # Control: without the watermark the same situation duplicates (the window is gone).
        await reinsert_outbox(db, positions)
        assert await OutboxPublisher(db, js, prefix, use_watermark=False).publish_pending() == 3
        assert len(await stream_messages(js, prefix)) == 6
    finally:
        await kn.delete_streams(js, prefix)


async def test_watermark_ignores_a_stream_the_database_does_not_match(
    db: AsyncEngine, nc: Client, prefix: str
) -> None:
    js = nc.jetstream()
    await js.publish(
        f"{prefix}.events.compilation.compilation-x.ThingHappened",
        b"{}",
        headers={kn.MSG_ID: str(uuid.uuid4()), kn.H_POSITION: "999999999"},
    )
    evs = await append(db, 2)
    pub = OutboxPublisher(db, js, prefix)
    assert await pub.sync_watermark() == 0
    assert await pub.publish_pending() == 2
    assert msg_ids(await stream_messages(js, prefix))[1:] == [e["event_id"] for e in evs]


async def test_two_publishers_one_leader_no_duplicates_and_failover(
    db: AsyncEngine, nc: Client, prefix: str
) -> None:
    js = nc.jetstream()
    # A long poll interval: after the first pass only NOTIFY can wake the leader quickly.
    pubs = [
        OutboxPublisher(db, js, prefix, poll_interval_s=30.0, lock_retry_s=0.2) for _ in range(2)
    ]
    stops = [asyncio.Event(), asyncio.Event()]
    tasks = [asyncio.create_task(p.run(s)) for p, s in zip(pubs, stops, strict=True)]
    try:

        async def one_leader() -> bool:
            return sum(p.is_leader for p in pubs) == 1

        await eventually(one_leader)
        for _ in range(10):  # stays exactly one while both run
            await asyncio.sleep(0.05)
            assert sum(p.is_leader for p in pubs) == 1

        evs: list[dict[str, Any]] = []
        for batch in await asyncio.gather(*(append(db, 3) for _ in range(6))):
            evs += batch

        async def all_published() -> bool:
            return len(await stream_messages(js, prefix)) >= len(evs)

        started = time.monotonic()
        await eventually(all_published, within=10.0)
        assert time.monotonic() - started < 5.0  # woken by NOTIFY, not by the 30 s poll
        ids = msg_ids(await stream_messages(js, prefix))
        assert sorted(ids) == sorted(e["event_id"] for e in evs)
        assert set(Counter(ids).values()) == {1}
        assert await outbox_positions(db) == []

        # The leader stops: the other takes over and publishes what comes next.
        leader = next(i for i, p in enumerate(pubs) if p.is_leader)
        stops[leader].set()
        await asyncio.wait_for(tasks[leader], 5.0)
        other = pubs[1 - leader]

        async def other_leads() -> bool:
            return other.is_leader

        await eventually(other_leads)
        more = await append(db, 2)

        async def more_published() -> bool:
            return len(await stream_messages(js, prefix)) == len(evs) + 2

        await eventually(more_published)
        assert msg_ids(await stream_messages(js, prefix))[-2:] == [e["event_id"] for e in more]
    finally:
        for s in stops:
            s.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 10.0)
    assert not any(p.is_leader for p in pubs)


async def test_nats_unreachable_keeps_rows(
    db: AsyncEngine, nc: Client, nats_url: str, prefix: str
) -> None:
    dead = await kn.connect(nats_url, "test-outbox-dead")
    await dead.close()
    evs = await append(db, 3)
    positions = [e["position"] for e in evs]

    with pytest.raises(Unavailable):
        await OutboxPublisher(db, dead.jetstream(), prefix).publish_pending()
    assert await outbox_positions(db) == positions

    # The loop does not die either: it keeps the rows and keeps retrying.
    stop = asyncio.Event()
    looping = OutboxPublisher(db, dead.jetstream(), prefix, max_backoff_s=0.2)
    task = asyncio.create_task(looping.run(stop))
    await asyncio.sleep(1.0)
    assert looping.is_leader
    assert not task.done()
    stop.set()
    await asyncio.wait_for(task, 5.0)
    assert await outbox_positions(db) == positions

    # NATS back: everything goes out once.
    assert await OutboxPublisher(db, nc.jetstream(), prefix).publish_pending() == 3
    assert msg_ids(await stream_messages(nc.jetstream(), prefix)) == [e["event_id"] for e in evs]
    assert await outbox_positions(db) == []


async def test_connect_to_a_closed_port_fails_clearly() -> None:
    started = time.monotonic()
    with pytest.raises(Unavailable, match="cannot reach NATS"):
        await kn.connect("nats://127.0.0.1:1", "test-closed", attempts=2, reconnect_wait_s=0.1)
    assert time.monotonic() - started < 10.0
