"""What the cost model has learnt from the ledger: microbenchmark tables and measured passes.

A follower reads the ledger's global order (``ReadAll``, following) from the start, so a
restarted cost model rebuilds everything it knew, and folds three event types:

- ``MicrobenchmarkMeasured`` (``microbench-*``): into that stream's
  :class:`~kiln.cost_model.microbench_table.MicrobenchTable`; the table of a device kind is
  the stream that last received an event (the newest software versions measured).
- ``CompilationSubmitted``: the compilation's model (config and dtype) and hardware.
- ``ExperimentCompleted`` of status ok and correct, at a recorded batch and context, on the
  full tier (all layers) or a fast tier whose layers the profile recorded: a measured pass of
  that (model, hardware); per operating point (batch, context, layers) the fastest is kept (the
  forward kiln would deploy), at most :data:`MAX_POINTS` points. Baseline experiments (other
  engines, ``ExperimentRequested.baseline``) are not evidence.

:meth:`Knowledge.evidence` gives a request its table and its decode and prefill calibrations
(:mod:`kiln.cost_model.calibration`: the predictions at the measured points, at tp=1 as the
engines ran, against the measurements; the prefill's from the timed prefills the completions
carry, ``prefill_median_ms`` of ``batch`` prompts of ``context`` tokens).
:meth:`Knowledge.want_microbenchmarks` asks an engine pool over NATS to measure a model's
shapes when the table lacks them (in the background, once per ``retry_s``); the results come
back through the ledger.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import structlog
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from kiln.common.microbench_wire import MicrobenchReply, microbench_subject
from kiln.common.settings import KilnSettings
from kiln.cost_model.calibration import Calibration, fit
from kiln.cost_model.evidence import Evidence
from kiln.cost_model.hardware import Hardware
from kiln.cost_model.microbench_table import MicrobenchTable
from kiln.cost_model.op_shapes import request_for
from kiln.cost_model.roofline import estimate
from kiln.cost_model.sharding import Parallelism
from kiln.domain.operating_point import OperatingPoint
from kiln.events.microbenchmarks import EVENT_TYPE, PREFIX
from kiln.workloads.config import ModelConfig

log = structlog.get_logger("kiln.cost_model.knowledge")

MAX_POINTS = 64
"""Measured operating points kept per (model, hardware), the newest."""
FOLLOWED = ("CompilationSubmitted", "ExperimentRequested", "ExperimentCompleted", EVENT_TYPE)


class CostSettings(BaseSettings):
    """``KILN_COST_*``: ``microbench`` (ask engine pools for missing tables; off by default: a
    run holds a device that a compilation's experiments may be waiting for), ``follow`` (read
    the ledger at all), ``microbench_budget_s`` (0: the grid's own), ``retry_s`` between two
    asks for the same shapes, ``request_timeout_s`` beyond the budget."""

    model_config = SettingsConfigDict(env_prefix="KILN_COST_", extra="ignore")

    follow: bool = True
    microbench: bool = False
    microbench_budget_s: float = Field(default=0.0, ge=0, le=3600)
    retry_s: float = Field(default=300.0, ge=0)
    request_timeout_s: float = Field(default=60.0, gt=0)


def _measured(table: MicrobenchTable, n: int, k: int, dtype: str) -> bool:
    """Whether ``table`` measured a GEMM of this (n, k) (not scaled from another)."""
    found = table.gemm(1, n, k, dtype)
    return found is not None and found.how != "scaled"


def model_key(config_json: str, dtype: str) -> str:
    """16 hex digits over the canonical config and the dtype: one model as the cost model
    sees it (weights' seed and directory do not change its speed)."""
    try:
        config: Any = json.loads(config_json)
    except ValueError:
        config = config_json
    body = json.dumps({"config": config, "dtype": dtype}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class PassPoint:
    """One measured decode step: ``ms`` at ``batch`` x ``context`` over ``layers`` (0: all);
    ``prefill_ms``: the fastest timed prefill of ``batch`` prompts of ``context`` tokens at
    that point, ms (0: none timed)."""

    batch: int
    context: int
    layers: int
    ms: float
    experiment_id: str
    prefill_ms: float = 0.0


class Knowledge:
    """The tables and measured passes folded so far; ``caught_up`` is set once the follower
    has read the ledger to its head."""

    def __init__(self, settings: KilnSettings, cost: CostSettings | None = None) -> None:
        self.settings = settings
        self.cost = cost or CostSettings()
        self.tables: dict[str, MicrobenchTable] = {}
        self.latest: dict[str, str] = {}
        self.compilations: dict[str, tuple[str, str]] = {}
        self.configs: dict[str, tuple[str, str]] = {}
        self.baselines: set[str] = set()
        self.passes: dict[tuple[str, str], OrderedDict[tuple[int, int, int], PassPoint]] = {}
        self.position = 0
        self.version = 0
        self.caught_up = asyncio.Event()
        self._asked: dict[tuple[str, str, str], float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._nc: Any = None
        self._cal: dict[tuple[Any, ...], tuple[Calibration | None, Calibration | None]] = {}
        self._snapshots: dict[str, MicrobenchTable] = {}

    # ------------------------------------------------------------------ folding
    def fold(self, stream_id: str, event_type: str, data: dict[str, Any]) -> None:
        """Fold one event (see the module docs); anything malformed is skipped."""
        self.version += 1
        if event_type == EVENT_TYPE and stream_id.startswith(PREFIX):
            kind = str(data.get("device_kind", ""))
            table = self.tables.setdefault(stream_id, MicrobenchTable(stream_id, kind))
            table.add_event(data)
            self.latest[kind] = stream_id
        elif event_type == "CompilationSubmitted":
            model = (data.get("workload") or {}).get("model") or {}
            text = str(model.get("config_json") or model.get("configJson") or "")
            dtype = str(model.get("dtype") or "")
            key = model_key(text, dtype)
            self.configs[key] = (text, dtype)
            self.compilations[stream_id.removeprefix("compilation-")] = (key, str(data["hardware"]))
        elif event_type == "ExperimentRequested" and data.get("baseline"):
            self.baselines.add(stream_id)
        elif event_type == "ExperimentCompleted":
            self._fold_pass(stream_id, data)

    def _fold_pass(self, stream_id: str, data: dict[str, Any]) -> None:
        if data.get("status") != "ok" or not data.get("correct") or stream_id in self.baselines:
            return
        found = self.compilations.get(str(data.get("compilation_id", "")))
        batch, ctx, ms = (
            int(data.get("batch_size", 0)),
            int(data.get("context_len", 0)),
            float(data.get("median_ms", 0.0)),
        )
        layers = (
            0
            if data.get("tier") == "full"
            else int((data.get("op_profile_shape") or {}).get("layers", -1))
        )
        if found is None or batch < 1 or ctx < 1 or ms <= 0 or layers < 0:
            return
        prefill = float(data.get("prefill_median_ms", 0.0) or 0.0)
        prefill = prefill if math.isfinite(prefill) and prefill > 0 else 0.0
        points = self.passes.setdefault(found, OrderedDict())
        at = (batch, ctx, layers)
        old = points.pop(at, None)
        keep = (
            old
            if old is not None and old.ms <= ms
            else PassPoint(batch, ctx, layers, ms, stream_id)
        )
        prefills = [p for p in (prefill, old.prefill_ms if old else 0.0) if p > 0]
        points[at] = dataclasses.replace(keep, prefill_ms=min(prefills, default=0.0))
        while len(points) > MAX_POINTS:
            points.popitem(last=False)

    # ------------------------------------------------------------------ reading
    def table_for(self, hw: Hardware) -> MicrobenchTable | None:
        """The newest table of the device kind named like ``hw``: a snapshot that the follower's
        later events do not change (planner threads read it), the same until the next event."""
        stream = self.latest.get(hw.name)
        live = self.tables.get(stream) if stream else None
        if live is None:
            return None
        snap = self._snapshots.get(live.stream_id)
        if snap is None or snap.events != live.events:
            snap = self._snapshots[live.stream_id] = live.snapshot()
        return snap

    def evidence(
        self,
        cfg: ModelConfig,
        config_json: str,
        dtype_field: str,
        hw: Hardware,
        wdtype: str,
        adtype: str,
    ) -> Evidence:
        """The table and calibration for ``cfg`` (its spec's ``config_json`` and ``dtype``) on
        ``hw``."""
        table = self.table_for(hw)
        key = (model_key(config_json, dtype_field), hw.name)
        points = self.passes.get(key)
        graphs = hw.name != "cpu"
        cal = None
        if points:
            memo = (
                key,
                table.stream_id if table else "",
                table.events if table else 0,
                tuple(points.values()),
                wdtype,
                adtype,
            )
            if memo not in self._cal:
                if len(self._cal) > 256:  # evidence moved on: forget the old fits
                    self._cal.clear()
                self._cal[memo] = self._calibrate(
                    cfg, hw, list(points.values()), Evidence(table, None, graphs), wdtype, adtype
                )
            cal, prefill = self._cal[memo]
            return Evidence(table, cal, graphs, prefill)
        return Evidence(table, None, graphs)

    def _calibrate(
        self,
        cfg: ModelConfig,
        hw: Hardware,
        points: list[PassPoint],
        base: Evidence,
        wdtype: str,
        adtype: str,
    ) -> tuple[Calibration | None, Calibration | None]:
        """The decode and the prefill calibrations: each point predicted at tp=1 as the engine
        ran it (its prefill: ``batch`` prompts of ``context`` tokens in one pass)."""
        decode, prefill = [], []
        for p in points:
            model = cfg.with_layers(p.layers) if 0 < p.layers < cfg.num_hidden_layers else cfg
            at = OperatingPoint(batch_size=p.batch, context_len=p.context, isl=p.context, osl=1)
            est = estimate(model, hw, at, Parallelism(), wdtype, adtype, base, p.batch)
            decode.append((p.ms, est.tpot_ms))
            if p.prefill_ms > 0:
                prefill.append((p.prefill_ms, est.ttft_ms))
        return fit(decode), fit(prefill)

    def measured_passes(self, config_json: str, dtype_field: str, hw_name: str) -> list[PassPoint]:
        """The measured passes kept for a model on a hardware kind."""
        return list(self.passes.get((model_key(config_json, dtype_field), hw_name), {}).values())

    # ------------------------------------------------------------------ the follower
    async def run(self, stop: asyncio.Event) -> None:
        """Follow the ledger until ``stop``, resuming after the last position on any error."""
        if not self.cost.follow:
            return
        from kiln.ledger.client import LedgerClient

        told = False  # said once that the ledger is down, until it is back
        while not stop.is_set():
            try:
                async with LedgerClient(self.settings.ledger_addr, "cost-model") as ledger:
                    head = 0
                    async for ev in ledger.read_all(self.position, max_count=0, types=FOLLOWED):
                        self._fold_recorded(ev)
                        head = ev.position
                    self.caught_up.set()
                    told = False
                    log.info("knowledge.caught_up", position=head or self.position)
                    follow = ledger.read_all(self.position, follow=True, types=FOLLOWED)
                    reader = asyncio.create_task(self._follow(follow))
                    stopper = asyncio.create_task(stop.wait())
                    await asyncio.wait({reader, stopper}, return_when=asyncio.FIRST_COMPLETED)
                    for task in (reader, stopper):
                        task.cancel()
                        with contextlib.suppress(asyncio.CancelledError, Exception):
                            await task
            except Exception as exc:  # ledger down: retry from the last position
                (log.info if not told else log.debug)(
                    "knowledge.ledger_unavailable", error=repr(exc)
                )
                told = True
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=2.0)

    async def _follow(self, stream: Any) -> None:
        async for ev in stream:
            self._fold_recorded(ev)

    def _fold_recorded(self, ev: Any) -> None:
        self.position = max(self.position, ev.position)
        try:
            self.fold(ev.stream_id, ev.type, json.loads(ev.data))
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("knowledge.skipped", position=ev.position, error=repr(exc))

    # ------------------------------------------------------------------ asking for tables
    def want_microbenchmarks(self, cfg: ModelConfig, hw: Hardware, wdtype: str) -> bool:
        """Ask an engine pool of ``hw``'s kind to measure ``cfg``'s shapes, in the background,
        unless the table has them or they were asked for within ``retry_s``; True when asked."""
        if not self.cost.microbench:
            return False
        tps = tuple(t for t in (1, 2, 4, 8) if t <= hw.max_devices_per_node)
        try:
            req = request_for(cfg, hw.name, wdtype, tps)
        except ValueError as exc:  # shapes no device could run: the roofline stays
            log.warning("knowledge.no_microbenchmarks", model=cfg.name, error=str(exc)[:300])
            return False
        if self.cost.microbench_budget_s:
            req = req.model_copy(update={"budget_s": self.cost.microbench_budget_s})
        table = self.table_for(hw)
        if table is not None and all(_measured(table, g.n, g.k, wdtype) for g in req.gemm):
            return False
        key = (hw.name, cfg.name, wdtype)
        now = time.monotonic()
        if now - self._asked.get(key, -1e18) < self.cost.retry_s:
            return False
        self._asked[key] = now
        task = asyncio.get_running_loop().create_task(
            self._ask(req.model_dump_json().encode(), hw.name, req.budget_s)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def _ask(self, body: bytes, kind: str, budget_s: float) -> None:
        try:
            if self._nc is None:
                from kiln.common.nats import connect

                self._nc = await connect(
                    self.settings.require_nats_url(),
                    name="kiln-cost-model",
                    credentials=self.settings.nats_credentials(),
                )
            subject = microbench_subject(self.settings.subject_prefix, kind)
            msg = await self._nc.request(
                subject, body, timeout=budget_s + self.cost.request_timeout_s
            )
            reply = MicrobenchReply.model_validate_json(msg.data)
            log.info(
                "knowledge.microbenchmarks",
                kind=kind,
                ok=reply.ok,
                results=reply.results,
                error=reply.error or None,
            )
        except Exception as exc:  # no pool of that kind, NATS down: the roofline stays
            log.info("knowledge.microbenchmarks_unanswered", kind=kind, error=repr(exc))

    async def close(self) -> None:
        """Cancel asks in flight and close NATS."""
        for task in list(self._tasks):
            task.cancel()
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.close()
