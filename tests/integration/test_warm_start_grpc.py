"""Warm-started compilations and the incumbent comparison over real gRPC, with the real ledger
(PostgreSQL), cost model and NATS, and :class:`tests.integration.fake_engine.FakeEngine`
answering experiments (the servers of :mod:`tests.integration.test_compiler_grpc`).

Seeds are measured before any agent's proposal; a seed whose measurement at the same operating
point is in the team's ledger is answered from it (``MeasurementReused``, no new experiment);
another team's compilation or candidate is NOT_FOUND as an unknown one; the incumbent and the
winner run interleaved on the full tier and the verdict is recorded before the end, also across
a restart of the agent runner.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import grpc
import pytest

from kiln.agent_runner.seeding import proven
from kiln.common.client import team_channel
from kiln.common.work import ExperimentWork
from kiln.domain.candidate import REFERENCE_CANDIDATE
from kiln.v1 import common_pb2, compiler_pb2, compiler_pb2_grpc, ledger_pb2

from . import test_compiler_grpc as base
from .test_compiler_grpc import (
    RESUME_AGENTS,
    TEAM,
    Stack,
    _check_experiments_settled,
    _request,
    _stop,
    _story,
    _watch,
)

stack = base.stack
"""The servers of :mod:`tests.integration.test_compiler_grpc` (a module-scoped fixture)."""

pytestmark = pytest.mark.integration

OTHER_TEAM = "rivals"


def _data(events: list[ledger_pb2.RecordedEvent], event_type: str) -> list[dict[str, Any]]:
    return [json.loads(e.data) for e in events if e.type == event_type]


async def _compile(stub: compiler_pb2_grpc.CompilerStub, request: Any) -> list[Any]:
    submitted = await stub.Submit(request, timeout=30)
    return await _watch(stub, submitted.compilation_id, timeout_s=60)


def _other_shape(stack: Stack) -> common_pb2.Workload:
    """The stack's workload at another operating point (batch 16): nothing measured there."""
    w = common_pb2.Workload()
    w.CopyFrom(stack.workload)
    w.traffic.batch_size = 16
    return w


async def _source(stack: Stack) -> tuple[str, list[ledger_pb2.RecordedEvent]]:
    """A finished compilation of the stack's workload with a winner; its id and story."""
    stack.engine.delay_s = 0.02
    for _ in range(3):  # a confirmed winner depends on the fake full tier's +-6 %
        events = await _compile(stack.stub, _request(stack, 30.0, 10, agents=RESUME_AGENTS))
        cid = events[0].compilation_id
        story = await _story(stack.ledger, cid, events[0].position - 1)
        if _data(story, "BestCandidateImproved"):
            return cid, story
    pytest.fail("no source compilation found a winner")


async def _rival_candidate(stack: Stack) -> tuple[str, str]:
    """Another team's compilation and a candidate that only it measured."""
    async with team_channel(stack.settings.agent_runner_addr, OTHER_TEAM) as channel:
        rival = compiler_pb2_grpc.CompilerStub(channel)
        for _ in range(6):  # the random agent may draw only candidates others measured too
            theirs = await _compile(rival, _request(stack, 30.0, 4, agents=["random"]))
            their_id = theirs[0].compilation_id
            story = await _story(stack.ledger, their_id, theirs[0].position - 1)
            requested = [r["candidate_id"] for r in _data(story, "ExperimentRequested")]
            loop = asyncio.get_running_loop()
            until = loop.time() + 30.0  # the experiments projection follows the ledger
            while loop.time() < until:
                rows = {
                    c: await stack.ledger.query("experiments", {"candidate_id": c})
                    for c in requested
                }
                if all(rows.values()):
                    break
                await asyncio.sleep(0.2)
            for c, found in rows.items():
                if found and {row["compilation_id"] for row in found} == {their_id}:
                    return their_id, c
    pytest.fail("no candidate measured by the other team only")


