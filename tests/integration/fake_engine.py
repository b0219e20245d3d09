"""A stand-in for the engine pool in the agent runner's tests.

The engine pool (``services/kiln/engine_pool/``) is being built at the same time and these tests
must not depend on it, so :class:`FakeEngine` plays its part of the work-item contract
(``kiln.common.work``) against the real NATS work queue and the real ledger: it pulls
``ExperimentWork`` from a durable pull consumer, waits ``delay_s`` (the "measurement"), appends a
plausible ``ExperimentCompleted`` to ``experiment-<id>`` at expected version 1 (``Aborted``:
someone answered first, drop it) and acks.

Its throughput model: 1000 tokens/s for the reference, times a factor per op implementation and
transform (SDPA 1.3, fused QKV 1.1, ...), times a deterministic ±1 % per candidate; torch.compile
with one thread is reported incorrect, so failures show up too. The full tier (consumed apart,
so it can be paused on its own) reports a quarter of that with another deterministic ±6 % per
candidate, so fast and full rankings mostly, not always, agree.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Awaitable, Callable
from typing import Any

import nats.errors
from nats.aio.client import Client

from kiln.common import nats as kn
from kiln.common.errors import Aborted
from kiln.common.work import ExperimentWork
from kiln.ledger.client import LedgerClient
from kiln.ledger.model import NewEvent

from ..pki import service_tls

BASE_TOKENS_PER_S = 1000.0
OP_FACTORS = {
    ("attention", "sdpa"): 1.30,
    ("qkv_proj", "fused"): 1.10,
    ("mlp", "fused_gate_up"): 1.12,
    ("rms_norm", "fused_residual"): 1.04,
    ("rope", "cos_sin_cache"): 1.03,
}
THREAD_FACTORS = {"1": 0.55, "2": 1.0}


FULL_TIER_FACTOR = 0.25


def throughput(candidate: dict[str, Any], tier: str = "fast") -> tuple[float, bool]:
    """(tokens/s, correct) of a candidate's canonical JSON on ``tier`` under the fake model."""
    tps = BASE_TOKENS_PER_S
    for op, impl in candidate.get("ops", {}).items():
        tps *= OP_FACTORS.get((op, impl), 0.95)
    transforms = {t["name"]: t.get("params", {}) for t in candidate.get("transforms", [])}
    threads = transforms.get("threads", {}).get("n")
    if threads is not None:
        tps *= THREAD_FACTORS.get(threads, 1.05)
    if "torch_compile" in transforms:
        tps *= 1.2
    digest = hashlib.sha256(repr(sorted(candidate.items())).encode()).digest()
    tps *= 1.0 + (digest[0] / 255.0 - 0.5) * 0.02
    correct = not ("torch_compile" in transforms and threads == "1")
    if tier == "full":
        tps *= FULL_TIER_FACTOR * (1.0 + (digest[1] / 255.0 - 0.5) * 0.12)
    return tps, correct


FAKE_BATCH = 8
FAKE_CONTEXT = 512
"""The operating point every fake measurement reports (a CPU engine's default caps)."""


