"""Two engine pools on one work queue: a second pool (another process with its own id, as on
another host) joins just by starting against the same NATS and ledger; each work item is
measured exactly once; ListEngines on either lists both pools' engines; a pool that dies drops
out of the registry after its TTL and the other carries on."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest
import pytest_asyncio

from kiln.common.client import team_channel
from kiln.common.nats import delete_streams, parse_work_subject, work_stream_name
from kiln.common.settings import KilnSettings
from kiln.common.work import ExperimentWork
from kiln.domain.candidate import Candidate
from kiln.engine_pool.app import EnginePoolApp
from kiln.engine_pool.queue import durable_name
from kiln.engine_pool.settings import EngineSettings
from kiln.ledger.app import LedgerApp
from kiln.ledger.client import LedgerClient
from kiln.ledger.model import NewEvent
from kiln.v1 import engine_pool_pb2, engine_pool_pb2_grpc

from ..pki import ServiceLedger  # writes as the services do
from ..unit.engine_testing import work
from ..unit.runtime_app import free_port
from .serving import serve_in_task

pytestmark = pytest.mark.integration

TTL_S = 3.0
OTHER_POOL = "host-b"
ENGINE_ENV = {
    "KILN_ENGINE_WARMUP": "1",
    "KILN_ENGINE_REPEATS": "3",
    "KILN_ENGINE_ACK_WAIT_S": "6",
    "KILN_ENGINE_NAK_DELAY_S": "0.5",
    "KILN_ENGINE_DISCOVER_S": "0.5",
    "KILN_ENGINE_HEARTBEAT_S": "0.5",
    "KILN_ENGINE_REGISTRY_TTL_S": str(TTL_S),
}


@dataclass
class Pools:
    ledger: LedgerClient
    app: EnginePoolApp
    stub: engine_pool_pb2_grpc.EnginePoolStub
    other: subprocess.Popen[bytes]
    js: nats.js.JetStreamContext
    prefix: str


def _start_other_pool(cfg: KilnSettings, ledger_addr: str, log: Path) -> subprocess.Popen[bytes]:
    """``kiln serve engine-pool`` in its own process, as on another host."""
    env = {
        **os.environ,
        **ENGINE_ENV,
        "KILN_NATS_URL": cfg.require_nats_url(),
        "KILN_SUBJECT_PREFIX": cfg.subject_prefix,
        "KILN_LEDGER_ADDR": ledger_addr,
        "KILN_STATE_DIR": str(log.parent),
        "KILN_ENGINE_POOL_ID": OTHER_POOL,
        "KILN_LOG_FORMAT": "console",
    }
    listen = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "kiln", "serve", "engine-pool", "--listen", listen]
    with log.open("wb") as out:
        return subprocess.Popen(
            [*cmd, "--metrics-port", "0"], env=env, stdout=out, stderr=subprocess.STDOUT
        )


@pytest_asyncio.fixture(scope="module")
async def pools(
    settings: KilnSettings, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Pools]:
    prefix = "kr" + uuid.uuid4().hex[:10]
    cfg = settings.model_copy(
        update={"subject_prefix": prefix, "metrics_port": 0, "grace_period_s": 1.0}
    )
    ledger_task, ledger_addr = await serve_in_task(LedgerApp(cfg), cfg)
    cfg = cfg.model_copy(update={"ledger_addr": ledger_addr})
    engine = {k.removeprefix("KILN_ENGINE_").lower(): v for k, v in ENGINE_ENV.items()}
    app = EnginePoolApp(cfg, EngineSettings(**engine, pool_id="host-a"))  # type: ignore[arg-type]
    pool_task, pool_addr = await serve_in_task(app, cfg)
    other = _start_other_pool(cfg, ledger_addr, tmp_path_factory.mktemp("host-b") / "pool.log")
    nc = await nats.connect(cfg.require_nats_url())
    try:
        async with (
            ServiceLedger(ledger_addr, "search") as ledger,
            team_channel(pool_addr, "search") as ch,
        ):
            yield Pools(
                ledger, app, engine_pool_pb2_grpc.EnginePoolStub(ch), other, nc.jetstream(), prefix
            )
    finally:
        if other.poll() is None:
            other.kill()
        other.wait(10)
        for task in (pool_task, ledger_task):
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        await delete_streams(nc.jetstream(), prefix)
        await nc.close()


async def _until(check: Callable[[], Awaitable[bool]], timeout_s: float = 90.0) -> float:
    """Seconds until ``check()`` held."""
    start = time.monotonic()
    while not await check():
        assert time.monotonic() - start < timeout_s, "timed out waiting"
        await asyncio.sleep(0.1)
    return time.monotonic() - start


async def _listed(p: Pools) -> engine_pool_pb2.ListEnginesResponse:
    return await p.stub.ListEngines(engine_pool_pb2.ListEnginesRequest(), timeout=10)


async def _queue(p: Pools, w: ExperimentWork) -> None:
    candidate = Candidate.from_canonical(w.candidate)
    requested = NewEvent(
        "ExperimentRequested",
        {
            "compilation_id": w.compilation_id,
            "candidate_id": candidate.id,
            "candidate": candidate.canonical(),
            "tier": w.tier,
            "agent": "test",
        },
    )
    await p.ledger.append(f"experiment-{w.experiment_id}", [requested], "no_stream")
    headers = {"Nats-Msg-Id": w.experiment_id}
    await p.js.publish(w.subject(p.prefix), w.to_json(), headers=headers)


async def _completions(p: Pools, w: ExperimentWork) -> list[dict[str, object]]:
    events = await p.ledger.read_stream(f"experiment-{w.experiment_id}")
    return [json.loads(e.data) for e in events if e.type == "ExperimentCompleted"]


async def test_a_pool_on_another_host_joins_by_starting(pools: Pools) -> None:
    async def both() -> bool:
        assert pools.other.poll() is None, "the other pool exited"
        return {p.pool_id for p in (await _listed(pools)).pools} == {"host-a", OTHER_POOL}

    await _until(both)
    listed = await _listed(pools)
    local, other = listed.pools
    assert (local.pool_id, local.local) == ("host-a", True)
    assert (other.pool_id, other.local) == (OTHER_POOL, False)
    assert other.pid == pools.other.pid and other.ttl_s == TTL_S
    assert [d.kind for d in other.devices] == ["cpu"] and list(other.hardware) == ["cpu"]
    assert other.last_heartbeat.seconds > 0


async def test_two_pools_measure_each_work_item_exactly_once(pools: Pools) -> None:
    """Both pools consume the one subject, each item measured once. Which pool takes an item is
    the queue's choice: under load the pool with a warm engine may take a whole round, so rounds
    of 8 are queued (up to 3) until both pools have measured some."""
    measured_by: set[str] = set()
    items: list[ExperimentWork] = []
    for round_ in range(3):
        batch = [
            work(Candidate(), experiment_id=f"two-pools-{round_}-{i}-{uuid.uuid4().hex[:8]}")
            for i in range(8)
        ]
        items += batch
        for w in batch:
            await _queue(pools, w)

        async def all_done(batch: list[ExperimentWork] = batch) -> bool:
            return all([await _completions(pools, w) for w in batch])

        await _until(all_done, 180)
        await asyncio.sleep(1.0)  # a duplicate would show up now
        for w in batch:
            (done,) = await _completions(pools, w)
            assert done["status"] == "ok", done["error"]
            measured_by.add(str(done["engine_id"]).rsplit("@", 1)[1])
        if len(measured_by) > 1:
            break
    assert measured_by == {"host-a", OTHER_POOL}
    for w in items:  # still exactly once, every round
        assert len(await _completions(pools, w)) == 1
    # One durable consumer for the subject, shared by both pools, nothing left on it.
    stream = work_stream_name(pools.prefix)
    subject = items[0].subject(pools.prefix)
    info = await pools.js.consumer_info(
        stream, durable_name(*parse_work_subject(pools.prefix, subject))
    )
    assert info.num_pending == 0 and info.num_ack_pending == 0

    async def both_listed() -> bool:
        listed = await _listed(pools)
        return {e.pool_id for e in listed.engines if e.experiments_run} == {"host-a", OTHER_POOL}

    await _until(both_listed, 20)
    listed = await _listed(pools)
    for engine in listed.engines:
        assert engine.model_key == items[0].model_key and engine.device_kind == "cpu"
        assert engine.host and engine.engine_id.endswith(f"@{engine.pool_id}")
    assert sum(p.experiments_done for p in listed.pools) >= len(items)


async def test_a_dead_pool_drops_out_after_its_ttl(pools: Pools) -> None:
    async def listed_other() -> bool:
        return OTHER_POOL in {p.pool_id for p in (await _listed(pools)).pools}

    await _until(listed_other)
    os.kill(pools.other.pid, signal.SIGKILL)
    pools.other.wait(10)

    async def gone() -> bool:
        return not await listed_other()

    took = await _until(gone, TTL_S + 10)
    assert took <= TTL_S + 5
    local = await pools.stub.ListEngines(
        engine_pool_pb2.ListEnginesRequest(local_only=True), timeout=10
    )
    assert [p.pool_id for p in local.pools] == ["host-a"]
    # The pool left carries on with the queue.
    w = work(Candidate.make({"attention": "sdpa"}))
    await _queue(pools, w)

    async def done() -> bool:
        return bool(await _completions(pools, w))

    await _until(done, 60)
    (completed,) = await _completions(pools, w)
    assert completed["status"] == "ok" and str(completed["engine_id"]).endswith("@host-a")