async def test_bad_warm_starts_and_incumbents_get_the_right_status(stack: Stack) -> None:
    stack.engine.delay_s = 0.01
    their_id, their_candidate = await _rival_candidate(stack)
    ws = compiler_pb2.WarmStart
    cases: list[tuple[dict[str, Any], grpc.StatusCode, str]] = [
        ({"warm_start": ws(compilation_ids=["no such!"])}, grpc.StatusCode.INVALID_ARGUMENT, ""),
        (
            {"warm_start": ws(compilation_ids=[f"gone-{uuid.uuid4().hex[:8]}"])},
            grpc.StatusCode.NOT_FOUND,
            "no compilation",
        ),
        # another team's compilation is NOT_FOUND, word for word as an unknown one
        ({"warm_start": ws(compilation_ids=[their_id])}, grpc.StatusCode.NOT_FOUND, their_id),
        ({"incumbent_candidate_id": "abc"}, grpc.StatusCode.INVALID_ARGUMENT, "candidate id"),
        ({"incumbent_candidate_id": "0" * 24}, grpc.StatusCode.NOT_FOUND, "no candidate"),
        ({"incumbent_candidate_id": their_candidate}, grpc.StatusCode.NOT_FOUND, "no candidate"),
    ]
    for kw, code, text in cases:
        request = _request(stack, 5.0, 2, **kw)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stack.stub.Submit(request, timeout=10)
        assert info.value.code() == code, (kw, info.value.details())
        assert text in (info.value.details() or ""), (kw, info.value.details())
        with pytest.raises(grpc.aio.AioRpcError) as gone:  # nothing was recorded
            await stack.stub.Get(
                compiler_pb2.GetRequest(compilation_id=request.compilation_id), timeout=10
            )
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND


async def test_seeds_are_measured_first_at_a_new_shape(stack: Stack) -> None:
    source, source_story = await _source(stack)
    winner = _data(source_story, "BestCandidateImproved")[-1]
    request = _request(
        stack,
        30.0,
        10,
        agents=RESUME_AGENTS,
        workload=_other_shape(stack),
        warm_start=compiler_pb2.WarmStart(compilation_ids=[source]),
    )
    events = await _compile(stack.stub, request)
    cid = events[0].compilation_id
    assert events[-1].detail["status"] == "succeeded", events[-1].detail
    story = await _story(stack.ledger, cid, events[0].position - 1)
    (submitted,) = _data(story, "CompilationSubmitted")
    seeds = submitted["seeds"]
    assert submitted["warm_start"] == {"compilation_ids": [source], "nearby": False}
    assert seeds[0]["source"] == "winner" and seeds[0]["compilation_id"] == source
    assert seeds[0]["candidate_id"] == winner["candidate_id"]
    assert seeds[0]["experiment_id"] == winner["experiment_id"]
    assert {s["source"] for s in seeds[1:]} <= {"measured"}
    assert all(s["compilation_id"] == source for s in seeds)
    # another operating point: nothing reused, the seeds measured right after the reference
    assert not _data(story, "MeasurementReused")
    requests = _check_experiments_settled(story)
    agents = [r["agent"] for r in requests]
    assert agents[0] == "baseline"
    warm = [r for r in requests if r["agent"] == "warm"]  # measured concurrently: any order
    first = [s["candidate_id"] for s in seeds if proven(s)][:4]
    assert seeds[0]["candidate_id"] in first  # the winner
    assert sorted(r["candidate_id"] for r in warm) == sorted(first)
    first_other = next(i for i, a in enumerate(agents) if a not in ("baseline", "warm", "confirm"))
    assert max(i for i, a in enumerate(agents) if a == "warm") < first_other
    assert events[-1].snapshot.experiments_reused == 0