class FakeEngine:
    """Consumes ``{prefix}.work.experiments.*.fast.*`` with ``workers`` concurrent workers and
    ``{prefix}.work.experiments.*.full.*`` with one.

    Attributes:
        delay_s: seconds each experiment takes.
        handled: experiment ids answered, in order.
        deadlines: experiment id -> (tier, its work's ``deadline_s``), as taken.
        running: while cleared, every worker holds off (work stays queued).
        full_running: while cleared, the full-tier worker holds off.
        hold_full_when: awaited with each full-tier item as it is taken; True clears
            ``full_running`` at once, so that item and the full tier's next stay held.
    """

    def __init__(self, nats_url: str, prefix: str, ledger_addr: str, workers: int = 2) -> None:
        self.nats_url, self.prefix, self.ledger_addr = nats_url, prefix, ledger_addr
        self.workers = workers
        self.delay_s = 0.05
        self.handled: list[str] = []
        self.deadlines: dict[str, tuple[str, float]] = {}
        self.running = asyncio.Event()
        self.running.set()
        self.full_running = asyncio.Event()
        self.full_running.set()
        self.hold_full_when: Callable[[ExperimentWork], Awaitable[bool]] | None = None
        self._nc: Client | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._clients: dict[str, LedgerClient] = {}

    async def start(self) -> None:
        self._nc = await kn.connect(self.nats_url, "fake-engine")
        js = self._nc.jetstream()
        await kn.ensure_streams(js, self.prefix)
        sub = await js.pull_subscribe(
            kn.work_filter(self.prefix, tier="fast"),  # every device kind and model
            durable="fake-engine-fast",
            stream=kn.work_stream_name(self.prefix),
        )
        self._tasks = [asyncio.create_task(self._work(sub)) for _ in range(self.workers)]
        full = await js.pull_subscribe(
            kn.work_filter(self.prefix, tier="full"),
            durable="fake-engine-full",
            stream=kn.work_stream_name(self.prefix),
        )
        self._tasks.append(asyncio.create_task(self._work(full, self.full_running)))

    async def _work(self, sub: Any, gate: asyncio.Event | None = None) -> None:
        while True:
            await self.running.wait()
            if gate is not None:
                await gate.wait()
            try:
                msgs = await sub.fetch(1, timeout=0.5)
            except nats.errors.TimeoutError:
                continue
            for msg in msgs:
                work = ExperimentWork.from_json(msg.data)
                hold = self.hold_full_when
                if gate is not None and hold is not None and await hold(work):
                    gate.clear()
                # A fetch already waiting when a gate closed must not run its work: hold it
                # (in progress) until the gate opens again.
                while not (self.running.is_set() and (gate is None or gate.is_set())):
                    await msg.in_progress()
                    await asyncio.sleep(0.1)
                await self._handle(work)
                await msg.ack()

    async def _handle(self, work: ExperimentWork) -> None:
        self.deadlines[work.experiment_id] = (work.tier, work.deadline_s)
        await asyncio.sleep(self.delay_s)
        tps, correct = throughput(work.candidate, work.tier)
        median_ms = 1000.0 * 8 / tps
        data = {
            "compilation_id": work.compilation_id,
            "candidate_id": str(_candidate_id(work.candidate)),
            "status": "ok" if correct else "incorrect",
            "correct": correct,
            "max_abs_error": 0.0 if correct else 0.5,
            "median_ms": median_ms,
            "p10_ms": median_ms * 0.98,
            "p90_ms": median_ms * 1.03,
            "tokens_per_s": tps if correct else 0.0,
            "memory_bytes": 1 << 30,
            "engine_id": "fake-0",
            "tier": work.tier,
            "error": "" if correct else "max |error| 0.5 over tolerance",
            "batch_size": FAKE_BATCH,  # as a CPU engine caps the traffic's batch and context
            "context_len": FAKE_CONTEXT,
        }
        client = self._clients.get(work.team)
        if client is None:
            client = self._clients[work.team] = LedgerClient(
                self.ledger_addr,
                work.team,
                tls=service_tls("engine-pool"),  # it plays the pool
            )
        with contextlib.suppress(Aborted):  # answered already (e.g. timed out by the runner)
            await client.append(
                f"experiment-{work.experiment_id}", [NewEvent("ExperimentCompleted", data)], 1
            )
        self.handled.append(work.experiment_id)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for client in self._clients.values():
            await client.close()
        if self._nc is not None:
            for durable in ("fake-engine-fast", "fake-engine-full"):
                with contextlib.suppress(Exception):
                    await self._nc.jetstream().delete_consumer(
                        kn.work_stream_name(self.prefix), durable
                    )
            await self._nc.close()


def _candidate_id(candidate: dict[str, Any]) -> str:
    from kiln.domain.candidate import Candidate

    return Candidate.from_canonical(candidate).id
