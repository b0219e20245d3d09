"""The engine pool on the real work queue: ExperimentRequested in the real ledger, an
ExperimentWork on NATS, the engine pool service in-process, ExperimentCompleted exactly once."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import nats
import pytest
import pytest_asyncio

from kiln.common.nats import delete_streams, work_stream_name, work_subject
from kiln.common.server import serve
from kiln.common.settings import KilnSettings
from kiln.common.work import ExperimentWork
from kiln.engine_pool.app import EnginePoolApp
from kiln.engine_pool.queue import durable_name
from kiln.ledger.app import LedgerApp
from kiln.ledger.client import LedgerClient
from kiln.ledger.model import NewEvent
from kiln.v1 import ledger_pb2
from kiln.workloads.candidate import Candidate

from ..unit.engine_testing import TINY_LLAMA, engine_settings, tiny_workload, work
from ..unit.runtime_app import free_port

pytestmark = pytest.mark.integration


@dataclass
class Stack:
    ledger: LedgerClient
    app: EnginePoolApp
    js: nats.js.JetStreamContext
    prefix: str


async def _serve(app: object, cfg: KilnSettings) -> tuple[asyncio.Task[None], str]:
    addr, started = f"127.0.0.1:{free_port()}", asyncio.Event()
    task = asyncio.create_task(
        serve(app, cfg, listen=addr, started=started, handle_signals=False)  # type: ignore[arg-type]
    )
    await asyncio.wait_for(started.wait(), 20)
    return task, addr


@pytest_asyncio.fixture(scope="module")
async def stack(settings: KilnSettings) -> AsyncIterator[Stack]:
    prefix = "kq" + uuid.uuid4().hex[:10]  # a work stream of our own
    cfg = settings.model_copy(
        update={"subject_prefix": prefix, "metrics_port": 0, "grace_period_s": 1.0}
    )
    ledger_task, ledger_addr = await _serve(LedgerApp(cfg), cfg)
    cfg = cfg.model_copy(update={"ledger_addr": ledger_addr})
    app = EnginePoolApp(cfg, engine_settings(consume=True, ack_wait_s=6.0, nak_delay_s=0.5))
    pool_task, _ = await _serve(app, cfg)
    await asyncio.wait_for(app.consumer.connected.wait(), 20)
    nc = await nats.connect(cfg.require_nats_url())
    try:
        async with LedgerClient(ledger_addr, team="search") as ledger:
            yield Stack(ledger, app, nc.jetstream(), prefix)
    finally:
        for task in (pool_task, ledger_task):
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        await delete_streams(nc.jetstream(), prefix)
        await nc.close()


async def _requested(stack: Stack, w: ExperimentWork) -> ledger_pb2.RecordedEvent:
    candidate = Candidate.from_canonical(w.candidate)
    event = NewEvent(
        "ExperimentRequested",
        {
            "compilation_id": w.compilation_id,
            "candidate_id": candidate.id,
            "candidate": candidate.canonical(),
            "tier": w.tier,
            "agent": "test",
        },
    )
    await stack.ledger.append(f"experiment-{w.experiment_id}", [event], "no_stream")
    (recorded,) = await stack.ledger.read_stream(f"experiment-{w.experiment_id}")
    return recorded


async def _publish(stack: Stack, w: ExperimentWork, msg_id: str | None = None) -> None:
    headers = {"Nats-Msg-Id": msg_id or w.experiment_id}
    await stack.js.publish(work_subject(stack.prefix, w.tier), w.to_json(), headers=headers)


async def _until(check: Callable[[], Awaitable[bool]], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.1)


async def _events(stack: Stack, w: ExperimentWork) -> list[ledger_pb2.RecordedEvent]:
    return await stack.ledger.read_stream(f"experiment-{w.experiment_id}")


async def _settled(stack: Stack, handled: int) -> bool:
    """Every message handled so far, nothing pending or unacked on the fast consumer."""
    stream = work_stream_name(stack.prefix)
    info = await stack.js.consumer_info(stream, durable_name("fast"))
    return (
        stack.app.consumer.handled >= handled
        and info.num_pending == 0
        and info.num_ack_pending == 0
    )


async def test_work_is_measured_and_completed_exactly_once(stack: Stack) -> None:
    w = work(Candidate.make({"attention": "sdpa"}), team="search")
    requested = await _requested(stack, w)
    await _publish(stack, w)

    async def completed() -> bool:
        return len(await _events(stack, w)) == 2

    await _until(completed)
    _, done = await _events(stack, w)
    data = json.loads(done.data)
    assert done.type == "ExperimentCompleted" and done.stream_version == 2
    assert data["status"] == "ok" and data["correct"] is True
    assert data["candidate_id"] == Candidate.from_canonical(w.candidate).id
    assert data["compilation_id"] == w.compilation_id and data["tier"] == "fast"
    assert data["median_ms"] > 0 and data["p10_ms"] <= data["median_ms"] <= data["p90_ms"]
    assert data["tokens_per_s"] > 0 and data["memory_bytes"] > 0 and data["engine_id"]
    assert done.metadata.team == "search"
    assert done.metadata.causation_id == requested.event_id
    assert done.metadata.correlation_id == requested.metadata.correlation_id

    # The same work again (another message id gets past JetStream's de-duplication).
    handled = stack.app.consumer.handled
    await _publish(stack, w, msg_id=uuid.uuid4().hex)
    await _until(lambda: _settled(stack, handled + 1))
    assert [e.type for e in await _events(stack, w)] == [
        "ExperimentRequested",
        "ExperimentCompleted",
    ]


async def test_failures_are_recorded_and_bad_messages_dropped(stack: Stack) -> None:
    handled = stack.app.consumer.handled
    # An architecture no engine can build: recorded as rejected, not retried forever.
    bad_workload = tiny_workload()
    bad_workload["model"]["config_json"] = json.dumps({**TINY_LLAMA, "mlp_bias": True})
    rejected = work(Candidate(), workload=bad_workload)
    await _requested(stack, rejected)
    await _publish(stack, rejected)
    # Work whose ExperimentRequested was never appended, and a body that is not work at all.
    orphan = work(Candidate())
    await _publish(stack, orphan)
    await stack.js.publish(work_subject(stack.prefix, "fast"), b"{not json")
    await _until(lambda: _settled(stack, handled + 3))

    _, done = await _events(stack, rejected)
    data = json.loads(done.data)
    assert data["status"] == "rejected" and "MLP biases" in data["error"]
    with pytest.raises(Exception, match="has no events"):
        await _events(stack, orphan)
