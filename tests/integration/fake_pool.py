"""An engine pool whose engines are simulated, for scheduling tests on a CPU host.

:class:`FakeEnginePool` is the real :class:`kiln.engine_pool.pool.EnginePool` (device slots, one
experiment per device at a time, engines held per device with LRU eviction) except that an
"engine" is a record, not a process: building one sleeps ``build_s``, an experiment sleeps
``run_s[tier]`` and answers with :func:`tests.integration.fake_engine.throughput` (times
``boost`` for every candidate but the reference, so that a test can make any search find
something to confirm; ``full_boost``, default ``boost``, on the full tier, so that one can make
every confirmation lose). It is driven by
the real :class:`kiln.engine_pool.queue.WorkConsumer` and its delivery (real NATS, real ledger),
so what a test sees is the pool's real scheduling. A mock only where the real part cannot run
here: a dozen compilations on real torch engines would take many minutes on two cores.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from kiln.engine_pool.devices import Device
from kiln.engine_pool.job import Job
from kiln.engine_pool.pool import EnginePool
from kiln.engine_pool.process import EngineSnapshot
from kiln.engine_pool.settings import EngineSettings
from kiln.runtime.measurement import Measurement, MemoryUsage, Timing

from .fake_engine import FAKE_BATCH, FAKE_CONTEXT, throughput


@dataclass(frozen=True)
class _Spec:
    tier: str


@dataclass
class _Engine:
    """What the pool's scheduling reads of a held engine."""

    spec: _Spec
    model_key: str
    engine_id: str
    closed: bool = False

    async def stop(self) -> None:
        self.closed = True

    def kill_now(self) -> None:
        self.closed = True


@dataclass(frozen=True)
class Run:
    """One simulated experiment: when it held the device (monotonic s; ``started_at``: Unix
    time, to compare with the ledger's), what it was, whether an engine was built (and which
    was evicted) for it."""

    experiment_id: str
    device: str
    tier: str
    model_key: str
    compilation_id: str
    team: str
    started: float
    ended: float
    built: bool
    evicted: str = ""
    started_at: float = 0.0


class FakeEnginePool(EnginePool):
    """See the module docstring. ``runs``: every experiment, in the order they ran;
    ``full_open``: while cleared, a full-tier experiment holds its device without running (an
    engine stuck on a confirmation)."""

    def __init__(
        self,
        settings: EngineSettings,
        *,
        build_s: float = 0.3,
        run_s: dict[str, float] | None = None,
        devices: list[Device] | None = None,
        boost: float = 1.0,
        full_boost: float | None = None,
        pool_id: str = "fake",
    ) -> None:
        super().__init__(settings, pool_id=pool_id, devices=devices)
        self.boost = boost
        self.full_boost = boost if full_boost is None else full_boost
        self.build_s = build_s
        self.run_s = run_s or {"fast": 0.05, "full": 0.1}
        self.runs: list[Run] = []
        self.full_open = asyncio.Event()
        self.full_open.set()

    async def measure(self, job: Job, device: str | None = None) -> Measurement:
        work = job.work
        slot = self.slot(device) if device else self.choose_slot(work)
        key = f"{work.tier}/{work.model_key}"
        async with slot.lock:
            self.on_change()
            if work.tier == "full":
                await self.full_open.wait()
            started, started_at, built, evicted = time.monotonic(), time.time(), False, ""
            if key not in slot.engines:
                while len(slot.engines) >= self.settings.engines_per_device():
                    evicted, _ = slot.engines.popitem(last=False)
                await asyncio.sleep(self.build_s)
                slot.engines[key] = _Engine(  # type: ignore[assignment]
                    _Spec(work.tier), work.model_key, f"fake/{key}/{slot.device.name}"
                )
                built = True
            slot.engines.move_to_end(key)
            run_s = self.run_s[work.tier]
            await asyncio.sleep(run_s)
            slot.experiments_done += 1
            self.runs.append(
                Run(
                    work.experiment_id,
                    slot.device.name,
                    work.tier,
                    work.model_key,
                    work.compilation_id,
                    work.team,
                    started,
                    time.monotonic(),
                    built,
                    evicted,
                    started_at,
                )
            )
        self.on_change()
        tps, correct = throughput(job.candidate.canonical(), work.tier)
        if not job.candidate.is_reference:
            tps *= self.full_boost if work.tier == "full" else self.boost
        median_ms = 1000.0 * FAKE_BATCH / tps
        return Measurement(
            status="ok" if correct else "incorrect",
            correct=correct,
            max_abs_error=0.0 if correct else 0.5,
            timing=Timing(median_ms, median_ms * 0.98, median_ms * 1.03, 0.0, [], 1, median_ms),
            tokens_per_s=tps if correct else 0.0,
            error="" if correct else "max |error| 0.5 over tolerance",
            engine_id=f"fake/{key}/{slot.device.name}",
            tier=work.tier,
            candidate_id=job.candidate.id,
            device_ms=run_s * 1000.0,
            batch_size=FAKE_BATCH,
            context_len=FAKE_CONTEXT,
        )

    def engines(self, model_name: str = "") -> list[EngineSnapshot]:
        """What the registry and ListEngines report of the simulated engines."""
        return [
            EngineSnapshot(
                engine_id=e.engine_id,
                device=slot.device.name,
                model_name="fake",
                tier=e.spec.tier,
                state="ready",
                memory=MemoryUsage(),
                experiments_run=0,
                started_at=None,
                cold_start_s=self.build_s,
                restarts=0,
                model_key=e.model_key,
            )
            for slot in self.slots.values()
            for e in slot.engines.values()
            if not model_name or model_name == "fake"
        ]

    async def close(self) -> None:
        for slot in self.slots.values():
            slot.engines.clear()
