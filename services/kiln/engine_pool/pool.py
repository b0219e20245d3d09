"""The pool of persistent engines on this host, keyed by engine spec.

Engines are created lazily, the first time an experiment needs their spec (model, tier, dtype,
operating point). At most ``max_engines`` are held (1 by default, per device): when a different
spec is needed, the least recently used engine is stopped once its running experiment ends.
Each engine runs one experiment at a time; the pool runs experiments on different engines
concurrently.

An experiment keeps its engine until the engine answers, even when the caller stops waiting
(a cancelled RunExperiment): the engine's pipe protocol is never cut mid-answer.
"""

from __future__ import annotations

import asyncio
import socket
from collections import OrderedDict

import structlog

from kiln.common.errors import FailedPrecondition, InvalidArgument
from kiln.common.work import ExperimentWork
from kiln.engine_pool.measurement import Measurement
from kiln.engine_pool.process import EngineProcess, EngineSnapshot, EngineStartError
from kiln.engine_pool.request import RunRequest
from kiln.engine_pool.settings import EngineSettings
from kiln.engine_pool.spec import EngineSpec, SpecError
from kiln.workloads.candidate import Candidate

log = structlog.get_logger("kiln.engine_pool")


class EnginePool:
    """Engines by spec key, LRU first.

    Args:
        settings: engine settings (device, caps, timing, max engines).
        host: host name reported in engine ids (default: this host's).
    """

    def __init__(self, settings: EngineSettings, *, host: str | None = None) -> None:
        self.settings = settings
        self.host = host or socket.gethostname()
        self._engines: OrderedDict[str, EngineProcess] = OrderedDict()
        self._admit = asyncio.Lock()
        self._running: set[asyncio.Task[Measurement]] = set()
        self._closed = False

    # ------------------------------------------------------------------ specs
    def spec_for(self, work: ExperimentWork) -> EngineSpec:
        """The engine spec ``work`` needs.

        Raises:
            InvalidArgument: the workload cannot be built (no or bad config, unsupported or
                unbuildable architecture, unknown dtype).
        """
        try:
            return EngineSpec.from_workload(work.workload, work.tier, self.settings.limits())
        except SpecError as exc:
            raise InvalidArgument(str(exc)) from None

    def engine_id(self, spec: EngineSpec) -> str:
        """``<model>/<tier>/<key prefix>@<host>``."""
        return f"{spec.model_name}/{spec.tier}/{spec.key[:8]}@{self.host}"

    # ------------------------------------------------------------------ experiments
    async def measure(self, work: ExperimentWork) -> Measurement:
        """Run ``work`` on an engine of its spec (created on first use).

        Returns:
            The measurement; a bad candidate is a REJECTED measurement, not an error.

        Raises:
            InvalidArgument: the workload cannot be built (see :meth:`spec_for`), or its engine
                failed to build for a reason of the workload (e.g. missing weights).
            FailedPrecondition: the engine failed to build for a reason of the host, or the
                pool is closed.
        """
        spec = self.spec_for(work)
        try:
            candidate = Candidate.from_canonical(work.candidate)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            return Measurement.failed(
                "rejected",
                f"malformed candidate: {exc!r}",
                engine_id=self.engine_id(spec),
                tier=spec.tier,
            )
        request = RunRequest(
            experiment_id=work.experiment_id,
            candidate=candidate.canonical(),
            warmup=self.settings.warmup,
            repeats=self.settings.repeats,
            min_repeats=min(self.settings.min_repeats, self.settings.repeats),
            measure_budget_s=self.settings.measure_budget_s,
        )
        task = asyncio.create_task(self._run(spec, request, work.deadline_s, candidate.id))
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return await asyncio.shield(task)

    async def _run(
        self, spec: EngineSpec, request: RunRequest, deadline_s: float, candidate_id: str
    ) -> Measurement:
        while True:
            engine = await self._checkout(spec)
            async with engine.lock:
                if engine.closed:
                    continue  # evicted while we waited: check out again
                try:
                    measurement = await engine.run(request, deadline_s, candidate_id)
                except EngineStartError as exc:
                    await self._discard(engine)
                    if exc.invalid:
                        raise InvalidArgument(exc.message) from None
                    raise FailedPrecondition(exc.message) from None
            log.info(
                "experiment.measured",
                experiment_id=request.experiment_id,
                engine_id=engine.engine_id,
                status=measurement.status,
                median_ms=measurement.timing.median_ms if measurement.timing else None,
            )
            return measurement

    async def _checkout(self, spec: EngineSpec) -> EngineProcess:
        """The engine of ``spec``, started (after evicting the LRU one) when missing."""
        async with self._admit:
            if self._closed:
                raise FailedPrecondition("the engine pool is shutting down")
            engine = self._engines.get(spec.key)
            if engine is None or engine.closed:
                while len(self._engines) >= self.settings.engines_per_device():
                    _, victim = self._engines.popitem(last=False)
                    log.info("engine.evicting", engine_id=victim.engine_id, for_spec=spec.key)
                    async with victim.lock:
                        await victim.stop()
                engine = EngineProcess(
                    spec, self.engine_id(spec), ready_timeout_s=self.settings.ready_timeout_s
                )
                engine.start()
                self._engines[spec.key] = engine
            self._engines.move_to_end(spec.key)
            return engine

    async def _discard(self, engine: EngineProcess) -> None:
        """Forget an engine that failed to build (the next experiment builds it afresh)."""
        if self._engines.get(engine.spec.key) is engine:
            del self._engines[engine.spec.key]
        await engine.stop()

    async def warm(self, work: ExperimentWork) -> EngineProcess:
        """Build (or find) the engine ``work`` needs and wait until it is ready.

        Raises:
            InvalidArgument, FailedPrecondition: as :meth:`measure`.
        """
        engine = await self._checkout(self.spec_for(work))
        try:
            await engine.wait_ready()
        except EngineStartError as exc:
            await self._discard(engine)
            raise (InvalidArgument if exc.invalid else FailedPrecondition)(exc.message) from None
        return engine

    # ------------------------------------------------------------------ inspection
    def engines(self, model_name: str = "") -> list[EngineSnapshot]:
        """Snapshots of the engines held (all, or one model's), least recently used first."""
        return [
            e.snapshot()
            for e in self._engines.values()
            if not model_name or e.spec.model_name == model_name
        ]

    async def close(self) -> None:
        """Stop every engine; running experiments end (cancelled)."""
        self._closed = True
        for task in list(self._running):
            task.cancel()
        engines = list(self._engines.values())
        self._engines.clear()
        for engine in engines:
            engine.kill_now()
        await asyncio.gather(*(e.stop() for e in engines), return_exceptions=True)
        await asyncio.gather(*self._running, return_exceptions=True)
