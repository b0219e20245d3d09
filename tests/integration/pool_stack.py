"""A kiln deployment in the test's event loop, the services real and only the engines simulated:
the ledger (real PostgreSQL), the cost model, engine pools (the real
:class:`~kiln.engine_pool.app.EnginePoolApp`: ListEngines over gRPC, its registry and work
consumer on the real NATS) whose engines are :class:`~tests.integration.fake_pool.FakeEnginePool`
records, and the agent runner (Compiler API over gRPC), which reads the registry through the
first pool, as a deployment's runner does through ``KILN_ENGINE_POOL_ADDR``."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from kiln.agent_runner.app import AgentRunnerApp
from kiln.agent_runner.config import RunnerConfig
from kiln.common import nats as kn
from kiln.common.client import team_channel
from kiln.common.settings import KilnSettings
from kiln.cost_model.app import create_app as create_cost_model
from kiln.engine_pool.app import EnginePoolApp
from kiln.engine_pool.devices import CPU, Device
from kiln.engine_pool.settings import EngineSettings
from kiln.ledger.app import LedgerApp
from kiln.ledger.client import LedgerClient
from kiln.v1 import compiler_pb2_grpc, engine_pool_pb2, engine_pool_pb2_grpc

from ..databases import scratch_database
from ..pki import service_tls
from .fake_pool import FakeEnginePool
from .serving import serve_in_task

RUNNER_CONFIG = RunnerConfig(
    experiment_deadline_s=20.0,
    baseline_deadline_s=20.0,
    experiment_margin_s=10.0,
    search_share=0.5,
    search_min_deadline_s=5.0,
    plan_timeout_s=5.0,
    plan_attempts=3,
    cancel_wait_s=10.0,
    resume_retry_s=0.5,
    confirm_grace_s=2.0,
    pools_timeout_s=5.0,
)
POOL_SETTINGS: dict[str, Any] = {
    "consume": True,
    "ack_wait_s": 10.0,
    "nak_delay_s": 0.5,
    "discover_s": 0.5,
    "heartbeat_s": 0.5,
    "max_engines": 2,
}


@dataclass
class Pool:
    """One engine pool of the stack: the service, its simulated engines, its address."""

    app: EnginePoolApp
    engines: FakeEnginePool
    addr: str
    task: asyncio.Task[None]


@dataclass
class PoolStack:
    """The services of one test module and a ledger reader of every team's records."""

    settings: KilnSettings
    ledger: LedgerClient
    pools: dict[str, Pool] = field(default_factory=dict)
    runner: AgentRunnerApp | None = None
    runner_addr: str = ""
    runner_task: asyncio.Task[None] | None = None

    async def add_pool(
        self, pool_id: str, devices: list[Device], *, boost: float = 1.0, **engine: Any
    ) -> Pool:
        """Start an engine pool with these (simulated) devices; returns once it is in the
        registry. ``engine``: EngineSettings fields over :data:`POOL_SETTINGS`."""
        settings = EngineSettings(**(POOL_SETTINGS | engine))
        engines = FakeEnginePool(
            settings,
            devices=devices,
            pool_id=pool_id,
            boost=boost,
            build_s=0.05,
            run_s={"fast": 0.05, "full": 0.1},
        )
        app = EnginePoolApp(self.settings, settings, pool=engines)
        task, addr = await serve_in_task(app, self.settings)
        pool = self.pools[pool_id] = Pool(app, engines, addr, task)
        await asyncio.wait_for(app.registry.connected.wait(), 20)
        await asyncio.wait_for(app.consumer.connected.wait(), 20)
        await self.wait_registered(pool_id)
        return pool

    async def wait_registered(self, pool_id: str, timeout_s: float = 20.0) -> None:
        """Until the first pool's ListEngines lists ``pool_id``."""
        first = next(iter(self.pools.values()))
        async with team_channel(first.addr, "reader") as ch:
            stub = engine_pool_pb2_grpc.EnginePoolStub(ch)
            async with asyncio.timeout(timeout_s):
                while True:
                    reply = await stub.ListEngines(engine_pool_pb2.ListEnginesRequest(), timeout=10)
                    if any(p.pool_id == pool_id for p in reply.pools):
                        return
                    await asyncio.sleep(0.2)

    async def start_runner(self) -> AgentRunnerApp:
        """Start the agent runner (reading the registry through the first pool), once it has
        resumed what it found open."""
        first = next(iter(self.pools.values()))
        cfg = self.settings.model_copy(update={"engine_pool_addr": first.addr})
        self.runner = AgentRunnerApp(cfg, RUNNER_CONFIG)
        self.runner_task, self.runner_addr = await serve_in_task(self.runner, cfg)
        await asyncio.wait_for(self.runner.resumed.wait(), 20)
        return self.runner

    async def stop_runner(self) -> None:
        """Stop the agent runner (its compilations stay open for the next one)."""
        if self.runner_task is not None:
            await _stop(self.runner_task)
            self.runner_task = None

    @contextlib.asynccontextmanager
    async def compiler(self, team: str) -> AsyncIterator[compiler_pb2_grpc.CompilerStub]:
        """A Compiler stub acting for ``team``."""
        async with team_channel(self.runner_addr, team) as ch:
            yield compiler_pb2_grpc.CompilerStub(ch)

    async def events(self, compilation_id: str) -> list[Any]:
        """The compilation's stream."""
        return list(await self.ledger.read_stream(f"compilation-{compilation_id}"))


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