async def test_a_measurement_at_the_same_point_is_reused_and_the_incumbent_compared(
    stack: Stack,
) -> None:
    source, source_story = await _source(stack)
    measured = {
        json.loads(e.data)["candidate_id"]: e.stream_id.removeprefix("experiment-")
        for e in source_story
        if e.type == "ExperimentRequested"
        and json.loads(e.data)["tier"] == "fast"
        and json.loads(e.data)["agent"] != "baseline"
    }
    done = {
        e.stream_id.removeprefix("experiment-"): json.loads(e.data)
        for e in source_story
        if e.type == "ExperimentCompleted"
    }
    # the incumbent: the source's slowest correct candidate (the winner should beat it)
    incumbent = min(
        (c for c, eid in measured.items() if done.get(eid, {}).get("status") == "ok"),
        key=lambda c: done[measured[c]]["tokens_per_s"],
    )
    await asyncio.sleep(1.0)  # the experiments projection follows the ledger within moments
    request = _request(
        stack,
        30.0,
        8,
        agents=RESUME_AGENTS,
        warm_start=compiler_pb2.WarmStart(compilation_ids=[source]),
        incumbent_candidate_id=incumbent,
    )
    events = await _compile(stack.stub, request)
    cid = events[0].compilation_id
    assert events[-1].detail["status"] == "succeeded", events[-1].detail
    story = await _story(stack.ledger, cid, events[0].position - 1)
    (submitted,) = _data(story, "CompilationSubmitted")
    assert submitted["incumbent"]["candidate_id"] == incumbent
    # the incumbent's measurement: the source's, or another of the team's compilations at this
    # point that measured the same candidate (other modules on the session's database do)
    theirs = submitted["incumbent"]["compilation_id"]
    if theirs != source:
        rows = await stack.ledger.query(
            "experiments", {"candidate_id": incumbent, "compilation_id": theirs}
        )
        assert rows, (theirs, source)

    # the same operating point: the seeds' fast-tier results come from the source, not an engine
    reused = _data(story, "MeasurementReused")
    seeds = [s["candidate_id"] for s in submitted["seeds"] if proven(s)][:4]
    # an agent's reused proposal may be recorded between the seeds' (they run concurrently):
    # each seed's first reuse is the seed's, everything else an agent's
    first: dict[str, int] = {}
    for i, r in enumerate(reused):
        if r["candidate_id"] in seeds:
            first.setdefault(r["candidate_id"], i)
    seeded = [reused[i] for i in sorted(first.values())]
    others = [r for i, r in enumerate(reused) if i not in first.values()]
    assert sorted(r["candidate_id"] for r in seeded) == sorted(seeds)
    for r in seeded:
        assert r["experiment_id"] == measured[r["candidate_id"]]
        assert r["source_compilation_id"] == source
        assert r["experiment_id"] in done, (r, sorted(done))
        assert r["result"]["tokens_per_s"] == done[r["experiment_id"]]["tokens_per_s"]
    # an agent's later proposal may be answered from any of the team's earlier compilations at
    # this point (other tests of the module compile for the same team): the original must exist
    for r in others:
        original = await stack.ledger.read_stream(f"experiment-{r['experiment_id']}")
        asked, answered = (json.loads(e.data) for e in original[:2])
        assert asked["candidate_id"] == r["candidate_id"]
        assert asked["compilation_id"] == r["source_compilation_id"]
        assert answered["status"] == "ok"
        assert r["result"]["tokens_per_s"] == answered["tokens_per_s"]
    requests = [
        json.loads(e.data) | {"id": e.stream_id.removeprefix("experiment-")}
        for e in story
        if e.type == "ExperimentRequested"
    ]
    fast_requested = {r["candidate_id"] for r in requests if r["tier"] == "fast"}
    assert not fast_requested & {r["candidate_id"] for r in reused}  # not measured again
    assert not any(r["agent"] == "warm" for r in requests)
    snap = events[-1].snapshot
    assert snap.experiments_reused == len(reused) >= 1
    # outside the budget: 8 experiments measured here, besides the incumbent runs
    assert sum(r["agent"] != "incumbent" for r in requests) == 8

    # the incumbent comparison: after the search, I C I C I C on the full tier, then the end
    (compared,) = _data(story, "IncumbentCompared")
    types = [e.type for e in story]
    assert types.index("IncumbentCompared") < types.index("CompilationEnded")
    runs = [r for r in requests if r["agent"] == "incumbent"]
    assert compared["compared"] is True, compared
    assert compared["experiment_ids"] == [r["id"] for r in runs]
    assert [r["candidate_id"] for r in runs] == [
        incumbent,
        compared["challenger_candidate_id"],
    ] * 3
    assert all(r["tier"] == "full" for r in runs)
    best = _data(story, "BestCandidateImproved")[-1]
    assert compared["challenger_candidate_id"] == best["candidate_id"]
    assert len(compared["incumbent_tokens_per_s"]) == len(compared["challenger_tokens_per_s"]) == 3
    last_search = max(
        e.position
        for e in story
        if e.type == "ExperimentCompleted"
        and e.stream_id.removeprefix("experiment-") not in compared["experiment_ids"]
    )
    first_run = min(
        e.position
        for e in story
        if e.type == "ExperimentRequested"
        and e.stream_id.removeprefix("experiment-") in compared["experiment_ids"]
    )
    assert last_search < first_run
    assert compared["gain"] == pytest.approx(
        compared["challenger_median"] / compared["incumbent_median"] - 1
    )
    assert compared["noise"] >= 0.02
    assert compared["challenger_better"] == (compared["gain"] > compared["noise"])
    assert (
        snap.incumbent.compared
        and snap.incumbent.challenger_better == compared["challenger_better"]
    )
    assert list(snap.incumbent.experiment_ids) == compared["experiment_ids"]


