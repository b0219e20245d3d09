"""The engine pool's microbenchmark responder: the cost model's tier 2 asks, a device answers.

Subscribes ``{prefix}.microbench.{kind}`` (queue group ``kiln-microbench``) for each device
kind of the pool; a request (:class:`~kiln.common.microbench_wire.MicrobenchRequest`)
takes one free-most device of that kind (its slot lock, so no experiment is timed beside it),
runs :mod:`kiln.engine_pool.microbench_run` pinned there with a wall limit of the request's
budget (capped by ``KILN_MICROBENCH_MAX_BUDGET_S``) plus start-up, appends one
``MicrobenchmarkMeasured`` event to ``microbench-<kind>-<versions key>`` through the ledger's
Append, and replies with a :class:`~kiln.common.microbench_wire.MicrobenchReply`. A
malformed request, a run that fails or a ledger that refuses is a reply with ``ok`` False and
the reason, never a silent drop. Retries connecting to NATS while it is down.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from typing import Any

import structlog
from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from kiln.common.microbench_wire import (
    QUEUE_GROUP,
    MicrobenchReply,
    MicrobenchRequest,
    microbench_subject,
)
from kiln.common.nats import connect
from kiln.common.settings import KilnSettings
from kiln.engine_pool.pool import DeviceSlot, EnginePool
from kiln.events.microbenchmarks import EVENT_TYPE, MicrobenchmarkMeasured, microbench_stream
from kiln.ledger.client import LedgerClient
from kiln.ledger.model import NewEvent

log = structlog.get_logger("kiln.engine_pool.microbench")

START_S = 30.0
"""Allowance for the subprocess to import torch and initialise the device, seconds."""


class MicrobenchSettings(BaseSettings):
    """``KILN_MICROBENCH_*``: ``max_budget_s`` caps a request's budget; ``enabled`` False
    leaves the subjects unsubscribed."""

    model_config = SettingsConfigDict(env_prefix="KILN_MICROBENCH_", extra="ignore")

    enabled: bool = True
    max_budget_s: float = Field(default=60.0, gt=0, le=3600)


class MicrobenchResponder:
    """Answers microbenchmark requests for the devices of ``pool``; ``connected`` is set while
    subscribed."""

    def __init__(
        self, settings: KilnSettings, pool: EnginePool, mb: MicrobenchSettings | None = None
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.mb = mb or MicrobenchSettings()
        self.connected = asyncio.Event()
        self.runs = 0

    @property
    def kinds(self) -> list[str]:
        """Device kinds of the pool, each subscribed once."""
        return sorted({d.kind for d in self.pool.devices})

    async def run(self, stop: asyncio.Event) -> None:
        """Subscribe (retrying while NATS is down) until ``stop``."""
        if not self.mb.enabled:
            return
        while not stop.is_set():
            nc = None
            try:
                nc = await connect(
                    self.settings.require_nats_url(),
                    name="kiln-microbench",
                    credentials=self.settings.nats_credentials(),
                )
                for kind in self.kinds:
                    subject = microbench_subject(self.settings.subject_prefix, kind)
                    await nc.subscribe(subject, queue=QUEUE_GROUP, cb=self._on_request)
                self.connected.set()
                await stop.wait()
            except Exception as exc:  # NATS down or unconfigured: retry
                log.info("microbench.nats_unavailable", error=repr(exc))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=5.0)
            finally:
                self.connected.clear()
                if nc is not None:
                    with contextlib.suppress(Exception):
                        await nc.close()

    async def _on_request(self, msg: Any) -> None:
        reply = await self.answer(msg.data)
        if msg.reply:
            with contextlib.suppress(Exception):
                await msg.respond(reply.model_dump_json().encode())

    async def answer(self, data: bytes) -> MicrobenchReply:
        """Parse, run, record; every failure is a reply naming it."""
        try:
            req = MicrobenchRequest.model_validate_json(data)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            return self._fail(f"invalid microbenchmark request: {where}: {err['msg']}")
        slots = [s for s in self.pool.slots.values() if s.device.kind == req.device_kind]
        if not slots:
            return self._fail(f"no {req.device_kind} device in pool {self.pool.pool_id}")
        slot = min(slots, key=lambda s: (s.busy, s.waiting))
        budget = min(req.budget_s, self.mb.max_budget_s)
        req = req.model_copy(update={"budget_s": budget})
        try:
            await _idle(slot, budget)
            async with slot.lock:
                out = await self._run(slot, req)
            event = MicrobenchmarkMeasured(
                device_kind=req.device_kind,
                device_name=str(out["device_name"]),
                versions={k: str(v) for k, v in out["versions"].items()},
                pool_id=self.pool.pool_id,
                model_name=req.model_name,
                results=out["results"],
                skipped=out["skipped"],
                wall_s=float(out["wall_s"]),
            )
            stream = microbench_stream(event.device_kind, event.device_name, event.versions)
            async with LedgerClient(self.settings.ledger_addr, "engine-pool") as ledger:
                body = event.model_dump(mode="json")
                await ledger.append(stream, [NewEvent(EVENT_TYPE, body)])
        except Exception as exc:
            log.warning("microbench.failed", error=repr(exc))
            return self._fail(f"microbenchmark run failed: {exc}")
        self.runs += 1
        log.info("microbench.recorded", stream=stream, results=len(event.results))
        return MicrobenchReply(
            ok=True,
            stream_id=stream,
            results=len(event.results),
            skipped=list(event.skipped),
            pool_id=self.pool.pool_id,
        )

    def _fail(self, error: str) -> MicrobenchReply:
        return MicrobenchReply(ok=False, error=error, pool_id=self.pool.pool_id)

    async def _run(self, slot: DeviceSlot, req: MicrobenchRequest) -> dict[str, Any]:
        """The subprocess's JSON; RuntimeError on a non-zero exit or a run past its limit."""
        env = {
            **os.environ,
            **slot.device.env(),
            "KILN_ENGINE_THREADS": self.pool.settings.threads,
        }
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "kiln.engine_pool.microbench_run",
            slot.device.worker_device,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        start = time.monotonic()
        try:
            stdout, stderr = await asyncio.wait_for(
                proc.communicate(req.model_dump_json().encode()), req.budget_s + START_S
            )
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise RuntimeError(
                f"no answer within {req.budget_s + START_S:g} s on {slot.device.name}"
            ) from None
        if proc.returncode != 0:
            tail = stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"exit {proc.returncode} on {slot.device.name}: {tail[0]}")
        log.debug("microbench.ran", device=slot.device.name, s=time.monotonic() - start)
        result: dict[str, Any] = json.loads(stdout)
        return result


async def _idle(slot: DeviceSlot, limit_s: float, poll_s: float = 0.2) -> None:
    """Wait, at most ``limit_s``, until ``slot`` runs nothing and no experiment waits for it:
    a microbenchmark yields to the compilations' experiments."""
    deadline = asyncio.get_running_loop().time() + limit_s
    while (slot.busy or slot.waiting) and asyncio.get_running_loop().time() < deadline:  # noqa: ASYNC110  (the slot has no event to wait on)
        await asyncio.sleep(poll_s)
