"""One delivered work message, to its ack, nak or term (the pool's side of :mod:`kiln.common.work`):

1. parse :class:`~kiln.common.work.ExperimentWork`; malformed → ``term()``;
2. read ``experiment-<id>``: already completed → ack; no ``ExperimentRequested`` → ``term()``;
3. take what the ledger recorded (:func:`~kiln.engine_pool.provenance.ledger_work`): a body
   that disagrees with it is forged → ``term()``, logged, nothing measured;
4. parse the ledger's candidate (once: :class:`~kiln.engine_pool.job.Job`) and run it on this
   device, sending ``in_progress()`` every third of ``ack_wait``; a malformed candidate or an
   unbuildable workload is REJECTED;
5. append ``ExperimentCompleted`` (expected version 1, the recorded team, caused by and
   correlated with ``ExperimentRequested``); ``Aborted`` → completed elsewhere;
6. ack.

Infrastructure is not the candidate's fault (docs/design/security.md, "Recovery"). A ledger that
is unavailable is waited out while the message is held (heartbeats go on, no delivery is spent)
for up to ``outage_wait_s``, then the message is nak'd. An engine process that dies
mid-experiment is restarted by the pool and the experiment run again, up to ``max_deliver``
attempts. An engine that cannot be built on this host is nak'd (another pool may take it) and
recorded CRASHED on delivery ``max_deliver``. A message delivered more than
``max_redeliveries`` times (pools died holding it) is recorded CRASHED without running again:
JetStream's own ``max_deliver`` is unlimited, so no work item is ever dropped unrecorded.

With tracing on (:mod:`kiln.common.tracing`), a message is handled in a ``kiln.experiment.run``
span continuing the ``traceparent`` in its headers (a malformed one is ignored), each run on an
engine in a ``kiln.experiment.measure`` span.

A crash before the ack redelivers; the ledger check and expected version keep the ledger free of
duplicates.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import structlog
from nats.aio.msg import Msg
from pydantic import ValidationError

from kiln.common import tracing
from kiln.common.backoff import backoff_s
from kiln.common.errors import (
    Aborted,
    AlreadyExists,
    DeadlineExceeded,
    InvalidArgument,
    KilnError,
    NotFound,
    Unavailable,
)
from kiln.common.settings import KilnSettings
from kiln.common.work import ExperimentWork
from kiln.domain import streams
from kiln.engine_pool.job import Job
from kiln.engine_pool.metrics import ANSWERED_ELSEWHERE, record_experiment
from kiln.engine_pool.pool import EnginePool
from kiln.engine_pool.provenance import Forged, ledger_work
from kiln.engine_pool.settings import EngineSettings
from kiln.events.types import ExperimentCompleted
from kiln.ledger.client import LedgerClient
from kiln.ledger.convert import recorded_data
from kiln.ledger.model import NewEvent
from kiln.runtime.measurement import Measurement
from kiln.v1 import ledger_pb2

log = structlog.get_logger("kiln.engine_pool.queue")

T = TypeVar("T")

APPEND_ATTEMPTS = 3
"""Tries of a ledger call that fails for a reason other than an outage (then: nak)."""
OUTAGE_MAX_PAUSE_S = 10.0
"""Longest pause between two tries of a ledger that is unavailable, seconds."""


def _finite(x: float) -> float:
    return x if math.isfinite(x) else sys.float_info.max


def completed_payload(work: ExperimentWork, m: Measurement) -> dict[str, Any]:
    """The ``ExperimentCompleted`` payload of a measurement (validated; a non-finite
    ``max_abs_error`` is stored as the largest float, since the ledger stores JSON; the
    candidate id is the measurement's, "" for a malformed candidate)."""
    timing = m.timing
    event = ExperimentCompleted(
        compilation_id=work.compilation_id,
        candidate_id=m.candidate_id,
        status=m.status,
        correct=m.correct,
        max_abs_error=_finite(m.max_abs_error),
        median_ms=timing.median_ms if timing else 0.0,
        p10_ms=timing.p10_ms if timing else 0.0,
        p90_ms=timing.p90_ms if timing else 0.0,
        mean_ms=timing.mean_ms if timing else 0.0,
        max_ms=timing.max_ms if timing else 0.0,
        tokens_per_s=m.tokens_per_s,
        memory_bytes=m.memory.total_bytes,
        engine_id=m.engine_id,
        tier=work.tier,
        error=m.error,
        weights_bytes=m.memory.weights_bytes,
        kv_cache_bytes=m.memory.kv_cache_bytes,
        workspace_bytes=m.memory.workspace_bytes,
        prefill_median_ms=m.prefill.median_ms if m.prefill else 0.0,
        prefill_tokens_per_s=m.prefill_tokens_per_s,
        phases_ms={k: round(v, 3) for k, v in m.phases_ms.items()},
        device_ms=round(m.device_ms, 3),
        environment=dict(m.environment),
        batch_size=m.batch_size,
        context_len=m.context_len,
        op_ms={k: round(v, 4) for k, v in m.op_ms.items()},
        op_profile_shape=dict(m.op_profile_shape),
        verified_steps=m.verified_steps,
        escape_probability=m.escape_probability,
    )
    return event.model_dump(mode="json")


class Deliveries:
    """Handles the messages a :class:`~kiln.engine_pool.queue.WorkConsumer` fetched.

    Args:
        settings: the ledger address.
        engine_settings: ack wait, attempts, redeliveries, nak delay, outage wait.
        pool: runs the experiments.

    Attributes:
        handled: messages handled so far (acked, nacked or terminated).
    """

    def __init__(
        self, settings: KilnSettings, engine_settings: EngineSettings, pool: EnginePool
    ) -> None:
        self.settings = settings
        self.engine_settings = engine_settings
        self.pool = pool
        self.handled = 0
        self._ledgers: dict[str, LedgerClient] = {}

    def ledger(self, team: str) -> LedgerClient:
        """The ledger client acting as ``team`` (one per team, kept open)."""
        client = self._ledgers.get(team)
        if client is None:
            client = LedgerClient(self.settings.ledger_addr, team, timeout_s=10.0)
            self._ledgers[team] = client
        return client

    async def close(self) -> None:
        """Close the ledger clients."""
        for client in self._ledgers.values():
            with contextlib.suppress(Exception):
                await client.close()
        self._ledgers.clear()

    async def _heartbeat(self, msg: Msg) -> None:
        interval = max(1.0, self.engine_settings.ack_wait_s / 3)
        while True:
            await asyncio.sleep(interval)
            with contextlib.suppress(Exception):
                await msg.in_progress()

    async def handle(self, msg: Msg, device: str | None = None) -> None:
        """Process one delivered message to its ack, nak or term (see the module docstring),
        running it on ``device`` (default: the pool's choice)."""
        try:
            await self._handle_message(msg, device)
        finally:
            self.handled += 1

    async def _handle_message(self, msg: Msg, device: str | None) -> None:
        try:
            work = ExperimentWork.from_json(msg.data)
        except ValidationError as exc:
            log.error("work.malformed", subject=msg.subject, error=str(exc)[:500])
            await msg.term()
            return
        heartbeat = asyncio.create_task(self._heartbeat(msg))
        try:
            with tracing.span(
                "kiln.experiment.run",
                kind="consumer",
                parent=tracing.extract(msg.headers),  # the dispatcher's, if well-formed
                compilation_id=work.compilation_id,
                experiment_id=work.experiment_id,
                tier=work.tier,
                team=work.team,
                device=device,
            ):
                await self._handle(msg, work, device)
        except Forged as exc:
            log.error(
                "work.forged",
                experiment_id=work.experiment_id,
                subject=msg.subject,
                error=exc.message,
            )
            with contextlib.suppress(Exception):
                await msg.term()
        except KilnError as exc:  # ledger or host trouble: try again later
            log.warning("work.retry_later", experiment_id=work.experiment_id, error=exc.message)
            with contextlib.suppress(Exception):
                await msg.nak(delay=self.engine_settings.nak_delay_s)
        except Exception:
            log.exception("work.failed", experiment_id=work.experiment_id)
            with contextlib.suppress(Exception):
                await msg.nak(delay=self.engine_settings.nak_delay_s)
        finally:
            heartbeat.cancel()

    async def _handle(self, msg: Msg, body: ExperimentWork, device: str | None) -> None:
        stream = streams.experiment_stream(body.experiment_id)
        bound = log.bind(experiment_id=body.experiment_id, tier=body.tier, device=device)
        reader = self.ledger(body.team)
        requested, completed = await self._ride_out(
            lambda: self._ledger_state(reader, stream), "read", bound
        )
        if completed:
            bound.info("work.already_completed")
            await msg.ack()
            return
        if requested is None:
            bound.error("work.no_request", why="no ExperimentRequested in the ledger")
            await msg.term()
            return
        work = ledger_work(body, recorded_data(requested), requested.metadata.team)
        delivered = msg.metadata.num_delivered if msg.metadata else 1
        if delivered > self.engine_settings.max_redeliveries:
            measurement = Measurement.failed(
                "crashed",
                f"delivered {delivered} times without an answer (engine pools stopped or lost "
                "NATS while holding it); not run again",
                tier=work.tier,
                candidate_id=str(recorded_data(requested).get("candidate_id", "")),
            )
        else:
            measurement = await self._measure(work, device, delivered)
        event = NewEvent(
            "ExperimentCompleted",
            completed_payload(work, measurement),
            correlation_id=requested.metadata.correlation_id or None,
            causation_id=requested.event_id or None,
        )
        ledger = self.ledger(work.team)
        try:
            await self._ride_out(
                lambda: ledger.append(stream, [event], expected=1), "append", bound
            )
            bound.info("work.completed", status=measurement.status)
            record_experiment(work.tier, measurement.status, measurement.device_ms)
        except (Aborted, AlreadyExists) as exc:
            bound.info("work.completed_elsewhere", detail=exc.message)
            record_experiment(work.tier, ANSWERED_ELSEWHERE, measurement.device_ms)
        except InvalidArgument as exc:  # our payload was refused: nothing will fix it
            bound.error("work.refused_by_ledger", error=exc.message)
            await msg.term()
            return
        await msg.ack()

    async def _measure(
        self, work: ExperimentWork, device: str | None, delivered: int
    ) -> Measurement:
        """The work's measurement: its candidate parsed here (:meth:`Job.of`), then run by the
        pool. A malformed candidate or an unbuildable workload is REJECTED. An engine that died
        mid-experiment (restarted by the pool) runs it again, up to ``max_deliver`` attempts,
        then CRASHED. An engine that cannot be built here raises (nak: another pool may take
        it) but on delivery ``max_deliver``, where it is CRASHED. A pool shutting down always
        raises."""
        candidate_id = ""
        attempts = self.engine_settings.max_deliver
        try:
            job = Job.of(work)
            candidate_id = job.candidate.id
            for attempt in range(1, attempts + 1):
                measurement = await self._traced_measure(job, device, attempt)
                if not measurement.engine_died:
                    return measurement
                log.warning(
                    "work.engine_died",
                    experiment_id=work.experiment_id,
                    attempt=attempt,
                    of=attempts,
                    error=measurement.error,
                )
                if attempt < attempts:
                    await asyncio.sleep(self.engine_settings.nak_delay_s)
            measurement.error = f"{measurement.error} (on each of {attempts} attempts)"
            measurement.engine_died = False
            return measurement
        except InvalidArgument as exc:
            return Measurement.failed(
                "rejected", exc.message, tier=work.tier, candidate_id=candidate_id
            )
        except KilnError as exc:
            if self.pool.closed or delivered < self.engine_settings.max_deliver:
                raise
            return Measurement.failed(
                "crashed", exc.message, tier=work.tier, candidate_id=candidate_id
            )

    async def _traced_measure(self, job: Job, device: str | None, attempt: int) -> Measurement:
        """``pool.measure`` in a ``kiln.experiment.measure`` span carrying the outcome and the
        measurement's phases (load, bind, check, measure, ...) in milliseconds."""
        with tracing.span(
            "kiln.experiment.measure",
            experiment_id=job.work.experiment_id,
            tier=job.work.tier,
            candidate_id=job.candidate.id,
            device=device,
        ) as span:
            measurement = await self.pool.measure(job, device)
            if span is not None:
                values: dict[str, float | int | str | bool] = {
                    "kiln.attempt": attempt,
                    "kiln.status": str(measurement.status),
                    "kiln.correct": measurement.correct,
                    "kiln.engine_id": str(measurement.engine_id),
                    "kiln.device_ms": measurement.device_ms,
                }
                values.update({f"kiln.phase_ms.{k}": v for k, v in measurement.phases_ms.items()})
                tracing.set_attributes(span, values)
            return measurement

    async def _ride_out(self, call: Callable[[], Awaitable[T]], what: str, bound: Any) -> T:
        """``call()`` (a ledger call), tried again while the ledger is unavailable (UNAVAILABLE,
        DEADLINE_EXCEEDED) for up to ``outage_wait_s`` with growing, jittered pauses, and up to
        :data:`APPEND_ATTEMPTS` times on other transient errors; definite answers (Aborted,
        AlreadyExists, InvalidArgument, NotFound) at once. Raises the last error when it gives
        up (the caller naks)."""
        definite = (Aborted, AlreadyExists, InvalidArgument, NotFound)
        deadline = time.monotonic() + self.engine_settings.outage_wait_s
        failures = other = 0
        while True:
            try:
                return await call()
            except definite:
                raise
            except KilnError as exc:
                failures += 1
                if not isinstance(exc, Unavailable | DeadlineExceeded):
                    other += 1
                    if other >= APPEND_ATTEMPTS:
                        raise
                elif time.monotonic() >= deadline:
                    raise
                if failures == 1 or failures % 10 == 0:
                    bound.warning(
                        "work.ledger_unavailable", call=what, failures=failures, error=exc.message
                    )
                await asyncio.sleep(backoff_s(failures, max_s=OUTAGE_MAX_PAUSE_S))

    async def _ledger_state(
        self, ledger: LedgerClient, stream: str
    ) -> tuple[ledger_pb2.RecordedEvent | None, bool]:
        """(the ExperimentRequested event or None, whether it is completed already)."""
        try:
            events = await ledger.read_stream(stream)
        except NotFound:
            return None, False
        requested = next((e for e in events if e.type == "ExperimentRequested"), None)
        return requested, any(e.type == "ExperimentCompleted" for e in events)
