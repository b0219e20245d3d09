"""The engine pool's side of the experiment work queue (contract: :mod:`kiln.common.work`).

One durable pull consumer per tier (``engine-pool-fast`` on ``work_subject(prefix, "fast")``,
``engine-pool-full`` on the full subject), explicit ack, ``max_deliver`` bounded; every engine
pool replica binds the same durables, so replicas share the work. Per message:

1. parse :class:`~kiln.common.work.ExperimentWork`; malformed → ``term()`` (logged);
2. read ``experiment-<id>`` from the ledger: already completed → ack (a redelivery or a second
   publish); no ``ExperimentRequested`` → ``term()`` (the contract was broken upstream);
3. run it on the pool, sending ``in_progress()`` every third of ``ack_wait`` meanwhile;
   a workload that cannot be built is recorded as REJECTED;
4. append ``ExperimentCompleted`` with expected version 1, as the work's team, caused by the
   ``ExperimentRequested`` event and in its correlation; ``Aborted`` → someone else completed it;
5. ack. The ledger unreachable (after retries) → ``nak(nak_delay_s)``: the work comes back and
   the append is retried then; on the last delivery a failure to run is recorded as CRASHED
   rather than dropped.

A crash anywhere before the ack redelivers the message; the ledger check and the expected version
keep the ledger free of duplicates.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import nats
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig
from pydantic import ValidationError

from kiln.common.errors import Aborted, AlreadyExists, InvalidArgument, KilnError, NotFound
from kiln.common.nats import connect, ensure_streams, work_stream_name, work_subject
from kiln.common.settings import KilnSettings
from kiln.common.work import ExperimentWork
from kiln.engine_pool.measurement import Measurement
from kiln.engine_pool.pool import EnginePool
from kiln.engine_pool.settings import EngineSettings
from kiln.events.types import ExperimentCompleted
from kiln.ledger.client import LedgerClient
from kiln.ledger.model import NewEvent
from kiln.v1 import ledger_pb2
from kiln.workloads.candidate import Candidate

log = structlog.get_logger("kiln.engine_pool.queue")

TIERS = ("fast", "full")
APPEND_ATTEMPTS = 3


def durable_name(tier: str) -> str:
    """The durable consumer of a tier's work, e.g. ``engine-pool-fast``."""
    return f"engine-pool-{tier}"


def _finite(x: float) -> float:
    return x if math.isfinite(x) else sys.float_info.max


def completed_payload(work: ExperimentWork, m: Measurement) -> dict[str, Any]:
    """The ``ExperimentCompleted`` payload of a measurement (validated; a non-finite
    ``max_abs_error`` is stored as the largest float, since the ledger stores JSON)."""
    candidate_id = m.candidate_id
    if not candidate_id:
        with contextlib.suppress(Exception):
            candidate_id = Candidate.from_canonical(work.candidate).id
    timing = m.timing
    event = ExperimentCompleted(
        compilation_id=work.compilation_id,
        candidate_id=candidate_id,
        status=m.status,
        correct=m.correct,
        max_abs_error=_finite(m.max_abs_error),
        median_ms=timing.median_ms if timing else 0.0,
        p10_ms=timing.p10_ms if timing else 0.0,
        p90_ms=timing.p90_ms if timing else 0.0,
        tokens_per_s=m.tokens_per_s,
        memory_bytes=m.memory.total_bytes,
        engine_id=m.engine_id,
        tier=work.tier,
        error=m.error,
    )
    return event.model_dump(mode="json")


