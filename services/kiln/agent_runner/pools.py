"""Which hardware the engine pools serve, asked at Submit, so that a compilation for hardware no
pool serves is refused instead of waiting for ever (or, before pools served only their own kind,
being measured on another kind).

:class:`EnginePools` asks the engine pool at ``KILN_ENGINE_POOL_ADDR`` for the registry
(``ListEngines``: every registered pool, :mod:`kiln.engine_pool.registry`). A pool serves a
workload when its ``hardware`` names the workload's kind (:func:`kiln.common.work.device_kind`;
``*``: a pool of an older kiln that takes any kind) and its ``models`` allow the workload's model
key. :func:`check_served` raises FAILED_PRECONDITION, naming the hardware and what the pools
serve, when none does. When no engine pool answers, nothing is refused (a pool may be restarting:
the work waits in the queue for one) and a note says so. A note also names a device count asked
beyond the serving pools' devices of that kind (each experiment measures on one device).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from kiln.common.client import team_channel
from kiln.common.errors import FailedPrecondition
from kiln.common.logging import get_logger
from kiln.common.work import device_kind, model_key
from kiln.v1 import engine_pool_pb2, engine_pool_pb2_grpc

log = get_logger("kiln.agent_runner.pools")

ANY_KIND = "*"
"""What a pool of an older kiln registered when it took every kind."""


def _serves_kind(pool: engine_pool_pb2.PoolInfo, kind: str) -> bool:
    return kind in pool.hardware or ANY_KIND in pool.hardware


def _describe(pool: engine_pool_pb2.PoolInfo) -> str:
    """``pool h-1 on h: 2 h200 devices, takes h200`` (or ``takes no queued work``)."""
    kinds: dict[str, int] = {}
    for d in pool.devices:
        kinds[d.kind] = kinds.get(d.kind, 0) + 1
    devices = ", ".join(f"{n} {k} device{'s' if n > 1 else ''}" for k, n in kinds.items())
    takes = f"takes {', '.join(pool.hardware)}" if pool.hardware else "takes no queued work"
    return f"pool {pool.pool_id} on {pool.host}: {devices or 'no devices'}, {takes}"


def check_served(
    pools: Sequence[engine_pool_pb2.PoolInfo], workload: Mapping[str, Any], devices: int
) -> list[str]:
    """Notes for the caller (empty: nothing to say) about serving ``workload`` (a
    ``kiln.v1.Workload`` as JSON) with ``devices`` asked for (0: the target's default) by
    ``pools``, the registry as read.

    Raises:
        FailedPrecondition: no pool serves the workload's hardware kind (or its model).
    """
    kind, key = device_kind(workload), model_key(workload)
    by_kind = [p for p in pools if _serves_kind(p, kind)]
    serving = [p for p in by_kind if not p.models or key in p.models]
    if not serving:
        served = sorted({h for p in pools for h in p.hardware})
        listed = "; ".join(_describe(p) for p in pools) or "none registered"
        if by_kind:
            raise FailedPrecondition(
                f"no engine pool serving hardware {kind!r} takes this model (model key {key}; "
                f"KILN_ENGINE_MODELS): {listed}"
            )
        what = f"serve {', '.join(served)}" if served else "take no queued work"
        raise FailedPrecondition(
            f"no engine pool serves hardware {kind!r}: the registered engine pools {what} "
            f"({listed}). Submit for hardware a pool serves, or start an engine pool on "
            f"{kind} devices (a pool takes work only for its own devices' kind)"
        )
    have = sum(1 for p in serving for d in p.devices if d.kind == kind)
    if devices > max(have, 1):
        return [
            f"workload.hardware.num_devices is {devices}, but the engine pools serving {kind} "
            f"have {have} {kind} device{'s' if have != 1 else ''}: each experiment measures one "
            f"device, so figures for {devices} devices are the cost model's predictions"
        ]
    return []


class EnginePools:
    """Reads the engine pools' registry through the engine pool at ``addr`` (as ``team``),
    waiting at most ``timeout_s`` for an answer. Concurrent Submits share one read in flight
    (and a read younger than ``fresh_s``), so a burst of Submits asks the pool once."""

    def __init__(self, addr: str, team: str, timeout_s: float, fresh_s: float = 0.0) -> None:
        self.addr, self.team, self.timeout_s, self.fresh_s = addr, team, timeout_s, fresh_s
        self._channel: grpc.aio.Channel | None = None
        self._read: asyncio.Task[list[engine_pool_pb2.PoolInfo] | None] | None = None
        self._read_at = 0.0

    async def registered(self) -> list[engine_pool_pb2.PoolInfo] | None:
        """Every registered pool, or None when no engine pool answered."""
        read = self._read
        now = time.monotonic()
        if read is None or (read.done() and now - self._read_at > self.fresh_s):
            read = self._read = asyncio.create_task(self._ask())
            self._read_at = now
        return await asyncio.shield(read)

    async def _ask(self) -> list[engine_pool_pb2.PoolInfo] | None:
        if self._channel is None:
            self._channel = team_channel(self.addr, self.team)
        channel = self._channel
        stub = engine_pool_pb2_grpc.EnginePoolStub(channel)
        try:
            reply = await stub.ListEngines(
                engine_pool_pb2.ListEnginesRequest(), timeout=self.timeout_s
            )
        except grpc.RpcError as err:
            code = err.code() if hasattr(err, "code") else None
            log.warning("engine pools unreadable", addr=self.addr, code=str(code))
            self._read_at = 0.0  # the next Submit asks again
            if self._channel is channel:  # the next Submit dials afresh, without a backoff
                self._channel = None
                with contextlib.suppress(Exception):
                    await channel.close(None)
            return None
        return list(reply.pools)

    async def check(self, workload: Mapping[str, Any], devices: int) -> list[str]:
        """:func:`check_served` against the registry now; a note instead when it cannot be
        read. Raises as :func:`check_served`."""
        pools = await self.registered()
        if pools is None:
            kind = device_kind(workload)
            return [
                f"no engine pool answered at {self.addr}, so whether one serves hardware "
                f"{kind!r} is not known: the compilation waits for a pool of that kind"
            ]
        return check_served(pools, workload, devices)

    async def close(self) -> None:
        """Close the channel (after a read in flight)."""
        if self._read is not None and not self._read.done():
            with contextlib.suppress(Exception):
                await self._read
        if self._channel is not None:
            with contextlib.suppress(Exception):
                await self._channel.close(None)
            self._channel = None
