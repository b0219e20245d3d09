"""One compilation as one trace (kiln.common.tracing), across the real services in this process
(:mod:`tests.integration.pool_stack`: ledger, cost model, engine pool on the real NATS work
queue with simulated engines, agent runner) with the SDK's in-memory exporter: Compiler.Submit →
kiln.compilation → kiln.experiment.dispatch (NATS headers) → the engine pool's
kiln.experiment.run → kiln.experiment.measure and Ledger.Append. A garbage traceparent on the
work items changes nothing but the trace."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import pytest
import pytest_asyncio

from kiln.cli.compile_view import ENDED
from kiln.common import tracing
from kiln.common.settings import KilnSettings
from kiln.v1 import common_pb2, compiler_pb2

from .pool_stack import PoolStack, pool_stack

pytest.importorskip("opentelemetry.sdk", reason="the `tracing` extra is not installed")

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import SpanKind

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
MODEL = DATA / "models" / "llama-3.2-1b.json"

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not MODEL.is_file(), reason="../shared/data is absent"),
]

TEAM = "tracing"


@pytest.fixture(scope="module")
def exporter() -> Iterator[InMemorySpanExporter]:
    """Tracing on in this process for the module, into memory (before the services start:
    their interceptors are made then)."""
    found = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(found))
    tracing.install(provider)
    try:
        yield found
    finally:
        tracing.install(None)
        provider.shutdown()


@pytest_asyncio.fixture(scope="module")
async def stack(settings: KilnSettings, exporter: InMemorySpanExporter) -> AsyncIterator[PoolStack]:
    async with pool_stack(settings, "kt") as s:
        engines = s.pools["cpu-pool"].engines
        engines.full_open.set()
        await s.start_runner()
        yield s


async def _compile(stack: PoolStack, batch: int) -> compiler_pb2.Compilation:
    """Submit a short compilation on cpu (``batch``: a workload of its own) and wait for its
    end."""
    request = compiler_pb2.SubmitRequest(
        compilation_id=f"trace-{uuid.uuid4().hex[:12]}",
        workload=common_pb2.Workload(
            model=common_pb2.ModelSpec(name="llama-3.2-1b", config_json=MODEL.read_text()),
            traffic=common_pb2.TrafficShape(batch_size=batch, context_len=256),
            hardware=common_pb2.HardwareTarget(name="cpu"),
        ),
        budget=common_pb2.Budget(wall_seconds=15.0, max_experiments=4),  # a loaded host
        agents=["coordinate"],
        baselines=["none"],
    )
    async with stack.compiler(TEAM) as stub:
        reply = await stub.Submit(request, timeout=30)
        async with asyncio.timeout(60):
            while True:
                get = compiler_pb2.GetRequest(compilation_id=reply.compilation_id)
                snap = await stub.Get(get, timeout=20)
                if snap.status in ENDED:
                    return snap
                await asyncio.sleep(0.3)


def _named(spans: Sequence[ReadableSpan], name: str, **attrs: str) -> list[ReadableSpan]:
    return [
        s
        for s in spans
        if s.name == name
        and all((s.attributes or {}).get(f"kiln.{k}") == v for k, v in attrs.items())
    ]


def _ancestors(span: ReadableSpan, by_id: dict[int, ReadableSpan]) -> list[int]:
    """Span ids from ``span``'s parent up to the root, as far as they were exported."""
    found, parent = [], span.parent
    while parent is not None:
        found.append(parent.span_id)
        above = by_id.get(parent.span_id)
        parent = above.parent if above is not None else None
    return found


async def test_one_compilation_is_one_trace(
    stack: PoolStack, exporter: InMemorySpanExporter
) -> None:
    snap = await _compile(stack, batch=3)
    assert snap.status == compiler_pb2.COMPILATION_STATUS_SUCCEEDED, snap.reason
    cid = snap.compilation_id
    spans = exporter.get_finished_spans()
    by_id = {s.context.span_id: s for s in spans}

    (compilation,) = _named(spans, "kiln.compilation", compilation_id=cid)
    assert compilation.attributes is not None
    assert compilation.attributes["kiln.team"] == TEAM
    submit = by_id[compilation.parent.span_id]  # type: ignore[union-attr]
    assert submit.name == "/kiln.v1.Compiler/Submit" and submit.kind == SpanKind.SERVER
    trace_id = submit.context.trace_id

    dispatches = _named(spans, "kiln.experiment.dispatch", compilation_id=cid)
    assert dispatches, [s.name for s in spans]
    for d in dispatches:
        assert d.kind == SpanKind.PRODUCER and d.context.trace_id == trace_id
        assert compilation.context.span_id in _ancestors(d, by_id)
        assert {"kiln.experiment_id", "kiln.tier", "kiln.candidate_id", "kiln.team"} <= set(
            d.attributes or {}
        )

    runs = _named(spans, "kiln.experiment.run", compilation_id=cid)
    assert len(runs) >= len(dispatches) > 0
    dispatch_of = {(d.attributes or {})["kiln.experiment_id"]: d for d in dispatches}
    for run in runs:
        eid = (run.attributes or {})["kiln.experiment_id"]
        assert run.kind == SpanKind.CONSUMER and run.context.trace_id == trace_id
        assert run.parent is not None and run.parent.is_remote  # from the NATS headers
        assert run.parent.span_id == dispatch_of[eid].context.span_id
        (measure,) = [
            s for s in _named(spans, "kiln.experiment.measure") if s.parent == run.context
        ]
        assert (measure.attributes or {})["kiln.status"] in ("ok", "incorrect")
        appends = [
            s
            for s in _named(spans, "/kiln.v1.Ledger/Append")
            if s.kind == SpanKind.SERVER and run.context.span_id in _ancestors(s, by_id)
        ]
        assert appends, f"no Ledger.Append under {eid}'s run"  # its ExperimentCompleted
        assert all(a.context.trace_id == trace_id for a in appends)

    # The runner's own appends (ExperimentRequested, ...) belong to the trace too.
    runner_appends = [
        s
        for s in _named(spans, "/kiln.v1.Ledger/Append")
        if s.kind == SpanKind.SERVER and compilation.context.span_id in _ancestors(s, by_id)
    ]
    assert runner_appends
    no_secrets = json.dumps([dict(s.attributes or {}) for s in spans]).lower()
    assert "begin certificate" not in no_secrets and "private key" not in no_secrets


async def test_a_garbage_traceparent_changes_nothing_but_the_trace(
    stack: PoolStack, exporter: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Work items whose traceparent is garbage are measured and judged as always; the engine's
    spans start traces of their own."""

    def garbage(headers: dict[str, str]) -> dict[str, str]:
        return headers | {"traceparent": "00-not-a-trace-zz", "tracestate": "=\x00" * 50}

    monkeypatch.setattr(tracing, "inject", garbage)
    snap = await _compile(stack, batch=5)
    assert snap.status == compiler_pb2.COMPILATION_STATUS_SUCCEEDED, snap.reason
    spans = exporter.get_finished_spans()
    runs = _named(spans, "kiln.experiment.run", compilation_id=snap.compilation_id)
    assert runs
    (compilation,) = _named(spans, "kiln.compilation", compilation_id=snap.compilation_id)
    for run in runs:
        assert run.parent is None
        assert run.context.trace_id != compilation.context.trace_id
    statuses = [
        (s.attributes or {}).get("kiln.status")
        for s in _named(spans, "kiln.experiment.measure")
        if s.parent is not None and s.parent in [r.context for r in runs]
    ]
    assert statuses and all(status in ("ok", "incorrect") for status in statuses), statuses
