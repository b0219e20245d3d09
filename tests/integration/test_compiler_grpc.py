"""The agent runner's Compiler API over real gRPC, with the real ledger, cost model and NATS.

In-process servers (``kiln.common.server.serve``): the ledger (real PostgreSQL), the cost model
and the agent runner; plus :class:`tests.integration.fake_engine.FakeEngine`, a stand-in for the
engine pool, which is being built concurrently and which these tests must not depend on: it
pulls ``ExperimentWork`` from the real NATS work queue and appends a plausible
``ExperimentCompleted`` to the real ledger.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio

from kiln.agent_runner.agents import DEFAULT_AGENTS
from kiln.agent_runner.app import AgentRunnerApp
from kiln.agent_runner.config import RunnerConfig
from kiln.agent_runner.space import space_for
from kiln.board import Board
from kiln.common import nats as kn
from kiln.common.client import team_channel
from kiln.common.server import serve
from kiln.common.settings import KilnSettings
from kiln.cost_model.app import create_app as create_cost_model
from kiln.domain.candidate import REFERENCE_CANDIDATE
from kiln.ledger.app import LedgerApp
from kiln.ledger.client import LedgerClient
from kiln.v1 import common_pb2, compiler_pb2, compiler_pb2_grpc, ledger_pb2

from ..pki import ServiceLedger, operator_tls  # ServiceLedger writes as the services do
from .fake_engine import FAKE_BATCH, FAKE_CONTEXT, FakeEngine

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
MODELS = DATA / "models"
TRACE = DATA / "traces" / "azure_llm_2023_conv.csv"

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not (MODELS / "llama-3.2-1b.json").is_file() or not TRACE.is_file(),
        reason="../shared/data (models, traces) is absent",
    ),
]

TEAM = "search"
SPACE = space_for("cpu")
RUNNER_CONFIG = RunnerConfig(
    experiment_deadline_s=5.0,
    baseline_deadline_s=6.0,
    experiment_margin_s=2.0,
    search_share=0.1,
    search_min_deadline_s=1.0,
    plan_timeout_s=2.0,
    plan_attempts=2,
    plan_outage_s=0.5,
    cancel_wait_s=5.0,
    resume_retry_s=0.5,
    # A confirmation due when the wall clock runs out may hold the search this much longer:
    # short, so that the baselines after the search come when these tests expect them.
    confirm_grace_s=0.2,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _serve(app: Any, cfg: KilnSettings, addr: str) -> asyncio.Task[None]:
    started = asyncio.Event()
    task = asyncio.create_task(serve(app, cfg, listen=addr, started=started, handle_signals=False))
    await asyncio.wait_for(started.wait(), 20)
    return task


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


@dataclass
class Stack:
    """The servers of this module and clients of them."""

    settings: KilnSettings
    engine: FakeEngine
    ledger: LedgerClient
    board: Board
    stub: compiler_pb2_grpc.CompilerStub
    workload: common_pb2.Workload

    async def start_runner(self, **changes: Any) -> tuple[str, asyncio.Task[None]]:
        """Another agent runner on its own port (same ledger and prefix), once it has resumed
        what it found open (one runner per ledger is the rule: each test makes sure no other
        runner resumes, i.e. runs, its compilation)."""
        addr = f"127.0.0.1:{_free_port()}"
        cfg = self.settings.model_copy(update=changes)
        return addr, await _serve_runner(cfg, addr)


async def _serve_runner(cfg: KilnSettings, addr: str) -> asyncio.Task[None]:
    app = AgentRunnerApp(cfg, RUNNER_CONFIG)
    task = await _serve(app, cfg, addr)
    await asyncio.wait_for(app.resumed.wait(), 20)
    return task


@pytest_asyncio.fixture(scope="module")
async def stack(settings: KilnSettings) -> AsyncIterator[Stack]:
    from kiln.workloads.traffic import TrafficShape, read_trace

    prefix = f"{settings.subject_prefix}ar"
    ledger_addr, cost_addr, runner_addr = (f"127.0.0.1:{_free_port()}" for _ in range(3))
    cfg = settings.model_copy(
        update={
            "subject_prefix": prefix,
            "ledger_addr": ledger_addr,
            "cost_model_addr": cost_addr,
            "agent_runner_addr": runner_addr,
            "metrics_port": 0,
            "grace_period_s": 1.0,
        }
    )
    tasks = [await _serve(LedgerApp(cfg), cfg, ledger_addr)]
    tasks.append(await _serve(create_cost_model(cfg), cfg, cost_addr))
    engine = FakeEngine(cfg.require_nats_url(), prefix, ledger_addr)
    await engine.start()
    tasks.append(await _serve_runner(cfg, runner_addr))
    shape = TrafficShape.from_trace(read_trace(TRACE)).to_proto()
    workload = common_pb2.Workload(
        model=common_pb2.ModelSpec(
            name="llama-3.2-1b", config_json=(MODELS / "llama-3.2-1b.json").read_text()
        ),
        traffic=shape,
        hardware=common_pb2.HardwareTarget(name="cpu"),
    )
    nc = await kn.connect(cfg.require_nats_url(), "test-compiler")
    async with (
        ServiceLedger(ledger_addr, TEAM) as ledger,
        team_channel(runner_addr, TEAM) as channel,
    ):
        yield Stack(
            cfg,
            engine,
            ledger,
            Board(nc.jetstream(), prefix),
            compiler_pb2_grpc.CompilerStub(channel),
            workload,
        )
    for task in reversed(tasks[1:]):
        await _stop(task)
    await engine.stop()
    await _stop(tasks[0])
    await kn.delete_streams(nc.jetstream(), prefix)
    await nc.close()


RESUME_AGENTS = ["coordinate", "random"]
"""Agents of the restart tests: simple proposals, so the runs they check are short and easy to
follow (the default set's optuna/combiner timing varies with the machine's load). Whether a
leader beats the reference on the full tier still depends on timing, so these tests check that
every best there is is sound, not that one exists."""


def _request(stack: Stack, wall_s: float, max_experiments: int, **kw: Any) -> Any:
    return compiler_pb2.SubmitRequest(
        compilation_id=kw.pop("compilation_id", f"t-{uuid.uuid4().hex[:12]}"),
        workload=kw.pop("workload", stack.workload),
        budget=common_pb2.Budget(wall_seconds=wall_s, max_experiments=max_experiments),
        **kw,
    )


async def _watch(
    stub: compiler_pb2_grpc.CompilerStub,
    cid: str,
    *,
    after: int = 0,
    until: str = "CompilationEnded",
    count: int = 1,
    timeout_s: float = 30.0,
) -> list[compiler_pb2.CompilationEvent]:
    """Watch events until the ``count``-th event of type ``until`` (or the stream ends)."""
    got: list[compiler_pb2.CompilationEvent] = []
    call = stub.Watch(compiler_pb2.WatchRequest(compilation_id=cid, after_position=after))

    async def read() -> None:
        async for event in call:
            got.append(event)
            if sum(e.type == until for e in got) >= count:
                return

    try:
        await asyncio.wait_for(read(), timeout_s)
    finally:
        call.cancel()
    return got


async def _story(ledger: LedgerClient, cid: str, after: int = 0) -> list[ledger_pb2.RecordedEvent]:
    """Every event of a compilation (its stream and its experiments), in global order."""
    out = []
    async for event in ledger.read_all(after):
        data = json.loads(event.data)
        if event.stream_id == f"compilation-{cid}" or data.get("compilation_id") == cid:
            out.append(event)
    return out


def _check_experiments_settled(story: list[ledger_pb2.RecordedEvent]) -> list[dict[str, Any]]:
    """Every ExperimentRequested has exactly one ExperimentCompleted, before CompilationEnded;
    no candidate was requested twice on one tier (but the reference, again on the full tier
    for every confirmation); every full-tier candidate was measured on the fast tier first,
    right after a full-tier reference; TierAgreement comes once, just before the end.
    Returns the requests' payloads, in order."""
    requested = {e.stream_id: json.loads(e.data) for e in story if e.type == "ExperimentRequested"}
    completed = Counter(e.stream_id for e in story if e.type == "ExperimentCompleted")
    assert set(completed) == set(requested)
    assert all(n == 1 for n in completed.values()), completed
    candidates = Counter(
        (r["candidate_id"], r["tier"])
        for r in requested.values()
        if not (r["tier"] == "full" and r["candidate_id"] == REFERENCE_CANDIDATE.id)
    )
    assert all(n == 1 for n in candidates.values()), candidates
    # a fast-tier result may also be an earlier compilation's, reused (MeasurementReused)
    reused = {
        (d["candidate_id"], d["tier"])
        for d in (json.loads(e.data) for e in story if e.type == "MeasurementReused")
    }
    full = [r for r in requested.values() if r["tier"] == "full"]
    assert all(r["agent"] == "confirm" for r in full)
    for i, r in enumerate(full):
        if r["candidate_id"] != REFERENCE_CANDIDATE.id:
            assert (r["candidate_id"], "fast") in candidates.keys() | reused
            assert i > 0 and full[i - 1]["candidate_id"] == REFERENCE_CANDIDATE.id
    assert story[-1].type == "CompilationEnded"
    assert sum(e.type == "CompilationEnded" for e in story) == 1
    if any(e.type == "BaselineMeasured" for e in story):
        assert story[-2].type == "TierAgreement"
        assert sum(e.type == "TierAgreement" for e in story) == 1
    return list(requested.values())


