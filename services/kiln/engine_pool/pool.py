"""The pool of persistent engines on this host: per device, experiments one at a time, engines as
OS processes pinned there (at most ``max_engines``, least recently used stopped first), created
on first need. An experiment keeps its engine until it answers, even when the caller stops
waiting.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import socket
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from kiln.common.errors import FailedPrecondition, InvalidArgument
from kiln.common.work import ExperimentWork
from kiln.engine_pool.devices import Device, resolve_devices, settings_for
from kiln.engine_pool.job import Job
from kiln.engine_pool.process import EngineProcess, EngineSnapshot, EngineStartError
from kiln.engine_pool.settings import EngineSettings
from kiln.runtime.measurement import Measurement
from kiln.runtime.request import RunRequest
from kiln.runtime.spec import EngineSpec, SpecError

if TYPE_CHECKING:
    from kiln.runtime.engine import ExternalMeasure

log = structlog.get_logger("kiln.engine_pool")

_ID_JUNK = re.compile(r"[^A-Za-z0-9_-]+")


def default_pool_id(host: str) -> str:
    """``<host>-<pid>`` with characters other than ``[A-Za-z0-9_-]`` replaced by ``-``."""
    return clean_pool_id(f"{host}-{os.getpid()}")


def clean_pool_id(value: str) -> str:
    """``value`` with characters other than ``[A-Za-z0-9_-]`` replaced by ``-``, at most 100;
    ValueError if nothing is left.
    """
    cleaned = _ID_JUNK.sub("-", value).strip("-")[:100]
    if not cleaned:
        raise ValueError(f"invalid pool id {value!r}")
    return cleaned


@dataclasses.dataclass(eq=False)
class DeviceSlot:
    """One device and the engines held on it: ``engines`` by spec key (least recently used first),
    ``lock`` held while an experiment or build runs, ``waiting`` and ``experiments_done`` counts.
    """

    device: Device
    engines: OrderedDict[str, EngineProcess] = dataclasses.field(default_factory=OrderedDict)
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    waiting: int = 0
    experiments_done: int = 0

    @property
    def busy(self) -> bool:
        """An experiment or a build holds the device."""
        return self.lock.locked()

    def holds(self, tier: str, model_key: str) -> bool:
        """Whether an engine of this (tier, model) is held (warm or building)."""
        return any(
            e.spec.tier == tier and e.model_key == model_key and not e.closed
            for e in self.engines.values()
        )


class EnginePool:
    """Engines by device and spec key; ``on_change()`` is called whenever an engine or device
    changes state. ``external_measure`` measures a baseline request (injected by the composition
    root, e.g. ``kiln.baselines.in_engine.measure_baseline``); None: no baselines.

    Raises:
        kiln.engine_pool.devices.DeviceError: bad ``KILN_ENGINE_DEVICES``.
        ValueError: a pool id with no usable character.
    """

    def __init__(
        self,
        settings: EngineSettings,
        *,
        host: str | None = None,
        pool_id: str | None = None,
        devices: list[Device] | None = None,
        external_measure: ExternalMeasure | None = None,
    ) -> None:
        self.devices = devices or resolve_devices(settings)
        self.settings = settings_for(settings, self.devices)
        self.host = host or socket.gethostname()
        chosen = pool_id or settings.pool_id
        self.pool_id = clean_pool_id(chosen) if chosen else default_pool_id(self.host)
        self.slots: dict[str, DeviceSlot] = {d.name: DeviceSlot(d) for d in self.devices}
        self.external_measure = external_measure
        self.started_at = time.time()
        self.on_change: Callable[[], None] = lambda: None
        self._running: set[asyncio.Task[Measurement]] = set()
        self._closed = False

    # ------------------------------------------------------------------ specs
    def spec_for(self, work: ExperimentWork, device: str | None = None) -> EngineSpec:
        """The engine spec ``work`` needs on ``device`` (default the first); InvalidArgument if
        unbuildable.
        """
        name = device or self.devices[0].name
        limits = dataclasses.replace(self.settings.limits(), device=name)
        try:
            return EngineSpec.from_workload(work.workload, work.tier, limits)
        except SpecError as exc:
            raise InvalidArgument(str(exc)) from None

    def engine_id(self, spec: EngineSpec) -> str:
        """``<model>/<tier>/<spec key prefix>/<device>@<pool id>``."""
        return f"{spec.model_name}/{spec.tier}/{spec.key[:8]}/{spec.device}@{self.pool_id}"

    def slot(self, device: str) -> DeviceSlot:
        """The slot of ``device``; InvalidArgument if not this pool's."""
        try:
            return self.slots[device]
        except KeyError:
            raise InvalidArgument(
                f"device {device!r} is not one of this pool's: {', '.join(self.slots)}"
            ) from None

    def choose_slot(self, work: ExperimentWork, kind: str = "") -> DeviceSlot:
        """The device a RunExperiment call runs on: idle and holding the model, else idle, else
        holding it, else the fewest waiting (first on ties); among the devices of ``kind`` when
        given.

        Raises:
            FailedPrecondition: no device of this pool is of ``kind``.
        """
        tier, key = work.tier, work.model_key
        slots = [s for s in self.slots.values() if not kind or s.device.kind == kind]
        if not slots:
            have = ", ".join(f"{s.device.name} ({s.device.kind})" for s in self.slots.values())
            raise FailedPrecondition(
                f"this engine pool has no {kind!r} device (it has {have}): it measures a "
                "workload only on devices of the workload's hardware"
            )
        return min(
            slots,
            key=lambda s: (s.busy, not s.holds(tier, key), s.waiting, slots.index(s)),
        )

    # ------------------------------------------------------------------ experiments
    async def measure(self, job: Job, device: str | None = None) -> Measurement:
        """Run ``job`` on ``device`` (default: :meth:`choose_slot`) on an engine of its spec
        (created on first use). A candidate that fails in the engine is a measurement (REJECTED,
        CRASHED, ...), not an error.

        Raises:
            InvalidArgument: the workload cannot be built, its engine failed for a reason of the
                workload, or ``device`` is not the pool's.
            FailedPrecondition: the engine failed for a reason of the host, the pool is closed,
                or ``job`` names a baseline and this pool measures none.
        """
        work = job.work
        if work.baseline and self.external_measure is None:
            raise FailedPrecondition(
                f"baseline {work.baseline!r}: this engine pool measures no baselines (it was "
                "started without an external measure; `kiln serve engine-pool` has one)"
            )
        slot = self.slot(device) if device else self.choose_slot(work)
        spec = self.spec_for(work, slot.device.name)
        request = RunRequest(
            experiment_id=work.experiment_id,
            candidate=job.candidate,
            warmup=self.settings.warmup,
            repeats=self.settings.repeats,
            min_repeats=self.settings.min_repeats_for(spec.tier),
            measure_budget_s=self.settings.measure_budget_s,
            verify_timed_steps=self.settings.verify_timed_steps,
            prefill_repeats=self.settings.prefill_repeats,
            profile=work.profile,
            baseline=work.baseline,
        )
        task = asyncio.create_task(self._run(slot, spec, work.model_key, request, work.deadline_s))
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return await asyncio.shield(task)

    async def _run(
        self,
        slot: DeviceSlot,
        spec: EngineSpec,
        model_key: str,
        request: RunRequest,
        deadline_s: float,
    ) -> Measurement:
        slot.waiting += 1
        try:
            await slot.lock.acquire()
        finally:
            slot.waiting -= 1
        try:
            self.on_change()
            engine = await self._engine(slot, spec, model_key)
            try:
                measurement = await engine.run(request, deadline_s)
            except EngineStartError as exc:
                await self._discard(slot, engine)
                if exc.invalid:
                    raise InvalidArgument(exc.message) from None
                raise FailedPrecondition(exc.message) from None
            slot.experiments_done += 1
        finally:
            slot.lock.release()
            self.on_change()
        log.info(
            "experiment.measured",
            experiment_id=request.experiment_id,
            engine_id=engine.engine_id,
            status=measurement.status,
            median_ms=measurement.timing.median_ms if measurement.timing else None,
        )
        return measurement

    async def _engine(self, slot: DeviceSlot, spec: EngineSpec, model_key: str) -> EngineProcess:
        """The engine of ``spec`` on ``slot``, started when missing; the caller holds
        ``slot.lock``.
        """
        if self._closed:
            raise FailedPrecondition("the engine pool is shutting down")
        engine = slot.engines.get(spec.key)
        if engine is None or engine.closed:
            slot.engines.pop(spec.key, None)
            while len(slot.engines) >= self.settings.engines_per_device():
                _, victim = slot.engines.popitem(last=False)
                log.info("engine.evicting", engine_id=victim.engine_id, for_spec=spec.key)
                await victim.stop()
            device = slot.device
            engine = EngineProcess(
                spec,
                self.engine_id(spec),
                ready_timeout_s=self.settings.ready_timeout_s,
                env={**device.env(), "KILN_ENGINE_THREADS": self.settings.threads},
                worker_device=device.worker_device,
                model_key=model_key,
                external_measure=self.external_measure,
            )
            engine.start()
            slot.engines[spec.key] = engine
        slot.engines.move_to_end(spec.key)
        return engine

    async def _discard(self, slot: DeviceSlot, engine: EngineProcess) -> None:
        """Forget an engine that failed to build (the next experiment builds it afresh)."""
        if slot.engines.get(engine.spec.key) is engine:
            del slot.engines[engine.spec.key]
        await engine.stop()

    async def warm(self, work: ExperimentWork, device: str | None = None) -> EngineProcess:
        """Build (or find) the engine ``work`` needs and wait until ready; raises as
        :meth:`measure`.
        """
        slot = self.slot(device) if device else self.choose_slot(work)
        spec = self.spec_for(work, slot.device.name)
        async with slot.lock:
            engine = await self._engine(slot, spec, work.model_key)
            try:
                await engine.wait_ready()
            except EngineStartError as exc:
                await self._discard(slot, engine)
                raise (InvalidArgument if exc.invalid else FailedPrecondition)(
                    exc.message
                ) from None
            finally:
                self.on_change()
        return engine

    # ------------------------------------------------------------------ inspection
    @property
    def closed(self) -> bool:
        """The pool is shutting down (:meth:`close`): it starts no engine."""
        return self._closed

    def engines(self, model_name: str = "") -> list[EngineSnapshot]:
        """Snapshots of the engines held (all, or one model's), by device, LRU first."""
        return [
            e.snapshot()
            for slot in self.slots.values()
            for e in slot.engines.values()
            if not model_name or e.spec.model_name == model_name
        ]

    def processes(self) -> list[EngineProcess]:
        """The engine processes held, by device (for tests and the registry)."""
        return [e for slot in self.slots.values() for e in slot.engines.values()]

    def resident(self, device: str) -> list[tuple[str, str]]:
        """(tier, model key) of the engines held on ``device``, most recently used first."""
        slot = self.slots[device]
        return [(e.spec.tier, e.model_key) for e in reversed(slot.engines.values()) if not e.closed]

    @property
    def experiments_done(self) -> int:
        """Experiments finished on every device since the pool started."""
        return sum(s.experiments_done for s in self.slots.values())

    async def close(self) -> None:
        """Stop every engine; running experiments end (cancelled)."""
        self._closed = True
        for task in list(self._running):
            task.cancel()
        engines = self.processes()
        for slot in self.slots.values():
            slot.engines.clear()
        for engine in engines:
            engine.kill_now()
        await asyncio.gather(*(e.stop() for e in engines), return_exceptions=True)
        await asyncio.gather(*self._running, return_exceptions=True)
