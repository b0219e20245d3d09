"""The engine registry: every engine pool writes its :class:`PoolRecord` into the key-value
bucket ``{prefix}_engines`` under ``pool.<pool id>`` every ``KILN_ENGINE_HEARTBEAT_S`` and soon
after any engine changes state. The bucket's TTL drops a pool that stops heartbeating; a clean
stop deletes the record (docs/design/engine.md, "Engine registry").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import nats
import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from kiln.common import nats as kn
from kiln.common.nats import connect
from kiln.common.settings import KilnSettings
from kiln.engine_pool.process import EngineSnapshot
from kiln.engine_pool.settings import EngineSettings

log = structlog.get_logger("kiln.engine_pool.registry")

KEY_PREFIX = "pool."
"""Registry keys are ``pool.<pool id>``."""
READ_TIMEOUT_S = 5.0
"""Longest read of the whole registry (ListEngines), seconds."""
MIN_PUT_INTERVAL_S = 0.5
"""Changes within this many seconds of a heartbeat wait for the next one, seconds."""


def registry_bucket(prefix: str) -> str:
    """The key-value bucket of the registry, e.g. ``kiln_engines`` (stream ``KV_kiln_engines``)."""
    return kn.registry_bucket(prefix)


@dataclass
class DeviceRecord:
    """One device of a pool (``kiln.v1.DeviceInfo``)."""

    device: str
    kind: str
    label: str = ""
    busy: bool = False
    experiments_done: int = 0


@dataclass
class PoolRecord:
    """What one pool registers (``kiln.v1.PoolInfo``); times are Unix seconds.

    Attributes:
        ttl_s: seconds after ``heartbeat_at`` at which the record expires.
        hardware, models: device kinds (its devices' own; ``*`` from an older kiln: any) and
            model keys (empty = all) it takes work for.
        subjects: the work subjects it consumes now.
        local: this process's own record (never serialized).
    """

    pool_id: str
    host: str
    pid: int
    started_at: float
    heartbeat_at: float
    ttl_s: float
    devices: list[DeviceRecord] = field(default_factory=list)
    engines: list[EngineSnapshot] = field(default_factory=list)
    hardware: list[str] = field(default_factory=list)
    models: list[str] = field(default_factory=list)
    subjects: list[str] = field(default_factory=list)
    experiments_done: int = 0
    local: bool = False

    def to_json(self) -> bytes:
        """The KV value."""
        body = asdict(self)
        body.pop("local")
        body["engines"] = [e.to_dict() for e in self.engines]
        return json.dumps(body, separators=(",", ":")).encode()

    @staticmethod
    def from_json(data: bytes) -> PoolRecord:
        """Inverse of :meth:`to_json` (unknown keys ignored); KeyError, TypeError or ValueError
        if not a record.
        """
        body: dict[str, Any] = json.loads(data)
        return PoolRecord(
            pool_id=str(body["pool_id"]),
            host=str(body["host"]),
            pid=int(body["pid"]),
            started_at=float(body["started_at"]),
            heartbeat_at=float(body["heartbeat_at"]),
            ttl_s=float(body["ttl_s"]),
            devices=[DeviceRecord(**d) for d in body.get("devices", [])],
            engines=[EngineSnapshot.from_dict(e) for e in body.get("engines", [])],
            hardware=[str(h) for h in body.get("hardware", [])],
            models=[str(m) for m in body.get("models", [])],
            subjects=[str(s) for s in body.get("subjects", [])],
            experiments_done=int(body.get("experiments_done", 0)),
        )


class Registry:
    """Keeps this pool registered and reads every pool's record.

    Attributes:
        connected: set while the bucket is reachable.
        ttl_s: the bucket's TTL, seconds (the configured one until bound).
        heartbeats: records written so far.
    """

    def __init__(
        self,
        settings: KilnSettings,
        engine_settings: EngineSettings,
        record: Callable[[float], PoolRecord],
    ) -> None:
        self.settings = settings
        self.engine_settings = engine_settings
        self.record = record
        self.connected = asyncio.Event()
        self.ttl_s = engine_settings.registry_ttl_s
        self.heartbeats = 0
        self._kv: KeyValue | None = None
        self._poked = asyncio.Event()

    @property
    def interval_s(self) -> float:
        """Seconds between heartbeats: ``heartbeat_s``, at most a third of the TTL."""
        return max(MIN_PUT_INTERVAL_S, min(self.engine_settings.heartbeat_s, self.ttl_s / 3))

    def local(self) -> PoolRecord:
        """This pool's record, now."""
        return self.record(self.ttl_s)

    def key(self) -> str:
        """This pool's key in the bucket."""
        return KEY_PREFIX + self.local().pool_id

    def poke(self) -> None:
        """Write the record soon (at least :data:`MIN_PUT_INTERVAL_S` after the last)."""
        self._poked.set()

    # ------------------------------------------------------------------ heartbeats
    async def run(self, stop: asyncio.Event) -> None:
        """Connect (retrying) and heartbeat until ``stop``; then delete this pool's record."""
        told = False
        while not stop.is_set():
            try:
                url = self.settings.require_nats_url()
            except RuntimeError:
                if not told:
                    log.info("registry off until NATS is configured")
                    told = True
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=10.0)
                continue
            nc: Client | None = None
            try:
                nc = await connect(
                    url, name="kiln-engine-registry", credentials=self.settings.nats_credentials()
                )
                self._kv = await self._bucket(nc.jetstream())
                self.connected.set()
                log.info("registry.registered", key=self.key(), ttl_s=self.ttl_s)
                await self._heartbeat(stop)
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._kv.delete(self.key()), timeout=2.0)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("registry stopped; retrying", error=str(exc) or repr(exc))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=2.0)
            finally:
                self.connected.clear()
                self._kv = None
                if nc is not None:
                    with contextlib.suppress(Exception):
                        await nc.close()

    async def _bucket(self, js: JetStreamContext) -> KeyValue:
        bucket = registry_bucket(self.settings.subject_prefix)
        try:
            kv = await js.create_key_value(
                bucket=bucket,
                ttl=self.engine_settings.registry_ttl_s,
                history=1,
                description="kiln engine pools and their engines (heartbeats, TTL)",
            )
        except nats.js.errors.BadRequestError:  # exists with another TTL: use it as it is
            kv = await js.key_value(bucket)
        status = await kv.status()
        ttl = status.ttl or self.engine_settings.registry_ttl_s
        if abs(ttl - self.engine_settings.registry_ttl_s) > 1e-3:
            log.info("registry.ttl_from_bucket", bucket=bucket, ttl_s=ttl)
        self.ttl_s = ttl
        return kv

    async def _heartbeat(self, stop: asyncio.Event) -> None:
        assert self._kv is not None
        while not stop.is_set():
            self._poked.clear()
            record = self.local()
            await self._kv.put(KEY_PREFIX + record.pool_id, record.to_json())
            self.heartbeats += 1
            waiter = asyncio.ensure_future(self._poked.wait())
            stopper = asyncio.ensure_future(stop.wait())
            try:
                await asyncio.wait({waiter, stopper}, timeout=self.interval_s)
            finally:
                waiter.cancel()
                stopper.cancel()
            if self._poked.is_set() and not stop.is_set():
                await asyncio.sleep(MIN_PUT_INTERVAL_S)  # gather a burst of changes

    # ------------------------------------------------------------------ reading
    async def pools(self) -> list[PoolRecord]:
        """Every registered pool, this one first; just this one when the bucket cannot be read."""
        own = self.local()
        kv = self._kv
        if kv is None:
            return [own]
        try:
            others = await asyncio.wait_for(self._read(kv, own.pool_id), READ_TIMEOUT_S)
        except Exception as exc:
            log.warning("registry.unreadable", error=str(exc) or repr(exc))
            return [own]
        return [own, *sorted(others, key=lambda r: r.pool_id)]

    async def _read(self, kv: KeyValue, own_id: str) -> list[PoolRecord]:
        try:
            keys = await kv.keys()
        except nats.js.errors.NoKeysError:
            return []
        records = []
        for key in keys:
            if not key.startswith(KEY_PREFIX) or key == KEY_PREFIX + own_id:
                continue
            try:
                entry = await kv.get(key)
            except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
                # expired or deleted meanwhile
                continue
            if not entry.value:
                continue
            try:
                records.append(PoolRecord.from_json(entry.value))
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("registry.bad_record", key=key, error=str(exc))
        return records


def now() -> float:
    """Unix time, seconds (the registry's clock)."""
    return time.time()