NO_MICROBENCHMARKS = {"KILN_COST_MICROBENCH": "false", "KILN_MICROBENCH_ENABLED": "false"}
"""The cost model asks for no microbenchmarks, the pool answers none: on the simulated pool a
real one would hold the CPU slot for seconds of a test's short budget, and the plan is not what
these tests test (tests/integration/test_cost_tiers_grpc.py tests them)."""


@contextlib.asynccontextmanager
async def pool_stack(settings: KilnSettings, letters: str) -> AsyncIterator[PoolStack]:
    """Ledger, cost model and a CPU engine pool that, as the embedded default's, is told
    ``KILN_ENGINE_HARDWARE=*`` (pool id ``cpu-pool``), without microbenchmarks
    (:data:`NO_MICROBENCHMARKS`); start the runner with :meth:`PoolStack.start_runner` (after
    adding pools, or at once)."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in NO_MICROBENCHMARKS.items():
            mp.setenv(key, value)
        async with _pool_stack(settings, letters) as stack:
            yield stack


@contextlib.asynccontextmanager
async def _pool_stack(settings: KilnSettings, letters: str) -> AsyncIterator[PoolStack]:
    # A database of its own: the runner resumes every open compilation of its ledger, and
    # another module's, left on the session's database, would hold these engines (CI saw a
    # compilation here spend its 15 s before its baseline ran).
    with scratch_database(settings.require_database_url()) as database_url:
        async with _pool_stack_on(settings, letters, database_url) as stack:
            yield stack


@contextlib.asynccontextmanager
async def _pool_stack_on(
    settings: KilnSettings, letters: str, database_url: str
) -> AsyncIterator[PoolStack]:
    prefix = letters + uuid.uuid4().hex[:10]
    cfg = settings.model_copy(
        update={
            "subject_prefix": prefix,
            "metrics_port": 0,
            "grace_period_s": 1.0,
            "database_url": database_url,
        }
    )
    ledger_task, ledger_addr = await serve_in_task(LedgerApp(cfg), cfg)
    cfg = cfg.model_copy(update={"ledger_addr": ledger_addr})
    cost_task, cost_addr = await serve_in_task(create_cost_model(cfg), cfg)
    cfg = cfg.model_copy(update={"cost_model_addr": cost_addr})
    reader = service_tls("agent-runner")  # reads every team's records
    async with LedgerClient(ledger_addr, "reader", tls=reader) as ledger:
        stack = PoolStack(cfg, ledger)
        try:
            await stack.add_pool("cpu-pool", [CPU], hardware="*")
            yield stack
        finally:
            await stack.stop_runner()
            for pool in reversed(stack.pools.values()):
                await _stop(pool.task)
            for task in (cost_task, ledger_task):
                await _stop(task)
            nc = await kn.connect(cfg.require_nats_url(), "test-pool-stack")
            await kn.delete_streams(nc.jetstream(), prefix)
            with contextlib.suppress(Exception):
                await nc.jetstream().delete_key_value(kn.registry_bucket(prefix))
            await nc.close()