async def test_the_incumbent_comparison_resumes_after_a_restart(stack: Stack) -> None:
    source, source_story = await _source(stack)
    winner = _data(source_story, "BestCandidateImproved")[-1]["candidate_id"]
    incumbent = next(
        r["candidate_id"]
        for r in _data(source_story, "ExperimentRequested")
        if r["candidate_id"] not in (REFERENCE_CANDIDATE.id, winner) and r["agent"] != "confirm"
    )
    await asyncio.sleep(1.0)  # the experiments projection follows the ledger within moments
    stack.engine.delay_s = 0.3
    held = asyncio.Event()

    async def first_incumbent_run(work: ExperimentWork) -> bool:
        """Hold the full tier at the first incumbent run (a loaded host polls too late)."""
        if held.is_set():
            return False
        asked = (await stack.ledger.read_stream(f"experiment-{work.experiment_id}"))[0]
        if json.loads(asked.data)["agent"] == "incumbent":
            held.set()
        return held.is_set()

    stack.engine.hold_full_when = first_incumbent_run
    addr, first = await stack.start_runner()
    try:
        async with team_channel(addr, TEAM) as channel:
            stub = compiler_pb2_grpc.CompilerStub(channel)
            # warm-started from the source: its winner leads again, so there is a challenger
            request = _request(
                stack,
                60.0,
                6,
                agents=RESUME_AGENTS,
                incumbent_candidate_id=incumbent,
                warm_start=compiler_pb2.WarmStart(compilation_ids=[source]),
            )
            cid = (await stub.Submit(request, timeout=30)).compilation_id
            await asyncio.wait_for(held.wait(), 60)  # the next incumbent runs stay queued
            await asyncio.sleep(0.5)
    finally:
        stack.engine.hold_full_when = None
        await _stop(first)
    before = await _story(stack.ledger, cid)
    runs_before = [
        json.loads(e.data) | {"id": e.stream_id.removeprefix("experiment-")}
        for e in before
        if e.type == "ExperimentRequested" and json.loads(e.data)["agent"] == "incumbent"
    ]
    assert len(runs_before) < 6
    assert runs_before and not _data(before, "IncumbentCompared")
    assert before[-1].type != "CompilationEnded"
    stack.engine.full_running.set()
    addr, second = await stack.start_runner()
    try:
        async with team_channel(addr, TEAM) as channel:
            events = await _watch(compiler_pb2_grpc.CompilerStub(channel), cid, timeout_s=60)
    finally:
        await _stop(second)
    assert events[-1].detail["status"] == "succeeded", events[-1].detail
    story = await _story(stack.ledger, cid)
    requested = {e.stream_id for e in story if e.type == "ExperimentRequested"}
    completed = [e.stream_id for e in story if e.type == "ExperimentCompleted"]
    assert sorted(completed) == sorted(requested)  # each settled once
    assert story[-1].type == "CompilationEnded"
    (compared,) = _data(story, "IncumbentCompared")
    runs = [
        e.stream_id.removeprefix("experiment-")
        for e in story
        if e.type == "ExperimentRequested" and json.loads(e.data)["agent"] == "incumbent"
    ]
    # warm-started from the source, its winner leads and is confirmed again (the fake engine
    # is deterministic per candidate): a real comparison, none of its runs requested twice
    assert compared["compared"], compared
    assert len(runs) == 6 and compared["experiment_ids"] == runs
    assert set(runs[: len(runs_before)]) == {r["id"] for r in runs_before}
