"""The engine pool on the real work queue: ExperimentRequested in the real ledger, an
ExperimentWork on its (device kind, tier, model) subject, the engine pool service in-process,
ExperimentCompleted exactly once; crashes recorded with their cause and the engine restarted;
work for hardware or models the pool does not serve left queued."""

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
from prometheus_client import REGISTRY

from kiln.common.nats import delete_streams, parse_work_subject, work_stream_name
from kiln.common.settings import KilnSettings
from kiln.common.work import ExperimentWork
from kiln.domain.candidate import Candidate
from kiln.engine_pool.app import EnginePoolApp
from kiln.engine_pool.queue import durable_name
from kiln.engine_pool.registry import KEY_PREFIX, PoolRecord, registry_bucket
from kiln.ledger.app import LedgerApp
from kiln.ledger.client import LedgerClient
from kiln.ledger.model import NewEvent
from kiln.v1 import ledger_pb2

from ..pki import ServiceLedger  # writes as the services do
from ..unit.engine_testing import (
    EXIT_AT_LOAD,
    TINY_LLAMA,
    engine_settings,
    module,
    tiny_workload,
    work,
)
from .serving import serve_in_task

pytestmark = pytest.mark.integration


@dataclass
class Stack:
    ledger: LedgerClient
    app: EnginePoolApp
    js: nats.js.JetStreamContext
    prefix: str


@pytest_asyncio.fixture(scope="module")
async def stack(settings: KilnSettings) -> AsyncIterator[Stack]:
    prefix = "kq" + uuid.uuid4().hex[:10]  # a work stream of our own
    cfg = settings.model_copy(
        update={"subject_prefix": prefix, "metrics_port": 0, "grace_period_s": 1.0}
    )
    ledger_task, ledger_addr = await serve_in_task(LedgerApp(cfg), cfg)
    cfg = cfg.model_copy(update={"ledger_addr": ledger_addr})
    app = EnginePoolApp(
        cfg,
        engine_settings(
            consume=True, ack_wait_s=6.0, nak_delay_s=0.5, discover_s=0.5, heartbeat_s=0.5
        ),
    )
    pool_task, _ = await serve_in_task(app, cfg)
    await asyncio.wait_for(app.consumer.connected.wait(), 20)
    nc = await nats.connect(cfg.require_nats_url())
    try:
        async with ServiceLedger(ledger_addr, "search") as ledger:
            yield Stack(ledger, app, nc.jetstream(), prefix)
    finally:
        for task in (pool_task, ledger_task):
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        await delete_streams(nc.jetstream(), prefix)
        await nc.close()


async def _requested(stack: Stack, w: ExperimentWork) -> ledger_pb2.RecordedEvent:
    """Append ``w``'s ExperimentRequested as the runner would (its candidate as it is, parsed
    or not)."""
    try:
        candidate_id = Candidate.from_canonical(w.candidate).id
    except (KeyError, TypeError, ValueError, AttributeError):
        candidate_id = "malformed"
    event = NewEvent(
        "ExperimentRequested",
        {
            "compilation_id": w.compilation_id,
            "candidate_id": candidate_id,
            "candidate": w.candidate,
            "tier": w.tier,
            "agent": "test",
        },
    )
    await stack.ledger.append(f"experiment-{w.experiment_id}", [event], "no_stream")
    (recorded,) = await stack.ledger.read_stream(f"experiment-{w.experiment_id}")
    return recorded


async def _publish(stack: Stack, w: ExperimentWork, msg_id: str | None = None) -> None:
    headers = {"Nats-Msg-Id": msg_id or w.experiment_id}
    await stack.js.publish(w.subject(stack.prefix), w.to_json(), headers=headers)


async def _until(check: Callable[[], Awaitable[bool]], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.1)


async def _events(stack: Stack, w: ExperimentWork) -> list[ledger_pb2.RecordedEvent]:
    return await stack.ledger.read_stream(f"experiment-{w.experiment_id}")


async def _settled(stack: Stack, handled: int, subject: str | None = None) -> bool:
    """Every message handled so far, nothing pending or unacked on the subject's consumer
    (default: the tiny workload's fast subject)."""
    stream = work_stream_name(stack.prefix)
    subject = subject or work(Candidate()).subject(stack.prefix)
    info = await stack.js.consumer_info(
        stream, durable_name(*parse_work_subject(stack.prefix, subject))
    )
    return (
        stack.app.consumer.handled >= handled
        and info.num_pending == 0
        and info.num_ack_pending == 0
    )


def _sample(name: str, **labels: str) -> float:
    """A sample of this process's Prometheus registry (the pool runs in-process), 0 if unset."""
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_work_is_measured_and_completed_exactly_once(stack: Stack) -> None:
    w = work(Candidate.make({"attention": "sdpa"}), team="search")
    ok_before = _sample("kiln_engine_experiments_total", tier="fast", status="ok")
    busy_before = _sample("kiln_engine_experiment_device_seconds_count", tier="fast")
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

    # Counted on the pool's metrics once the ledger took the answer (just after the append
    # returns to the pool): one more ok experiment on the fast tier, with its busy time.
    async def counted() -> bool:
        return _sample("kiln_engine_experiments_total", tier="fast", status="ok") > ok_before

    await _until(counted, 10)
    assert _sample("kiln_engine_experiments_total", tier="fast", status="ok") == ok_before + 1
    assert _sample("kiln_engine_experiment_device_seconds_count", tier="fast") == busy_before + 1

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
    # A candidate that does not parse (the ledger's): recorded as rejected, no candidate id.
    malformed = work(Candidate()).model_copy(update={"candidate": {"transforms": [{"params": {}}]}})
    await _requested(stack, malformed)
    await _publish(stack, malformed)
    # Work whose ExperimentRequested was never appended, and a body that is not work at all.
    orphan = work(Candidate())
    await _publish(stack, orphan)
    await stack.js.publish(orphan.subject(stack.prefix), b"{not json")
    await _until(lambda: _settled(stack, handled + 4))

    _, done = await _events(stack, rejected)
    data = json.loads(done.data)
    assert data["status"] == "rejected" and "MLP biases" in data["error"]
    _, done = await _events(stack, malformed)
    data = json.loads(done.data)
    assert data["status"] == "rejected" and data["candidate_id"] == ""
    assert data["error"] == "malformed candidate: KeyError('name')"
    with pytest.raises(Exception, match="has no events"):
        await _events(stack, orphan)