class WorkConsumer:
    """Consumes the work queue of both tiers into an :class:`EnginePool`.

    Args:
        settings: NATS URL, subject prefix and ledger address.
        engine_settings: ack wait, max deliver, nak delay.
        pool: runs the experiments.

    Attributes:
        connected: set while consuming.
        handled: messages handled so far (acked, nacked or terminated).
    """

    def __init__(
        self, settings: KilnSettings, engine_settings: EngineSettings, pool: EnginePool
    ) -> None:
        self.settings = settings
        self.engine_settings = engine_settings
        self.pool = pool
        self.connected = asyncio.Event()
        self.handled = 0
        self._ledgers: dict[str, LedgerClient] = {}

    # ------------------------------------------------------------------ wiring
    def ledger(self, team: str) -> LedgerClient:
        """The ledger client acting as ``team`` (one per team, kept open)."""
        client = self._ledgers.get(team)
        if client is None:
            client = LedgerClient(self.settings.ledger_addr, team, timeout_s=10.0)
            self._ledgers[team] = client
        return client

    def consumer_config(self, tier: str) -> ConsumerConfig:
        """The durable pull consumer of ``tier``."""
        return ConsumerConfig(
            durable_name=durable_name(tier),
            filter_subject=work_subject(self.settings.subject_prefix, tier),
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.engine_settings.ack_wait_s,
            max_deliver=self.engine_settings.max_deliver,
            description=f"kiln engine pools: {tier}-tier experiments",
        )

    async def _subscribe(self, js: JetStreamContext, tier: str) -> Any:
        stream = work_stream_name(self.settings.subject_prefix)
        config = self.consumer_config(tier)
        try:
            await js.add_consumer(stream, config)
        except nats.js.errors.BadRequestError as exc:  # exists with another config: update it
            log.info("work.consumer_exists", tier=tier, error=str(exc))
            with contextlib.suppress(nats.js.errors.BadRequestError):
                await js.delete_consumer(stream, durable_name(tier))
                await js.add_consumer(stream, config)
        return await js.pull_subscribe_bind(durable=durable_name(tier), stream=stream)

    async def run(self, stop: asyncio.Event) -> None:
        """Connect (retrying while NATS is down or unconfigured) and consume until ``stop``."""
        prefix = self.settings.subject_prefix
        told = False
        while not stop.is_set():
            try:
                url = self.settings.require_nats_url()
            except RuntimeError as exc:  # not configured (yet): `kiln up` may record it later
                if not told:
                    log.info("work queue off until NATS is configured", reason=str(exc))
                    told = True
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=10.0)
                continue
            nc = None
            try:
                nc = await connect(url, name="kiln-engine-pool")
                js = nc.jetstream()
                await ensure_streams(js, prefix)
                subs = {tier: await self._subscribe(js, tier) for tier in TIERS}
                self.connected.set()
                log.info("work.consuming", prefix=prefix, tiers=list(subs))
                await asyncio.gather(*(self._consume(sub, stop) for sub in subs.values()))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("work queue consumer stopped; retrying", error=str(exc))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=2.0)
            finally:
                self.connected.clear()
                if nc is not None:
                    with contextlib.suppress(Exception):
                        await nc.close()

    async def _consume(self, sub: Any, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                msgs = await sub.fetch(1, timeout=1.0)
            except nats.errors.TimeoutError:
                continue
            for msg in msgs:
                await self.handle(msg)

    async def close(self) -> None:
        """Close the ledger clients."""
        for client in self._ledgers.values():
            with contextlib.suppress(Exception):
                await client.close()
        self._ledgers.clear()

    # ------------------------------------------------------------------ one message
    async def _heartbeat(self, msg: Msg) -> None:
        interval = max(1.0, self.engine_settings.ack_wait_s / 3)
        while True:
            await asyncio.sleep(interval)
            with contextlib.suppress(Exception):
                await msg.in_progress()

    async def handle(self, msg: Msg) -> None:
        """Process one delivered message to its ack, nak or term (see the module docstring)."""
        try:
            await self._handle_message(msg)
        finally:
            self.handled += 1

    async def _handle_message(self, msg: Msg) -> None:
        try:
            work = ExperimentWork.from_json(msg.data)
        except ValidationError as exc:
            log.error("work.malformed", subject=msg.subject, error=str(exc)[:500])
            await msg.term()
            return
        heartbeat = asyncio.create_task(self._heartbeat(msg))
        try:
            await self._handle(msg, work)
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

    async def _handle(self, msg: Msg, work: ExperimentWork) -> None:
        stream = f"experiment-{work.experiment_id}"
        ledger = self.ledger(work.team)
        bound = log.bind(experiment_id=work.experiment_id, tier=work.tier)
        requested, completed = await self._ledger_state(ledger, stream)
        if completed:
            bound.info("work.already_completed")
            await msg.ack()
            return
        if requested is None:
            bound.error("work.no_request", why="no ExperimentRequested in the ledger")
            await msg.term()
            return
        measurement = await self._measure(msg, work)
        event = NewEvent(
            "ExperimentCompleted",
            completed_payload(work, measurement),
            correlation_id=requested.metadata.correlation_id or None,
            causation_id=requested.event_id or None,
        )
        try:
            await _retrying(lambda: ledger.append(stream, [event], expected=1))
            bound.info("work.completed", status=measurement.status)
        except (Aborted, AlreadyExists) as exc:
            bound.info("work.completed_elsewhere", detail=exc.message)
        except InvalidArgument as exc:  # our payload was refused: nothing will fix it
            bound.error("work.refused_by_ledger", error=exc.message)
            await msg.term()
            return
        await msg.ack()

    async def _measure(self, msg: Msg, work: ExperimentWork) -> Measurement:
        try:
            return await self.pool.measure(work)
        except InvalidArgument as exc:
            return Measurement.failed("rejected", exc.message, tier=work.tier)
        except KilnError as exc:
            delivered = msg.metadata.num_delivered if msg.metadata else 1
            if delivered < self.engine_settings.max_deliver:
                raise
            return Measurement.failed("crashed", exc.message, tier=work.tier)

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
