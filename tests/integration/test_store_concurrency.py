"""Concurrent appenders against real PostgreSQL (separate connections, real transactions)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from kiln.common.errors import Aborted
from kiln.ledger.model import NewEvent
from kiln.ledger.store import EventStore

from .events_factory import new_id, submitted

pytestmark = pytest.mark.integration


async def test_concurrent_appenders_to_one_stream_exactly_one_wins_each_version(
    store: EventStore,
) -> None:
    cid = new_id()
    stream = f"compilation-{cid}"
    await store.append(stream, [submitted()], "no_stream", team="t")
    writers, rounds = 8, 6
    wins: Counter[int] = Counter()
    written: dict[str, int] = {}

    async def writer(w: int) -> None:
        done = 0
        while done < rounds:
            version = await store.stream_version(stream)
            ev = NewEvent("CompilationCancelRequested", {"reason": f"w{w}-{done}"})
            try:
                result = await store.append(stream, [ev], version, team="t")
            except Aborted:
                await asyncio.sleep(random.random() / 500)
                continue
            wins[result.stream_version] += 1
            written[ev.event_id] = result.stream_version
            done += 1

    await asyncio.gather(*(writer(w) for w in range(writers)))
    events, version = await store.read_stream(stream, max_count=10_000)
    assert version == 1 + writers * rounds
    assert [e.stream_version for e in events] == list(range(1, version + 1))
    assert all(n == 1 for n in wins.values()), wins
    # Every acknowledged event is stored at exactly the version its writer was told.
    stored = {e.event_id: e.stream_version for e in events}
    assert all(stored[eid] == v for eid, v in written.items())


async def test_tailing_reader_sees_every_event_once_in_order_while_many_streams_append(
    store: EventStore,
) -> None:
    start = await store.head_position()
    streams = [f"compilation-{new_id()}" for _ in range(24)]
    per_stream = 10
    acked: set[int] = set()
    finished = asyncio.Event()

    async def writer(stream: str) -> None:
        result = await store.append(stream, [submitted()], "no_stream", team="t")
        acked.update(result.positions)
        for i in range(per_stream - 1):
            batch = [NewEvent("CompilationCancelRequested", {"reason": str(i)})] * 1
            result = await store.append(stream, batch, "stream_exists", team="t")
            acked.update(result.positions)
            await asyncio.sleep(random.random() / 1000)

    seen: list[int] = []

    async def reader() -> None:
        last = start
        while True:
            done = finished.is_set()
            batch = await store.read_all(last, max_count=50, stream_prefix="compilation-")
            for ev in batch:
                if ev.stream_id in streams:
                    seen.append(ev.position)
            if batch:
                last = batch[-1].position
            elif done:
                return
            else:
                await asyncio.sleep(0.001)

    reader_task = asyncio.create_task(reader())
    await asyncio.gather(*(writer(s) for s in streams))
    finished.set()
    await reader_task
    assert len(acked) == len(streams) * per_stream
    assert seen == sorted(seen), "the reader saw positions out of order"
    assert len(seen) == len(set(seen)), "the reader saw an event twice"
    assert set(seen) == acked, f"missed {sorted(acked - set(seen))[:5]}"


async def test_concurrent_idempotent_retries_store_the_batch_once(store: EventStore) -> None:
    cid = new_id()
    stream = f"compilation-{cid}"
    batch = [submitted(), NewEvent("CompilationPlanned", {"plan": {"tp": 1}})]
    results = await asyncio.gather(
        *(store.append(stream, batch, "any", team="t") for _ in range(6))
    )
    assert sum(not r.already_stored for r in results) == 1
    assert len({tuple(r.positions) for r in results}) == 1
    events, version = await store.read_stream(stream)
    assert version == 2 and len(events) == 2