async def test_a_forged_body_is_not_measured(stack: Stack) -> None:
    """A work message whose candidate is not the one the ledger recorded (anyone who can publish
    on a work subject could send one) is terminated and logged; the genuine message of the same
    experiment is then measured with the ledger's candidate."""
    handled = stack.app.consumer.handled
    genuine = work(Candidate.make({"attention": "sdpa"}))
    forged = genuine.model_copy(
        update={"candidate": Candidate.make(code_modules=[EXIT_AT_LOAD]).canonical()}
    )
    await _requested(stack, genuine)
    await _publish(stack, forged, msg_id=f"{genuine.experiment_id}-forged")
    await _until(lambda: _settled(stack, handled + 1))
    assert len(await _events(stack, genuine)) == 1, "a forged body was measured"
    await _publish(stack, genuine)
    data = await _completed(stack, genuine)
    assert (
        data["status"] == "ok"
        and data["candidate_id"] == Candidate.from_canonical(genuine.candidate).id
    )


SEGFAULT_AT_LOAD = module("segv", "import ctypes\nctypes.string_at(0)\n")


async def _completed(stack: Stack, w: ExperimentWork) -> dict[str, object]:
    async def done() -> bool:
        return len(await _events(stack, w)) == 2

    await _until(done, 120)
    _, completed = await _events(stack, w)
    data: dict[str, object] = json.loads(completed.data)
    return data


async def _registered(stack: Stack) -> PoolRecord:
    kv = await stack.js.key_value(registry_bucket(stack.prefix))
    entry = await kv.get(KEY_PREFIX + stack.app.pool.pool_id)
    assert entry.value
    return PoolRecord.from_json(entry.value)


async def test_a_crash_is_recorded_with_its_cause_and_the_engine_keeps_serving(
    stack: Stack,
) -> None:
    """Code modules crash their sandbox, not the engine: the sandbox is replaced, the engine
    stays up and serves the next candidate."""
    segv = work(Candidate.make(code_modules=[SEGFAULT_AT_LOAD]))
    exits = work(Candidate.make(code_modules=[EXIT_AT_LOAD]))
    good = work(Candidate.make({"mlp": "fused_gate_up"}))
    for w in (segv, exits, good):
        await _requested(stack, w)
        await _publish(stack, w)
    crashed, exited, ok = [await _completed(stack, w) for w in (segv, exits, good)]
    assert crashed["status"] == "crashed" and "killed by signal SIGSEGV" in str(crashed["error"])
    assert exited["status"] == "crashed" and "exit code 3" in str(exited["error"])
    assert ok["status"] == "ok", ok["error"]

    # The registry (the pool's heartbeat in the KV bucket): one engine ran all three.
    async def ran_all_and_ready() -> bool:
        record = await _registered(stack)
        return any(e.experiments_run >= 3 and e.state == "ready" for e in record.engines)

    await _until(ran_all_and_ready, 20)
    record = await _registered(stack)
    (engine,) = [e for e in record.engines if e.model_key == good.model_key and e.tier == "fast"]
    assert engine.experiments_run >= 3 and engine.pid > 0 and engine.device == "cpu"
    assert engine.restarts == 0
    assert good.subject(stack.prefix) in record.subjects
    assert record.hardware == ["cpu"] and record.devices[0].kind == "cpu"


async def test_each_model_has_its_own_subject_and_consumer(stack: Stack) -> None:
    other = tiny_workload(name="tiny-llama-seed-9")
    other["model"]["seed"] = "9"
    first, second = work(Candidate()), work(Candidate(), workload=other)
    assert first.model_key != second.model_key
    for w in (first, second):
        await _requested(stack, w)
        await _publish(stack, w)
    for w in (first, second):
        assert (await _completed(stack, w))["status"] == "ok"
    consumer = stack.app.consumer
    assert {first.subject(stack.prefix), second.subject(stack.prefix)} <= set(consumer.lanes)
    stream = work_stream_name(stack.prefix)
    info = await stack.js.consumer_info(stream, durable_name("cpu", "fast", second.model_key))
    assert info.config.filter_subject == second.subject(stack.prefix)


async def test_work_for_other_hardware_stays_queued(stack: Stack) -> None:
    h100 = tiny_workload()
    h100["hardware"] = {"name": "h100", "num_devices": 1}
    w = work(Candidate(), workload=h100)
    await _requested(stack, w)
    await _publish(stack, w)
    subject = w.subject(stack.prefix)
    assert subject.split(".")[3] == "h100"
    await asyncio.sleep(2.0)  # several scans
    assert subject not in stack.app.consumer.lanes
    assert len(await _events(stack, w)) == 1
    info = await stack.js.stream_info(work_stream_name(stack.prefix), subjects_filter=subject)
    assert (info.state.subjects or {}).get(subject) == 1
    await stack.js.purge_stream(work_stream_name(stack.prefix), subject=subject)