def _check_bests(story: list[ledger_pb2.RecordedEvent]) -> list[dict[str, Any]]:
    """Every BestCandidateImproved is a full-tier confirmation whose speedup is over the
    reference's full-tier measurement completed last before it, and bests only improve.
    Returns their payloads."""
    requested = {e.stream_id: json.loads(e.data) for e in story if e.type == "ExperimentRequested"}
    results = {
        e.stream_id: (e, json.loads(e.data)) for e in story if e.type == "ExperimentCompleted"
    }
    bests = [json.loads(e.data) for e in story if e.type == "BestCandidateImproved"]
    for best in bests:
        event, done = results[f"experiment-{best['experiment_id']}"]
        assert best["tier"] == "full" and done["tier"] == "full" and done["status"] == "ok"
        refs = [
            d["tokens_per_s"]
            for sid, (e, d) in results.items()
            if requested[sid]["tier"] == "full"
            and requested[sid]["candidate_id"] == REFERENCE_CANDIDATE.id
            and d["status"] == "ok"
            and e.position < event.position
        ]
        assert best["speedup"] == pytest.approx(best["tokens_per_s"] / refs[-1])
    assert [b["speedup"] for b in bests] == sorted(b["speedup"] for b in bests)
    assert all(b["speedup"] > 1.0 for b in bests)
    return bests


