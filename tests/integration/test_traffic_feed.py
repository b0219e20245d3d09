"""The traffic feed's publish on the real NATS JetStream: a publish whose acknowledgement is lost
is retried under the same message id and stored once; one that keeps timing out raises. The lost
acknowledgement is simulated (a JetStream context that publishes, then raises the timeout nats
raises), since a real server cannot be made to drop one acknowledgement on demand."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import nats.errors
import pytest
import pytest_asyncio
from nats.js import JetStreamContext

from kiln.agent_runner.deployments.feed import PUBLISH_ATTEMPTS, TrafficFeed, encode_record
from kiln.common import nats as kn
from kiln.common.settings import KilnSettings

pytestmark = pytest.mark.integration


class _LosesAcks:
    """A JetStream context whose first ``lost`` publishes are stored but answered with a timeout
    (``store=False``: not stored either, as when the request never reached the server)."""

    def __init__(self, js: JetStreamContext, lost: int, store: bool = True) -> None:
        self._js, self.lost, self.store, self.calls = js, lost, store, 0

    async def publish(self, subject: str, body: bytes, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls <= self.lost:
            if self.store:
                await self._js.publish(subject, body, **kwargs)
            raise nats.errors.TimeoutError
        return await self._js.publish(subject, body, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._js, name)


@pytest_asyncio.fixture
async def js(settings: KilnSettings) -> AsyncIterator[tuple[JetStreamContext, str]]:
    prefix = "tf" + uuid.uuid4().hex[:10]
    nc = await kn.connect(settings.require_nats_url(), "test-traffic-feed")
    js = nc.jetstream()
    await kn.ensure_streams(js, prefix, ("traffic",))
    try:
        yield js, prefix
    finally:
        await kn.delete_streams(js, prefix)
        await nc.close()


async def _stored(js: JetStreamContext, prefix: str) -> int:
    info = await js.stream_info(kn.traffic_stream_name(prefix))
    return int(info.state.messages)


async def test_a_lost_acknowledgement_is_retried_and_stored_once(
    js: tuple[JetStreamContext, str],
) -> None:
    context, prefix = js
    flaky = _LosesAcks(context, lost=2)
    feed = TrafficFeed(flaky, prefix)  # type: ignore[arg-type]
    records = [encode_record(float(i), 100 + i, 10) for i in range(3)]
    seq = await feed.publish("dep-1", records)
    assert flaky.calls == 3
    assert await _stored(context, prefix) == 1
    assert seq == 1  # the duplicate's acknowledgement names the stored message
    await feed.publish_flush("dep-1")
    assert await _stored(context, prefix) == 2


async def test_a_publish_never_acknowledged_raises_after_its_attempts(
    js: tuple[JetStreamContext, str],
) -> None:
    context, prefix = js
    flaky = _LosesAcks(context, lost=PUBLISH_ATTEMPTS, store=False)
    feed = TrafficFeed(flaky, prefix)  # type: ignore[arg-type]
    with pytest.raises(nats.errors.TimeoutError):
        await feed.publish("dep-1", [encode_record(0.0, 1, 1)])
    assert flaky.calls == PUBLISH_ATTEMPTS
    assert await _stored(context, prefix) == 0
