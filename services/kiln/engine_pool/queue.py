"""The engine pool's side of the experiment work queue (contract: :mod:`kiln.common.work`; why:
docs/design/engine.md, "Work queue").

Every pool consumes each exact subject
``{prefix}.work.experiments.{device_kind}.{tier}.{model_key}`` through one shared durable pull
consumer (:func:`durable_name`). Subjects are found by scanning the stream every
``KILN_ENGINE_DISCOVER_S`` and by a core subscription to ``{prefix}.work.experiments.>``; a pool
serves those whose kind is one of its devices' own kinds (narrowed by ``KILN_ENGINE_HARDWARE``;
a device never takes another kind's work) and whose model ``KILN_ENGINE_MODELS`` allows (default
all). One worker per device fetches one message at a time while the device is free, in
:meth:`WorkConsumer.order` (the rule: :mod:`kiln.engine_pool.schedule`);
:mod:`kiln.engine_pool.delivery` takes each to its ack, nak or term.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import nats
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig

from kiln.common.errors import InvalidArgument
from kiln.common.nats import (
    connect,
    ensure_streams,
    owned_streams,
    parse_work_subject,
    wait_for_streams,
    work_filter,
    work_stream_name,
)
from kiln.common.settings import KilnSettings
from kiln.engine_pool.delivery import Deliveries
from kiln.engine_pool.metrics import WORK_QUEUED
from kiln.engine_pool.pool import DeviceSlot, EnginePool
from kiln.engine_pool.schedule import LaneView, WaitBounds, lane_order
from kiln.engine_pool.settings import EngineSettings

log = structlog.get_logger("kiln.engine_pool.queue")

FETCH_TIMEOUT_S = 0.5
"""Longest wait of one fetch from a subject that should hold work, seconds."""
BUSY_POLL_S = 0.1
"""How often a device worker looks whether its device is free again, seconds."""
ANY = "*"


def durable_name(device_kind: str, tier: str, model_key: str) -> str:
    """The durable consumer of one work subject, shared by every pool serving it, e.g.
    ``ep-h100-fast-1a2b3c4d5e6f``.
    """
    return f"ep-{device_kind}-{tier}-{model_key}"


def _csv(text: str) -> list[str]:
    return [t.strip().lower() for t in text.split(",") if t.strip()]


@dataclass(eq=False)
class Lane:
    """One work subject this pool consumes: ``subject`` and its tokens, ``sub`` (pull subscription),
    ``queued`` (messages held on it: last scan plus publishes seen minus handled here),
    ``published`` (publishes seen on it so far), ``since`` (``time.monotonic()`` when a device
    here last took a message from it, or when work appeared on it, whichever is later), ``lock``
    (one fetch at a time).
    """

    subject: str
    kind: str
    tier: str
    model_key: str
    sub: Any
    queued: int = 0
    published: int = 0
    since: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def count(self, n: int) -> None:
        """Set ``queued``; work appearing on an empty lane starts its wait."""
        if n > 0 >= self.queued:
            self.since = time.monotonic()
        self.queued = n


class WorkConsumer:
    """Consumes the work subjects this pool serves into an :class:`EnginePool`, one worker per
    device.

    Args:
        settings: NATS URL, subject prefix, ledger address. engine_settings: ack wait, max deliver,
            nak delay, hardware and models served, scan interval. pool: runs the experiments.

    Attributes:
        connected: set while consuming. deliveries: takes each message to its ack, nak or term.
        lanes: the subjects consumed now.
    """

    def __init__(
        self, settings: KilnSettings, engine_settings: EngineSettings, pool: EnginePool
    ) -> None:
        self.settings = settings
        self.engine_settings = engine_settings
        self.pool = pool
        self.connected = asyncio.Event()
        self.deliveries = Deliveries(settings, engine_settings, pool)
        self.lanes: dict[str, Lane] = {}
        self._js: JetStreamContext | None = None
        self._news = asyncio.Condition()
        self._generation = 0
        self._bounds = WaitBounds(engine_settings.full_max_wait_s, engine_settings.fast_max_wait_s)
        self._unbound: set[str] = set()
        self._hardware = _csv(engine_settings.hardware)
        self._models = set(_csv(engine_settings.models))
        self._warn_unserved()

    @property
    def handled(self) -> int:
        """Messages handled so far (acked, nacked or terminated)."""
        return self.deliveries.handled

    # ------------------------------------------------------------------ what is served
    def kinds_for(self, slot: DeviceSlot) -> list[str]:
        """The device kinds whose work ``slot`` takes: its device's own kind when
        ``KILN_ENGINE_HARDWARE`` allows it (empty or ``*``: every kind), else none. A device never
        takes another kind's work: an h100 workload is never measured on a CPU.
        """
        kind = slot.device.kind
        if not self._hardware or ANY in self._hardware or kind in self._hardware:
            return [kind]
        return []

    @property
    def hardware(self) -> list[str]:
        """Device kinds this pool takes work for (sorted), for the registry."""
        return sorted({kind for slot in self.pool.slots.values() for kind in self.kinds_for(slot)})

    @property
    def models(self) -> list[str]:
        """Model keys this pool takes work for (empty = every model)."""
        return sorted(self._models)

    @property
    def subjects(self) -> list[str]:
        """The subjects consumed now."""
        return sorted(self.lanes)

    def serves(self, kind: str, model_key: str) -> bool:
        """Whether some device of this pool takes work of ``kind`` on ``model_key``."""
        if self._models and model_key not in self._models:
            return False
        return kind in self.hardware

    def _slot_serves(self, slot: DeviceSlot, lane: Lane) -> bool:
        return lane.kind in self.kinds_for(slot)

    def _warn_unserved(self) -> None:
        """Log the ``KILN_ENGINE_HARDWARE`` kinds that no device here has (ignored)."""
        own = {slot.device.kind for slot in self.pool.slots.values()}
        ignored = sorted(set(self._hardware) - own - {ANY})
        if ignored:
            log.warning(
                "work.hardware_ignored",
                ignored=ignored,
                devices=sorted(own),
                why="a pool takes work only for its own devices' kinds "
                "(KILN_ENGINE_DEVICE_KIND names a GPU's kind)",
            )

    # ------------------------------------------------------------------ wiring
    def consumer_config(self, subject: str) -> ConsumerConfig:
        """The durable pull consumer of one work subject.

        Raises:
            InvalidArgument: not a work subject under the prefix.
        """
        kind, tier, key = parse_work_subject(self.settings.subject_prefix, subject)
        return ConsumerConfig(
            durable_name=durable_name(kind, tier, key),
            filter_subject=subject,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.engine_settings.ack_wait_s,
            max_deliver=-1,  # never drop an item: the delivery records what gave up
            description=f"kiln engine pools: {tier}-tier experiments of model {key} on {kind}",
        )

    async def _bind(self, js: JetStreamContext, subject: str) -> Lane:
        """Create (or find) the subject's durable consumer and bind a pull subscription."""
        stream = work_stream_name(self.settings.subject_prefix)
        config = self.consumer_config(subject)
        durable = str(config.durable_name)
        try:
            await js.add_consumer(stream, config)
        except nats.js.errors.BadRequestError as exc:
            # Exists with a config the server cannot update to ours (another pool's settings):
            # share it as it is rather than pull it from under that pool.
            log.info("work.consumer_exists", durable=durable, error=str(exc))
        sub = await js.pull_subscribe_bind(durable=durable, stream=stream)
        kind, tier, key = parse_work_subject(self.settings.subject_prefix, subject)
        lane = Lane(subject, kind, tier, key, sub)
        self.lanes[subject] = lane
        log.info("work.subject_bound", subject=subject, durable=durable)
        return lane

    async def _drop(self, lane: Lane) -> None:
        if self.lanes.get(lane.subject) is lane:
            del self.lanes[lane.subject]
        with contextlib.suppress(Exception):
            await lane.sub.unsubscribe()

    async def discover(self) -> None:
        """Scan the stream: bind every served subject that holds work and set its count. Raises what
        JetStream raises.
        """
        js = self._js
        if js is None:
            return
        prefix = self.settings.subject_prefix
        # Publishes seen while the snapshot is taken may be missing from it: they are added to
        # it (at worst one empty fetch), never lost until the next scan.
        seen = {subject: lane.published for subject, lane in self.lanes.items()}
        info = await js.stream_info(work_stream_name(prefix), subjects_filter=work_filter(prefix))
        counts: dict[str, int] = dict(info.state.subjects or {})
        noticed = set(self._unbound)  # publishes seen meanwhile stay for the next scan
        for subject in sorted(set(counts) | noticed):
            lane = self.lanes.get(subject)
            if lane is None:
                try:
                    kind, _, key = parse_work_subject(prefix, subject)
                except InvalidArgument:
                    continue
                if not self.serves(kind, key):
                    continue
                lane = await self._bind(js, subject)
            # Published after the scan's snapshot: worth one fetch.
            late = lane.published - seen.get(subject, lane.published)
            lane.count(counts.get(subject, 1 if subject in noticed else 0) + late)
        self._unbound -= noticed
        for subject, lane in self.lanes.items():
            if subject not in counts and subject not in noticed:
                lane.count(lane.published - seen.get(subject, lane.published))
        await self._notify()

    def _export_queued(self) -> None:
        """Set ``kiln_engine_work_queued`` per tier from the lanes' counts."""
        per_tier: dict[str, int] = {}
        for lane in self.lanes.values():
            per_tier[lane.tier] = per_tier.get(lane.tier, 0) + lane.queued
        for tier, n in per_tier.items():
            WORK_QUEUED.labels(tier=tier).set(n)

    async def _notify(self) -> None:
        self._export_queued()
        async with self._news:
            self._generation += 1
            self._news.notify_all()

    async def _on_published(self, msg: Msg) -> None:
        """A work item was published (core subscription): count it, or bind its subject."""
        try:
            kind, _, key = parse_work_subject(self.settings.subject_prefix, msg.subject)
        except InvalidArgument:
            return
        if not self.serves(kind, key):
            return
        lane = self.lanes.get(msg.subject)
        if lane is None:
            self._unbound.add(msg.subject)
        else:
            lane.published += 1
            lane.count(lane.queued + 1)
        await self._notify()

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
                credentials = self.settings.nats_credentials()
                nc = await connect(url, name="kiln-engine-pool", credentials=credentials)
                js = nc.jetstream()
                # The agent runner owns the work queue; on an open server, as anyone, we may
                # create it ourselves.
                await ensure_streams(
                    js, prefix, owned_streams("engine-pool", open_server=credentials is None)
                )
                await wait_for_streams(js, prefix, ("work",))
                await nc.subscribe(work_filter(prefix), cb=self._on_published)
                self._js = js
                await self.discover()
                self.connected.set()
                log.info(
                    "work.consuming",
                    prefix=prefix,
                    hardware=self.hardware,
                    models=self.models or "all",
                    devices=list(self.pool.slots),
                )
                tasks = [
                    asyncio.create_task(self._scan(stop), name="kiln-work-scan"),
                    *(
                        asyncio.create_task(self._worker(slot, stop), name=f"kiln-work-{name}")
                        for name, slot in self.pool.slots.items()
                    ),
                ]
                try:
                    await asyncio.gather(*tasks)
                finally:
                    for task in tasks:
                        task.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("work queue consumer stopped; retrying", error=str(exc) or repr(exc))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=2.0)
            finally:
                self.connected.clear()
                self._js = None
                self.lanes.clear()
                if nc is not None:
                    with contextlib.suppress(Exception):
                        await nc.close()

    async def _scan(self, stop: asyncio.Event) -> None:
        """Re-scan every ``discover_s``, and soon after a publish on an unbound subject."""
        while not stop.is_set():
            seen = self._generation
            await self._wait_news(stop, seen, self.engine_settings.discover_s, self._has_unbound)
            if stop.is_set():
                return
            try:
                await self.discover()
            except (nats.errors.Error, OSError, TimeoutError) as exc:  # NATS away: next time
                log.warning("work.scan_failed", error=str(exc) or repr(exc))

    def _has_unbound(self) -> bool:
        return bool(self._unbound)

    async def _wait_news(
        self,
        stop: asyncio.Event,
        seen: int,
        timeout_s: float,
        ready: Callable[[], bool] | None = None,
    ) -> None:
        """Wait for news after generation ``seen`` (and ``ready()`` if given), ``stop``, or
        ``timeout_s``.
        """

        def done() -> bool:
            if stop.is_set():
                return True
            return self._generation != seen and (ready is None or ready())

        async def wait() -> None:
            async with self._news:
                await self._news.wait_for(done)

        waiter = asyncio.ensure_future(wait())
        stopper = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({waiter, stopper}, timeout=timeout_s)
        finally:
            waiter.cancel()
            stopper.cancel()
            await asyncio.gather(waiter, stopper, return_exceptions=True)

    async def _worker(self, slot: DeviceSlot, stop: asyncio.Event) -> None:
        """Fetch and run experiments on ``slot``'s device, one at a time, while it is free."""
        device = slot.device.name
        while not stop.is_set():
            if slot.busy:  # a RunExperiment call holds the device
                await asyncio.sleep(BUSY_POLL_S)
                continue
            seen = self._generation
            try:
                found = await self._next(slot, stop)
            except (nats.errors.Error, OSError) as exc:  # NATS away (it reconnects by itself)
                log.warning("work.fetch_failed", device=device, error=str(exc) or repr(exc))
                await asyncio.sleep(1.0)
                continue
            if found is None:
                await self._wait_news(stop, seen, self.engine_settings.discover_s)
                continue
            lane, msg = found
            try:
                await self.deliveries.handle(msg, device=device)
            finally:
                lane.queued = max(0, lane.queued - 1)
                self._export_queued()

    def order(self, slot: DeviceSlot) -> list[Lane]:
        """The subjects ``slot`` fetches from, in :func:`kiln.engine_pool.schedule.lane_order`:
        overdue lanes first, then those that evict no engine (full tier first, taking turns),
        then the rest.
        """
        name = slot.device.name
        resident = self.pool.resident(name)
        elsewhere = {
            pair
            for other in self.pool.slots.values()
            if other is not slot
            for pair in self.pool.resident(other.device.name)
        }
        lanes = [lane for lane in self.lanes.values() if self._slot_serves(slot, lane)]
        now = time.monotonic()
        views = []
        for lane in lanes:
            pair = (lane.tier, lane.model_key)
            here = pair in resident
            elsewhere_only = not here and pair in elsewhere
            views.append(LaneView(lane.tier, now - lane.since, here, elsewhere_only))
        room = len(resident) < self.pool.settings.engines_per_device()
        return [lanes[i] for i in lane_order(views, room=room, bounds=self._bounds)]

    async def _next(self, slot: DeviceSlot, stop: asyncio.Event) -> tuple[Lane, Msg] | None:
        """The next message for ``slot``, or None when no subject it serves gave one."""
        for lane in self.order(slot):
            if stop.is_set():
                return None
            if lane.queued <= 0:
                continue
            msg = await self._fetch(lane)
            if msg is not None:
                lane.since = time.monotonic()  # its next message waits from now
                return lane, msg
            lane.queued = 0  # nothing deliverable now (in flight, nak delay): the next scan counts
        return None

    async def _fetch(self, lane: Lane) -> Msg | None:
        async with lane.lock:
            try:
                msgs = await lane.sub.fetch(1, timeout=FETCH_TIMEOUT_S)
            except nats.errors.TimeoutError:
                return None  # in flight elsewhere, or waiting out a nak delay
            except nats.js.errors.APIError as exc:  # e.g. the consumer was deleted
                log.warning("work.subject_lost", subject=lane.subject, error=str(exc))
                await self._drop(lane)
                self._unbound.add(lane.subject)
                return None
        return msgs[0] if msgs else None

    async def close(self) -> None:
        """Close the ledger clients."""
        await self.deliveries.close()