async def test_compilation_runs_agents_to_the_experiment_budget(stack: Stack) -> None:
    stack.engine.delay_s = 0.05
    request = _request(stack, 30.0, 10)
    submitted = await stack.stub.Submit(request, timeout=10)
    cid = submitted.compilation_id
    assert submitted.status == compiler_pb2.COMPILATION_STATUS_PENDING
    assert submitted.team == TEAM
    assert submitted.workload.workload_key.startswith("wk-")

    events = await _watch(stack.stub, cid)
    types = [e.type for e in events]
    assert types[:2] == ["CompilationSubmitted", "CompilationPlanned"]
    assert types[-1] == "CompilationEnded"
    assert types.index("BaselineMeasured") < types.index("BestCandidateImproved")
    assert [e.position for e in events] == sorted(e.position for e in events)
    end = events[-1]
    assert end.detail["status"] == "succeeded"
    assert "experiment budget is spent (10 of 10" in end.detail["reason"]

    # A search candidate may take its share of the budget (0.1 x 30 s); the reference and the
    # full-tier confirmations the whole experiment deadline.
    baseline_id = next(e for e in events if e.type == "BaselineMeasured").detail["experiment_id"]
    story = await _story(stack.ledger, cid, events[0].position - 1)
    ours = {
        e.stream_id.removeprefix("experiment-") for e in story if e.type == "ExperimentRequested"
    }
    deadlines = {k: v for k, v in stack.engine.deadlines.items() if k in ours}  # this one's
    assert deadlines.pop(baseline_id) == ("fast", 5.0)
    assert {d for tier, d in deadlines.values() if tier == "fast"} == {3.0}
    assert {d for tier, d in deadlines.values() if tier == "full"} == {5.0}

    # Best-so-far: only candidates confirmed on the full tier, only improving (_check_bests).
    baseline = next(e for e in events if e.type == "BaselineMeasured").detail["tokens_per_s"]
    bests = [e.detail for e in events if e.type == "BestCandidateImproved"]
    assert bests and all(b["tier"] == "full" for b in bests)
    assert types.index("TierAgreement") == len(types) - 2
    assert "; fast vs full tier: Spearman rho " in end.detail["reason"]

    # The last snapshot is the whole compilation.
    snap = end.snapshot
    assert snap.status == compiler_pb2.COMPILATION_STATUS_SUCCEEDED
    assert snap.experiments_done == 10 and snap.plan.feasible
    assert snap.best.speedup == pytest.approx(bests[-1]["speedup"])
    assert snap.best.candidate.candidate_id == bests[-1]["candidate_id"]
    assert snap.best.candidate.ops or snap.best.candidate.transforms
    assert snap.baseline.tokens_per_s == pytest.approx(baseline)
    # The speedup is over the full-tier reference measured next to the best, which the
    # message carries (the baseline is the fast-tier reference: not comparable).
    ref = snap.best.reference
    assert snap.best.reference_experiment_id and ref.tier == common_pb2.TIER_FULL
    assert ref.tokens_per_s > 0 and ref.timing.median_ms > 0
    assert snap.best.speedup == pytest.approx(snap.best.measurement.tokens_per_s / ref.tokens_per_s)
    # Where the engine measured: its own operating point, not the traffic's batch 30.
    assert (snap.best.measurement.batch_size, snap.best.measurement.context_len) == (
        FAKE_BATCH,
        FAKE_CONTEXT,
    )

    # Claims: no candidate measured twice; several default agents contributed; the budget held.
    requests = _check_experiments_settled(story)
    assert [b["experiment_id"] for b in _check_bests(story)] == [b["experiment_id"] for b in bests]
    assert len(requests) == 10  # confirmations count toward the budget
    agents = Counter(r["agent"] for r in requests)
    assert agents["baseline"] == 1
    searchers = set(agents) - {"baseline", "confirm"}
    assert searchers <= set(DEFAULT_AGENTS) and len(searchers) >= 2
    assert agents["confirm"] >= 2
    assert all(e.metadata.team == TEAM for e in story)
    claims = await stack.board.history(cid, kinds=["claim"])  # agents claim, confirm does not
    assert len({p.candidate_id for p in claims}) == len(claims) == 10 - agents["confirm"]
    # The board carries ideas and claims; results are the ledger's (agents read the runner's).
    assert {p.kind for p in await stack.board.history(cid)} == {"idea", "claim"}

    # Tier agreement: over the candidates measured correct on both tiers, reference included.
    agreement = next(json.loads(e.data) for e in story if e.type == "TierAgreement")
    both = {r["candidate_id"] for r in requests if r["tier"] == "full"}
    assert agreement["n"] == len(agreement["points"]) == len(both) >= 2
    assert {p["candidate_id"] for p in agreement["points"]} == both
    assert -1.0 <= agreement["rho"] <= 1.0

    # Get, List and a resumed Watch agree.
    got = await stack.stub.Get(compiler_pb2.GetRequest(compilation_id=cid), timeout=10)
    assert got.best.experiment_id == snap.best.experiment_id
    assert got.best.reference == snap.best.reference
    assert got.status == compiler_pb2.COMPILATION_STATUS_SUCCEEDED
    listed: list[compiler_pb2.Compilation] = []
    for _ in range(100):  # List reads the ledger's projection, which follows within moments
        reply = await stack.stub.List(
            compiler_pb2.ListRequest(status=compiler_pb2.COMPILATION_STATUS_SUCCEEDED), timeout=10
        )
        listed = [c for c in reply.compilations if c.compilation_id == cid]
        if listed:
            break
        await asyncio.sleep(0.05)
    assert listed and listed[0].experiments_done == 10 and listed[0].team == TEAM
    assert listed[0].best.speedup == pytest.approx(snap.best.speedup)
    middle = events[len(events) // 2].position
    tail = await _watch(stack.stub, cid, after=middle)
    assert [e.position for e in tail] == [e.position for e in events if e.position > middle]
    assert tail[-1].snapshot == snap


async def test_wall_clock_budget_stops_the_compilation(stack: Stack) -> None:
    stack.engine.delay_s = 0.2
    submitted = await stack.stub.Submit(_request(stack, 2.0, 0), timeout=10)
    events = await _watch(stack.stub, submitted.compilation_id, timeout_s=20)
    end = events[-1]
    assert end.detail["status"] == "succeeded"
    assert "wall-clock budget of 2 s is spent" in end.detail["reason"]
    elapsed = end.recorded_at.ToDatetime() - events[0].recorded_at.ToDatetime()
    assert 2.0 <= elapsed.total_seconds() < 3.5
    story = await _story(stack.ledger, submitted.compilation_id, events[0].position - 1)
    _check_experiments_settled(story)


async def test_baselines_are_measured_after_the_search_outside_its_budget(stack: Stack) -> None:
    """Baselines hold the full-tier engine for minutes on a GPU (compiling, eager steps): they
    run once the search's wall-clock budget is spent, never while a winner waits for its
    confirmation, and the compilation ends after them."""
    stack.engine.delay_s = 0.2
    request = _request(stack, 3.0, 0, baselines=["gpt_fast", "hf_eager"])
    submitted = await stack.stub.Submit(request, timeout=10)
    events = await _watch(stack.stub, submitted.compilation_id, timeout_s=30)
    end = events[-1]
    assert end.detail["status"] == "succeeded"
    assert "wall-clock budget of 3 s is spent" in end.detail["reason"]
    story = await _story(stack.ledger, submitted.compilation_id, events[0].position - 1)
    requested = {e.stream_id: json.loads(e.data) for e in story if e.type == "ExperimentRequested"}
    first_baseline = min(
        e.position for e in story if e.type == "ExperimentRequested" and json.loads(e.data)[
            "agent"].startswith("compare:")
    )  # fmt: skip
    search_done = [
        e.position
        for e in story
        if e.type == "ExperimentCompleted"
        and not requested[e.stream_id]["agent"].startswith("compare:")
    ]
    assert search_done and max(search_done) < first_baseline  # the search had settled first
    compared = [json.loads(e.data) for e in story if e.type == "BaselineCompared"]
    assert [c["name"] for c in compared] == ["gpt_fast", "hf_eager"]
    assert all(c["status"] == "ok" and c["tier"] == "full" for c in compared)
    # A baseline's work carries the baseline deadline (a compile takes minutes), the rest theirs.
    baseline_ids = {
        k.removeprefix("experiment-") for k, v in requested.items() if v["agent"].startswith(
            "compare:")
    }  # fmt: skip
    taken = {k: d for k, (_, d) in stack.engine.deadlines.items() if k in baseline_ids}
    assert len(taken) == 2 and set(taken.values()) == {RUNNER_CONFIG.baseline_deadline_s}
    types = [e.type for e in story]
    assert types.index("TierAgreement") > max(
        i for i, t in enumerate(types) if t == "BaselineCompared"
    )
    elapsed = end.recorded_at.ToDatetime() - events[0].recorded_at.ToDatetime()
    assert elapsed.total_seconds() >= 3.0 + 2 * 0.2  # the budget, then two baselines


async def test_a_cancel_during_the_baselines_ends_the_compilation_at_once(stack: Stack) -> None:
    """With the full-tier engine stalled, a baseline waits for its answer after the search; a
    cancel ends the compilation without waiting for that answer, and the baseline's experiment
    is closed, not left open."""
    stack.engine.delay_s = 0.1
    request = _request(stack, 2.0, 0, baselines=["gpt_fast"])
    submitted = await stack.stub.Submit(request, timeout=10)
    cid = submitted.compilation_id
    await _watch(stack.stub, cid, until="BaselineMeasured")
    stack.engine.full_running.clear()  # confirmations and the baseline stay queued
    try:
        await asyncio.sleep(3.0)  # the search's budget is spent: the baseline is requested
        story = await _story(stack.ledger, cid)
        assert any(
            e.type == "ExperimentRequested" and json.loads(e.data)["agent"] == "compare:gpt_fast"
            for e in story
        )
        await stack.stub.Cancel(
            compiler_pb2.CancelRequest(compilation_id=cid, reason="enough"), timeout=10
        )
        events = await _watch(stack.stub, cid, timeout_s=10)
    finally:
        stack.engine.full_running.set()
    assert events[-1].detail["status"] == "cancelled"
    story = await _story(stack.ledger, cid)
    requested = {e.stream_id for e in story if e.type == "ExperimentRequested"}
    completed = {e.stream_id: json.loads(e.data) for e in story if e.type == "ExperimentCompleted"}
    assert requested == set(completed)  # nothing left open
    assert not any(e.type == "BaselineCompared" for e in story)


async def test_bad_input_gets_the_right_status_and_changes_nothing(stack: Stack) -> None:
    stack.engine.delay_s = 0.01
    taken = await stack.stub.Submit(_request(stack, 30.0, 2), timeout=10)
    events = await _watch(stack.stub, taken.compilation_id)
    last = events[-1].position

    def workload(**changes: Any) -> common_pb2.Workload:
        w = common_pb2.Workload()
        w.CopyFrom(stack.workload)
        for path, value in changes.items():
            target: Any = w
            *parents, leaf = path.split("__")
            for p in parents:
                target = getattr(target, p)
            if value is None:
                target.ClearField(leaf)
            else:
                setattr(target, leaf, value)
        return w

    unsupported = json.dumps({"model_type": "mamba2", "hidden_size": 8})
    cases: list[tuple[Any, grpc.StatusCode, str]] = [
        (
            compiler_pb2.SubmitRequest(budget=common_pb2.Budget(wall_seconds=5)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "workload is missing",
        ),
        (
            _request(stack, 5, 2, workload=workload(model=None)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "workload.model is missing",
        ),
        (
            _request(stack, 5, 2, workload=workload(model__config_json="{not json")),
            grpc.StatusCode.INVALID_ARGUMENT,
            "not valid JSON",
        ),
        (
            _request(stack, 5, 2, workload=workload(model__config_json=unsupported)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "unsupported architecture 'mamba2'",
        ),
        (
            _request(stack, 5, 2, workload=workload(hardware__name="tpu-v9")),
            grpc.StatusCode.NOT_FOUND,
            "unknown hardware 'tpu-v9'",
        ),
        (
            _request(stack, 5, 2, workload=workload(model__weights_dir="/no/such/dir")),
            grpc.StatusCode.NOT_FOUND,
            "weights_dir '/no/such/dir'",
        ),
        (
            _request(stack, 5, 2, workload=workload(traffic=None)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "workload.traffic is missing",
        ),
        (
            _request(stack, 5, 2, workload=workload(traffic__batch_size=0)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "batch_size must be >= 1",
        ),
        (
            _request(stack, 5, 2, workload=workload(traffic__arrival_rate_rps=float("nan"))),
            grpc.StatusCode.INVALID_ARGUMENT,
            "arrival_rate_rps must be a finite number",
        ),
        (_request(stack, 0, 2), grpc.StatusCode.INVALID_ARGUMENT, "wall_seconds must be"),
        (_request(stack, -3, 2), grpc.StatusCode.INVALID_ARGUMENT, "wall_seconds must be"),
        (_request(stack, float("nan"), 2), grpc.StatusCode.INVALID_ARGUMENT, "wall_seconds"),
        (_request(stack, 31 * 86400, 2), grpc.StatusCode.INVALID_ARGUMENT, "30 days"),
        (
            compiler_pb2.SubmitRequest(workload=stack.workload),
            grpc.StatusCode.INVALID_ARGUMENT,
            "budget is missing",
        ),
        (
            _request(stack, 5, 2, agents=["oracle"]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "unknown agent(s) 'oracle'",
        ),
        (
            _request(stack, 5, 2, compilation_id="bad id!"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "invalid compilation_id",
        ),
        (
            _request(stack, 5, 2, compilation_id=taken.compilation_id),
            grpc.StatusCode.ALREADY_EXISTS,
            f"compilation {taken.compilation_id!r} exists",
        ),
    ]
    for request, code, message in cases:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stack.stub.Submit(request, timeout=10)
        assert info.value.code() == code, (message, info.value.details())
        assert message in (info.value.details() or ""), info.value.details()
    for method, req in (
        (stack.stub.Get, compiler_pb2.GetRequest(compilation_id="nope")),
        (stack.stub.Cancel, compiler_pb2.CancelRequest(compilation_id="nope")),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await method(req, timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert "no compilation 'nope'" in (info.value.details() or "")
    await asyncio.sleep(0.3)
    assert [e async for e in stack.ledger.read_all(last)] == []


async def test_cancel_ends_a_running_compilation(stack: Stack) -> None:
    stack.engine.delay_s = 0.3
    submitted = await stack.stub.Submit(_request(stack, 60.0, 0), timeout=10)
    cid = submitted.compilation_id
    await _watch(stack.stub, cid, until="BaselineMeasured")
    # Another team neither sees nor cancels it (cross-team reads are off by default) ...
    runner_addr = stack.settings.agent_runner_addr
    async with team_channel(runner_addr, "other-team") as channel:
        other = compiler_pb2_grpc.CompilerStub(channel)
        for denied_call in (
            other.Get(compiler_pb2.GetRequest(compilation_id=cid), timeout=10),
            other.Cancel(compiler_pb2.CancelRequest(compilation_id=cid), timeout=10),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as denied:
                await denied_call
            assert denied.value.code() == grpc.StatusCode.NOT_FOUND
            assert denied.value.details() == f"no compilation {cid!r}"
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await other.List(compiler_pb2.ListRequest(team="*"), timeout=10)
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        own = await other.List(compiler_pb2.ListRequest(), timeout=10)
        assert cid not in {c.compilation_id for c in own.compilations}
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await other.List(compiler_pb2.ListRequest(team="Not A Team"), timeout=10)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "ListRequest.team" in (bad.value.details() or "")
    # ... while an operator (audit) reads every team's, paged.
    async with team_channel(runner_addr, "other-team", tls=operator_tls()) as channel:
        operator = compiler_pb2_grpc.CompilerStub(channel)
        seen = await operator.Get(compiler_pb2.GetRequest(compilation_id=cid), timeout=10)
        assert seen.team == TEAM
        everyone = await operator.List(compiler_pb2.ListRequest(team="*", limit=1000), timeout=10)
        assert cid in {c.compilation_id for c in everyone.compilations}
        # Paged two at a time, oldest first (ids are random: their order is not creation's).
        paged: list[compiler_pb2.Compilation] = []
        token = ""
        while True:
            reply = await operator.List(
                compiler_pb2.ListRequest(team="*", limit=2, page_token=token), timeout=10
            )
            paged.extend(reply.compilations)
            token = reply.next_page_token
            if not token:
                break
        assert [c.compilation_id for c in paged] == [
            c.compilation_id for c in everyone.compilations
        ]
        created = [(c.created_at.ToDatetime(), c.compilation_id) for c in paged]
        assert len(created) >= 4 and created == sorted(created)
        assert len({when for when, _ in created}) == len(created)  # ordered by time, not id
    assert not any(e.type == "CompilationCancelRequested" for e in await _story(stack.ledger, cid))
    cancelled = await stack.stub.Cancel(
        compiler_pb2.CancelRequest(compilation_id=cid, reason="enough"), timeout=15
    )
    assert cancelled.status == compiler_pb2.COMPILATION_STATUS_CANCELLED
    assert cancelled.reason == "enough"
    events = await _watch(stack.stub, cid)
    end = dict(events[-1].detail)
    assert end.pop("outcome") in ("confirmed", "none_beat_the_baseline", "unconfirmed")
    assert end == {"status": "cancelled", "reason": "enough"}  # a cancel's reason stays its own
    assert "CompilationCancelRequested" in [e.type for e in events]
    story = await _story(stack.ledger, cid, events[0].position - 1)
    _check_experiments_settled(story)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stack.stub.Cancel(compiler_pb2.CancelRequest(compilation_id=cid), timeout=10)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_restart_resumes_the_open_compilation(stack: Stack) -> None:
    stack.engine.delay_s = 0.15
    addr, first = await stack.start_runner()
    async with team_channel(addr, TEAM) as channel:
        stub = compiler_pb2_grpc.CompilerStub(channel)
        # The agents of session 2's design (this test is about resuming, not strategy): with
        # them the fake engine's speeds give a confirmed best within 14 experiments.
        request = _request(stack, 60.0, 14, agents=RESUME_AGENTS)
        submitted = await stub.Submit(request, timeout=10)
        cid = submitted.compilation_id
        await _watch(stub, cid, until="ExperimentCompleted", count=5)
        stack.engine.running.clear()  # engines stall: the agents' next requests stay open
        await asyncio.sleep(0.5)
        watching = asyncio.create_task(_watch(stub, cid))
        await asyncio.sleep(0.2)
        await _stop(first)  # mid-compilation: experiments in flight, claims taken
        with pytest.raises(grpc.aio.AioRpcError) as info:  # open Watch streams end at once
            await asyncio.wait_for(watching, 5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "watch again with after_position=" in (info.value.details() or "")
    before = await _story(stack.ledger, cid)
    completed_before = {e.stream_id for e in before if e.type == "ExperimentCompleted"}
    requested_before = {
        e.stream_id: json.loads(e.data)["candidate_id"]
        for e in before
        if e.type == "ExperimentRequested"
    }
    assert set(requested_before) - completed_before, "nothing was in flight at the stop"
    assert before[-1].type != "CompilationEnded"
    # A claim taken just before the stop and never requested: the resumed runner measures it.
    orphan = next(c for c in SPACE if c.id not in requested_before.values())
    assert await stack.board.claim(cid, orphan.id, "random", {"candidate": orphan.canonical()})

    stack.engine.running.set()
    addr, second = await stack.start_runner()
    try:
        async with team_channel(addr, TEAM) as channel:
            stub = compiler_pb2_grpc.CompilerStub(channel)
            events = await _watch(stub, cid)
    finally:
        await _stop(second)
    assert events[-1].detail["status"] == "succeeded", events[-1].detail
    story = await _story(stack.ledger, cid, events[0].position - 1)
    requests = _check_experiments_settled(story)
    assert len(requests) == 14, (events[-1].detail, [(r["agent"], r["tier"]) for r in requests])
    types = Counter(e.type for e in story)
    assert types["CompilationPlanned"] == types["BaselineMeasured"] == 1
    bests = [b["experiment_id"] for b in _check_bests(story)]
    assert len(bests) == len(set(bests))
    # Measured on the fast tier by its claimer (and perhaps confirmed after, if it led), or
    # answered by an earlier compilation's valid measurement of it (MeasurementReused: other
    # tests' compilations of this team share the operating point).
    measured = [r for r in requests if r["candidate_id"] == orphan.id and r["tier"] == "fast"]
    reused = [
        d
        for d in (json.loads(e.data) for e in story if e.type == "MeasurementReused")
        if d["candidate_id"] == orphan.id and d["tier"] == "fast"
    ]
    assert len(measured) + len(reused) == 1, (measured, reused)
    assert all(r["agent"] == "random" for r in measured)


async def test_restart_finishes_a_confirmation_under_way(stack: Stack) -> None:
    stack.engine.delay_s = 0.05
    stack.engine.full_running.clear()  # full-tier engines stall: the first confirmation waits
    addr, first = await stack.start_runner()
    try:
        async with team_channel(addr, TEAM) as channel:
            stub = compiler_pb2_grpc.CompilerStub(channel)
            request = _request(stack, 60.0, 12, agents=RESUME_AGENTS)
            submitted = await stub.Submit(request, timeout=10)
            cid = submitted.compilation_id
            for _ in range(200):
                before = await _story(stack.ledger, cid)
                if any(json.loads(e.data).get("agent") == "confirm" for e in before):
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # the gate holds the agents while the reference waits
            before = await _story(stack.ledger, cid)
    finally:
        await _stop(first)
    requested = [json.loads(e.data) for e in before if e.type == "ExperimentRequested"]
    assert [r["candidate_id"] for r in requested if r["agent"] == "confirm"] == [
        REFERENCE_CANDIDATE.id
    ]
    assert requested[-1]["agent"] == "confirm", "an agent's experiment ran past the gate"
    done = {e.stream_id for e in before if e.type == "ExperimentCompleted"}
    ref_stream = [e.stream_id for e in before if e.type == "ExperimentRequested"][-1]
    assert ref_stream not in done
    assert not any(e.type in ("BestCandidateImproved", "CompilationEnded") for e in before)

    stack.engine.full_running.set()
    addr, second = await stack.start_runner()
    try:
        async with team_channel(addr, TEAM) as channel:
            events = await _watch(compiler_pb2_grpc.CompilerStub(channel), cid)
    finally:
        await _stop(second)
    assert events[-1].detail["status"] == "succeeded", events[-1].detail
    story = await _story(stack.ledger, cid)
    requests = _check_experiments_settled(story)
    assert len(requests) == 12
    # Whether the leader beats the reference on the full tier depends on which candidate led
    # when the gate closed (the fake engine's full tier has its own +-6 %); any best there is
    # must be a sound full-tier confirmation.
    _check_bests(story)
    # The reference requested before the stop was measured (not requested again) and the
    # leader it was for came next on the full tier and was measured too.
    full_streams = [
        e.stream_id
        for e in story
        if e.type == "ExperimentRequested" and json.loads(e.data)["tier"] == "full"
    ]
    full = [r for r in requests if r["tier"] == "full"]
    assert full[0]["candidate_id"] == REFERENCE_CANDIDATE.id
    assert full[1]["candidate_id"] != REFERENCE_CANDIDATE.id
    assert full_streams[0] == ref_stream
    (ref_done,) = [json.loads(e.data) for e in story if e.stream_id == ref_stream][1:]
    assert ref_done["status"] == "ok"
    (leader_done,) = [json.loads(e.data) for e in story if e.stream_id == full_streams[1]][1:]
    assert leader_done["status"] == "ok" and leader_done["tier"] == "full"


async def test_unreachable_cost_model_fails_the_compilation(stack: Stack) -> None:
    addr, runner = await stack.start_runner(cost_model_addr=f"127.0.0.1:{_free_port()}")
    try:
        async with team_channel(addr, TEAM) as channel:
            stub = compiler_pb2_grpc.CompilerStub(channel)
            submitted = await stub.Submit(_request(stack, 30.0, 5), timeout=10)
            events = await _watch(stub, submitted.compilation_id)
    finally:
        await _stop(runner)
    assert [e.type for e in events] == ["CompilationSubmitted", "CompilationEnded"]
    assert events[-1].detail["status"] == "failed"
    assert "cost model at 127.0.0.1:" in events[-1].detail["reason"]
    assert "unreachable" in events[-1].detail["reason"]
    assert events[-1].snapshot.status == compiler_pb2.COMPILATION_STATUS_FAILED
