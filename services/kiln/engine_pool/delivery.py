"""One delivered work message, to its ack, nak or term (the pool's side of :mod:`kiln.common.work`):

1. parse :class:`~kiln.common.work.ExperimentWork`; malformed → ``term()``;
2. read ``experiment-<id>``: already completed → ack; no ``ExperimentRequested`` → ``term()``;
3. parse its candidate (once: :class:`~kiln.engine_pool.job.Job`) and run it on this device,
   sending ``in_progress()`` every third of ``ack_wait``; a malformed candidate or an unbuildable
   workload is REJECTED;
4. append ``ExperimentCompleted`` (expected version 1, the work's team, caused by and correlated
   with ``ExperimentRequested``); ``Aborted`` → completed elsewhere;
5. ack. Ledger unreachable after retries → ``nak(nak_delay_s)``; on the last delivery a failure to
   run is recorded as CRASHED.

A crash before the ack redelivers; the ledger check and expected version keep the ledger free of
duplicates.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from nats.aio.msg import Msg
from pydantic import ValidationError

from kiln.common.errors import Aborted, AlreadyExists, InvalidArgument, KilnError, NotFound
from kiln.common.settings import KilnSettings
from kiln.common.work import ExperimentWork
from kiln.domain import streams
from kiln.engine_pool.job import Job
from kiln.engine_pool.metrics import ANSWERED_ELSEWHERE, record_experiment
from kiln.engine_pool.pool import EnginePool
from kiln.engine_pool.settings import EngineSettings
from kiln.events.types import ExperimentCompleted
from kiln.ledger.client import LedgerClient
from kiln.ledger.model import NewEvent
from kiln.runtime.measurement import Measurement
from kiln.v1 import ledger_pb2

log = structlog.get_logger("kiln.engine_pool.queue")

APPEND_ATTEMPTS = 3


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
        engine_settings: ack wait, max deliver, nak delay.
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
            await self._handle(msg, work, device)
        except KilnError as exc:  # ledger trouble: try again later
            log.warning("work.retry_later", experiment_id=work.experiment_id, error=exc.message)
            with contextlib.suppress(Exception):
                await msg.nak(delay=self.engine_settings.nak_delay_s)
        except Exception:
            log.exception("work.failed", experiment_id=work.experiment_id)
            with contextlib.suppress(Exception):
                await msg.nak(delay=self.engine_settings.nak_delay_s)
        finally:
            heartbeat.cancel()

    async def _handle(self, msg: Msg, work: ExperimentWork, device: str | None) -> None:
        stream = streams.experiment_stream(work.experiment_id)
        ledger = self.ledger(work.team)
        bound = log.bind(experiment_id=work.experiment_id, tier=work.tier, device=device)
        requested, completed = await self._ledger_state(ledger, stream)
        if completed:
            bound.info("work.already_completed")
            await msg.ack()
            return
        if requested is None:
            bound.error("work.no_request", why="no ExperimentRequested in the ledger")
            await msg.term()
            return
        measurement = await self._measure(msg, work, device)
        event = NewEvent(
            "ExperimentCompleted",
            completed_payload(work, measurement),
            correlation_id=requested.metadata.correlation_id or None,
            causation_id=requested.event_id or None,
        )
        try:
            await _retrying(lambda: ledger.append(stream, [event], expected=1))
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

    async def _measure(self, msg: Msg, work: ExperimentWork, device: str | None) -> Measurement:
        """The work's measurement: its candidate parsed here (:meth:`Job.of`), then run by the
        pool; a malformed candidate or an unbuildable workload is REJECTED, a failure to run is
        raised (so the message is retried) but on its last delivery, where it is CRASHED."""
        candidate_id = ""
        try:
            job = Job.of(work)
            candidate_id = job.candidate.id
            return await self.pool.measure(job, device)
        except InvalidArgument as exc:
            return Measurement.failed(
                "rejected", exc.message, tier=work.tier, candidate_id=candidate_id
            )
        except KilnError as exc:
            delivered = msg.metadata.num_delivered if msg.metadata else 1
            if delivered < self.engine_settings.max_deliver:
                raise
            return Measurement.failed(
                "crashed", exc.message, tier=work.tier, candidate_id=candidate_id
            )

    async def _ledger_state(
        self, ledger: LedgerClient, stream: str
    ) -> tuple[ledger_pb2.RecordedEvent | None, bool]:
        """(the ExperimentRequested event or None, whether it is completed already)."""
        try:
            events = await _retrying(lambda: ledger.read_stream(stream))
        except NotFound:
            return None, False
        requested = next((e for e in events if e.type == "ExperimentRequested"), None)
        return requested, any(e.type == "ExperimentCompleted" for e in events)


async def _retrying(call: Callable[[], Awaitable[Any]]) -> Any:
    """``call()``, retried on transient ledger errors (UNAVAILABLE, DEADLINE_EXCEEDED, ...)
    up to :data:`APPEND_ATTEMPTS` times, 0.5 s then 1 s apart."""
    definite = (Aborted, AlreadyExists, InvalidArgument, NotFound)
    for attempt in range(APPEND_ATTEMPTS):
        try:
            return await call()
        except definite:
            raise
        except KilnError:
            if attempt == APPEND_ATTEMPTS - 1:
                raise
            await asyncio.sleep(0.5 * 2**attempt)
    raise AssertionError("unreachable")
