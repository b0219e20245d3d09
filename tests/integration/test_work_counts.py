"""The work consumer's per-subject counts on the real work stream: a publish the consumer sees
while its scan's snapshot is being taken is not lost when the snapshot lacks it (the lane would
look empty until the next scan and later work of other lanes would run first)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import nats
import pytest
import pytest_asyncio

from kiln.common.nats import delete_streams, ensure_streams, work_filter
from kiln.common.settings import KilnSettings
from kiln.domain.candidate import REFERENCE_CANDIDATE
from kiln.engine_pool.queue import WorkConsumer

from ..unit.engine_testing import engine_settings, work
from .fake_pool import FakeEnginePool

pytestmark = pytest.mark.integration


@pytest_asyncio.fixture
async def consumer(settings: KilnSettings) -> AsyncIterator[tuple[WorkConsumer, Any, str]]:
    """A consumer bound to a work stream of its own, scanning only when told (no workers)."""
    prefix = "kc" + uuid.uuid4().hex[:10]
    cfg = settings.model_copy(update={"subject_prefix": prefix})
    es = engine_settings(consume=True)
    c = WorkConsumer(cfg, es, FakeEnginePool(es))
    nc = await nats.connect(cfg.require_nats_url())
    js = nc.jetstream()
    try:
        await ensure_streams(js, prefix)
        await nc.subscribe(work_filter(prefix), cb=c._on_published)
        c._js = js
        yield c, js, prefix
    finally:
        await delete_streams(js, prefix)
        await nc.close()


async def _publish(js: Any, prefix: str, tier: str = "full") -> str:
    w = work(REFERENCE_CANDIDATE, tier=tier)
    await js.publish(w.subject(prefix), w.to_json(), headers={"Nats-Msg-Id": w.experiment_id})
    return w.subject(prefix)


async def _seen(c: WorkConsumer, subject: str, published: int) -> None:
    """Until the consumer's core subscription has counted ``published`` publishes on it."""
    for _ in range(1000):
        lane = c.lanes.get(subject)
        if lane is not None and lane.published >= published:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{published} publishes on {subject} not seen within 10 s")


async def test_a_scan_counts_what_the_stream_holds(consumer: tuple[WorkConsumer, Any, str]) -> None:
    c, js, prefix = consumer
    subject = await _publish(js, prefix)
    await _publish(js, prefix)
    await c.discover()  # binds the subject: 2 held
    assert c.lanes[subject].queued == 2
    await _seen(c, subject, 0)
    await c.discover()  # publishes seen before a scan are in its snapshot, not counted twice
    assert c.lanes[subject].queued == 2


async def test_a_publish_during_the_scan_is_not_lost(
    consumer: tuple[WorkConsumer, Any, str],
) -> None:
    c, js, prefix = consumer
    subject = await _publish(js, prefix)
    await c.discover()
    assert c.lanes[subject].queued == 1
    real = js.stream_info

    async def stale_snapshot(*args: Any, **kwargs: Any) -> Any:
        """The snapshot taken, then a publish seen before the reply arrives."""
        info = await real(*args, **kwargs)
        await _publish(js, prefix)
        await _seen(c, subject, 1)
        return info

    js.stream_info = stale_snapshot
    try:
        await c.discover()
    finally:
        js.stream_info = real
    assert c.lanes[subject].queued == 2  # 1 in the snapshot, 1 seen after it
    await c.discover()
    assert c.lanes[subject].queued == 2  # the next scan holds both
