"""Fairness between compilations and teams on one shared device, and the teams' quotas (issue
14, item 5).

Real servers in this event loop: the ledger (real PostgreSQL), the cost model, the agent runner
(Compiler API over gRPC) and the engine pool's real work consumer and delivery on the real NATS
work queue; the engines are simulated (:class:`tests.integration.fake_pool.FakeEnginePool`: one
CPU "device" holding two engines, builds and experiments sleep) so that a dozen compilations
run in about a minute on two cores. Experiments take long enough (0.25 s fast, 0.4 s full) that
the device, not the services, is the bottleneck. With the pool's old rule (the warm lane first)
and the runner before quotas, such a run left 11 of 12 compilations without a confirmation;
with the old rule and today's runner, up to 27 search experiments ran ahead of a queued
confirmation (at most one does now).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio

from kiln.agent_runner.app import AgentRunnerApp
from kiln.agent_runner.config import RunnerConfig
from kiln.agent_runner.quotas import QuotaSettings, TeamOverride
from kiln.agent_runner.team_usage import TeamUsage, position_before, recorded_s
from kiln.common import nats as kn
from kiln.common.client import FixedIdentity, team_channel, use_client_identity
from kiln.common.settings import KilnSettings
from kiln.cost_model.app import create_app as create_cost_model
from kiln.domain.candidate import REFERENCE_CANDIDATE
from kiln.engine_pool.queue import WorkConsumer
from kiln.engine_pool.settings import EngineSettings
from kiln.ledger.app import LedgerApp
from kiln.ledger.client import LedgerClient
from kiln.v1 import common_pb2, compiler_pb2, compiler_pb2_grpc, ledger_pb2

from ..databases import scratch_database
from ..pki import service_tls
from .fake_pool import FakeEnginePool, Run
from .serving import serve_in_task

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
MODEL = DATA / "models" / "llama-3.2-1b.json"

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not MODEL.is_file(), reason="../shared/data (models) is absent"),
]

TEAMS = {"alpha": 6, "beta": 3, "gamma": 3}
"""Compilations each team submits at once (12 in all)."""
AGENTS = ["coordinate", "random", "random"]
WALL_S = 20.0
MAX_EXPERIMENTS = 0
QUOTAS = QuotaSettings(
    max_running=4,
    max_in_flight=2,
    max_in_flight_team=5,
    teams={
        "metered": TeamOverride(device_seconds=1.0, max_running=2),
        "crowded": TeamOverride(max_running=1, max_pending=1),
        "restart": TeamOverride(max_running=1),
    },
)
PUBLISH_SLACK_S = 4.0
"""Seconds between recording a request and publishing its work on a loaded 2-core host (2 s was
exceeded with other work on the host: 4 fast items requested 2+ s later ran first). A starved
confirmation would be overtaken by dozens within the 20 s wall clock, so the check still bites."""
BOOST = 1.25
"""Every candidate but the reference measures this much faster than the fake engines' model
says, so any search result leads and is due for confirmation: these tests are about whether
the confirmation gets a device, not about what the search finds."""
GRACE_S = 10.0
LATE_S = 2.0
"""A search result recorded this close to the end of the wall clock may reach the runner after
it (the runner learns results from the ledger's feed)."""
RUNNER_CONFIG = RunnerConfig(
    experiment_deadline_s=20.0,
    baseline_deadline_s=20.0,
    experiment_margin_s=10.0,
    search_share=0.5,
    search_min_deadline_s=5.0,
    plan_timeout_s=5.0,
    plan_attempts=3,
    cancel_wait_s=5.0,
    resume_retry_s=0.5,
    confirm_grace_s=GRACE_S,
)


@dataclass
class Stack:
    settings: KilnSettings
    runner_addr: str
    runner_task: asyncio.Task[Any]
    pool: FakeEnginePool
    ledger: LedgerClient
    workload: common_pb2.Workload

    async def restart_runner(self) -> None:
        """Stop the agent runner (its compilations stay open) and start a new one, which
        resumes them (one runner per ledger at a time)."""
        await _stop(self.runner_task)
        self.runner_task, self.runner_addr = await _start_runner(self.settings)


async def _start_runner(cfg: KilnSettings) -> tuple[asyncio.Task[Any], str]:
    runner = AgentRunnerApp(cfg, RUNNER_CONFIG, QUOTAS)
    task, addr = await serve_in_task(runner, cfg)
    await asyncio.wait_for(runner.resumed.wait(), 20)
    return task, addr


async def _stop(task: asyncio.Task[Any]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


@pytest.fixture(scope="module")
def fairness_database(postgres_server_url: str) -> Iterator[str]:
    """A database of its own: the agent runner resumes the open compilations of its ledger, and
    another module's (on the session's database) would take this device (CI saw one hold it with
    its confirmation while a test here waited for the device)."""
    with scratch_database(postgres_server_url) as url:
        yield url


@pytest_asyncio.fixture(scope="module")
async def stack(settings: KilnSettings, fairness_database: str) -> AsyncIterator[Stack]:
    prefix = "kf" + uuid.uuid4().hex[:10]
    cfg = settings.model_copy(
        update={
            "subject_prefix": prefix,
            "metrics_port": 0,
            "grace_period_s": 1.0,
            "database_url": fairness_database,
        }
    )
    tasks: list[asyncio.Task[Any]] = []
    ledger_task, ledger_addr = await serve_in_task(LedgerApp(cfg), cfg)
    tasks.append(ledger_task)
    cfg = cfg.model_copy(update={"ledger_addr": ledger_addr})
    cost_task, cost_addr = await serve_in_task(create_cost_model(cfg), cfg)
    tasks.append(cost_task)
    cfg = cfg.model_copy(update={"cost_model_addr": cost_addr})
    engine_settings = EngineSettings(
        consume=True, ack_wait_s=10.0, nak_delay_s=0.5, discover_s=0.5, max_engines=2
    )
    pool = FakeEnginePool(
        engine_settings, build_s=0.3, run_s={"fast": 0.25, "full": 0.4}, boost=BOOST
    )
    consumer = WorkConsumer(cfg, pool.settings, pool)
    stop = asyncio.Event()
    with use_client_identity(FixedIdentity(service_tls("engine-pool"))):  # its ledger appends
        tasks.append(asyncio.create_task(consumer.run(stop)))
    await asyncio.wait_for(consumer.connected.wait(), 20)
    runner_task, runner_addr = await _start_runner(cfg)
    workload = common_pb2.Workload(
        model=common_pb2.ModelSpec(name="llama-3.2-1b", config_json=MODEL.read_text()),
        traffic=common_pb2.TrafficShape(batch_size=8, context_len=512),
        hardware=common_pb2.HardwareTarget(name="cpu"),
    )
    stack = Stack(cfg, runner_addr, runner_task, pool, None, workload)  # type: ignore[arg-type]
    try:
        reader = service_tls("agent-runner")  # reads every team's records
        async with LedgerClient(ledger_addr, "fairness", tls=reader) as ledger:
            stack.ledger = ledger
            yield stack
    finally:
        await _stop(stack.runner_task)
        stop.set()
        for task in reversed(tasks):
            await _stop(task)
        await consumer.close()
        nc = await kn.connect(cfg.require_nats_url(), "test-fairness")
        await kn.delete_streams(nc.jetstream(), prefix)
        await nc.close()


async def _submit(stack: Stack, team: str, **budget: Any) -> str:
    async with team_channel(stack.runner_addr, team) as channel:
        stub = compiler_pb2_grpc.CompilerStub(channel)
        reply = await stub.Submit(
            compiler_pb2.SubmitRequest(
                workload=stack.workload, budget=common_pb2.Budget(**budget), agents=AGENTS
            ),
            timeout=20,
        )
        assert reply.status == compiler_pb2.COMPILATION_STATUS_PENDING
        return str(reply.compilation_id)


async def _get(stack: Stack, team: str, cid: str) -> compiler_pb2.Compilation:
    async with team_channel(stack.runner_addr, team) as channel:
        stub = compiler_pb2_grpc.CompilerStub(channel)
        return await stub.Get(compiler_pb2.GetRequest(compilation_id=cid), timeout=20)


async def _ended(stack: Stack, cids: list[str], timeout_s: float) -> None:
    async def all_ended() -> None:
        while True:
            rows = await stack.ledger.query("compilations", {})
            status = {r["compilation_id"]: r["status"] for r in rows}
            if all(status.get(c) in ("succeeded", "failed", "cancelled") for c in cids):
                return
            await asyncio.sleep(0.5)

    await asyncio.wait_for(all_ended(), timeout_s)


Story = list[ledger_pb2.RecordedEvent]


async def _stories(ledger: LedgerClient, cids: list[str]) -> dict[str, Story]:
    """Each compilation's events (its stream and its experiments'), in global order."""
    out: dict[str, Story] = {c: [] for c in cids}
    async for event in ledger.read_all(0):
        cid = event.stream_id.removeprefix("compilation-")
        if cid not in out:
            cid = json.loads(event.data).get("compilation_id", "")
        if cid in out:
            out[cid].append(event)
    return out


def _experiments(story: Story) -> dict[str, tuple[int, dict[str, Any], int, dict[str, Any]]]:
    """experiment stream -> (requested position, request, completed position, completion)."""
    req = {e.stream_id: e for e in story if e.type == "ExperimentRequested"}
    done = {e.stream_id: e for e in story if e.type == "ExperimentCompleted"}
    return {
        sid: (r.position, json.loads(r.data), done[sid].position, json.loads(done[sid].data))
        for sid, r in req.items()
        if sid in done
    }


def _confirmed(story: Story) -> int:
    """Candidates (not the reference) measured ok on the full tier."""
    return sum(
        1
        for _, r, _, d in _experiments(story).values()
        if r["tier"] == "full"
        and r["candidate_id"] != REFERENCE_CANDIDATE.id
        and d["status"] == "ok"
    )


def _had_leader(story: Story, before_s: float) -> bool:
    """Whether a fast-tier candidate measured faster than the compilation's baseline was
    recorded before ``before_s`` (Unix time)."""
    baselines = [json.loads(e.data) for e in story if e.type == "BaselineMeasured"]
    if not baselines:
        return False
    bar = baselines[0]["tokens_per_s"]
    done_at = {e.stream_id: recorded_s(e) for e in story if e.type == "ExperimentCompleted"}
    return any(
        r["tier"] == "fast"
        and r["candidate_id"] != REFERENCE_CANDIDATE.id
        and d["status"] == "ok"
        and d["tokens_per_s"] > bar
        and done_at[sid] < before_s
        for sid, (_, r, _, d) in _experiments(story).items()
    )


def _wall_end(story: Story, wall_s: float) -> float:
    """When the compilation's wall clock ran out (Unix time): its start plus its budget."""
    return recorded_s(next(e for e in story if e.type == "CompilationPlanned")) + wall_s


def _end_of(story: Story) -> dict[str, Any]:
    return dict(json.loads(next(e for e in story if e.type == "CompilationEnded").data))


def _most_at_once(intervals: list[tuple[int, int]]) -> int:
    """The most of ``[start, end]`` position intervals open at one position."""
    edges = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


def _report(runs: list[Run], cids: list[str], stories: dict[str, Story]) -> str:
    t0 = runs[0].started if runs else 0.0
    lines = [
        f"{len(runs)} runs, device busy {sum(r.ended - r.started for r in runs):.1f} s of "
        f"{(runs[-1].ended - t0) if runs else 0:.1f} s; fast {sum(r.tier == 'fast' for r in runs)},"
        f" full {sum(r.tier == 'full' for r in runs)}, builds {sum(r.built for r in runs)}"
    ]
    for c in cids:
        done = len(_experiments(stories[c]))
        end = _end_of(stories[c])["reason"][:110]
        lines.append(f"{c[:8]} {done} done, {_confirmed(stories[c])} confirmed: {end}")
    return "\n".join(lines)


def _overtaken_report(
    report: str, run: Run, asked: float, overtaken: list[Run], asked_at: dict[str, float]
) -> str:
    """``report`` plus when the confirmation and the search runs that overtook it were requested
    and started, in seconds after the confirmation's request."""
    rows = [f"full {run.experiment_id[:8]}: asked 0.00, started {run.started_at - asked:.2f}"]
    rows += [
        f"fast {o.experiment_id[:8]} ({o.compilation_id[:8]}): asked "
        f"{asked_at[o.experiment_id] - asked:.2f}, started {o.started_at - asked:.2f}"
        for o in overtaken
    ]
    return "\n".join([report, *rows])


async def test_twelve_compilations_of_three_teams_all_get_confirmations(stack: Stack) -> None:
    order = [team for team, n in TEAMS.items() for _ in range(n)]
    cids = list(
        await asyncio.gather(
            *(
                _submit(stack, team, wall_seconds=WALL_S, max_experiments=MAX_EXPERIMENTS)
                for team in order
            )
        )
    )
    teams = dict(zip(cids, order, strict=True))
    await _ended(stack, cids, timeout_s=150)
    stories = await _stories(stack.ledger, cids)
    report = _report(stack.pool.runs, cids, stories)

    # Every compilation ran, and each one whose search found a candidate faster than its
    # baseline in its budget got it confirmed on the full tier (a leader found in the last
    # moment may reach the runner after the wall clock: LATE_S); one that found none says so
    # (with BOOST, one that got no search result in its budget on a very loaded host).
    for story in stories.values():
        end = _end_of(story)
        assert end["status"] == "succeeded", report
        if _had_leader(story, _wall_end(story, WALL_S) - LATE_S):
            assert _confirmed(story) >= 1, report
        elif not _confirmed(story):
            assert end["reason"].startswith("no candidate confirmed: "), report
            assert end["outcome"] in ("none_beat_the_baseline", "unconfirmed"), report

    # The pool served each confirmation before the search work requested after it: of the search
    # experiments requested later, the device began at most the one it was about to fetch and
    # one more before the confirmation (requests are recorded just before their work is
    # published; comparing request with request keeps a loaded host's publish delay out).
    # PUBLISH_SLACK_S: how much later than its request a loaded host may publish the work.
    runs = {r.experiment_id: r for r in stack.pool.runs}
    asked_at = {
        e.stream_id.removeprefix("experiment-"): recorded_s(e)
        for story in stories.values()
        for e in story
        if e.type == "ExperimentRequested"
    }
    for story in stories.values():
        for sid, (_, r, _, _) in _experiments(story).items():
            run = runs.get(sid.removeprefix("experiment-"))
            if r["tier"] != "full" or run is None:
                continue
            asked = asked_at[sid.removeprefix("experiment-")]
            overtaken = [
                o
                for o in stack.pool.runs
                if o.tier == "fast"
                and asked_at.get(o.experiment_id, 0.0) > asked + PUBLISH_SLACK_S
                and o.started_at < run.started_at
            ]
            assert len(overtaken) <= 2, _overtaken_report(report, run, asked, overtaken, asked_at)

    # Quotas: at most max_running compilations of a team ran at once (the others waited,
    # pending, and started in submission order); at most max_in_flight search experiments of a
    # compilation and max_in_flight_team of a team were open at once.
    for team in TEAMS:
        mine = [c for c in cids if teams[c] == team]
        spans, work = [], []
        for c in mine:
            story = stories[c]
            planned = next(e.position for e in story if e.type == "CompilationPlanned")
            ended = next(e.position for e in story if e.type == "CompilationEnded")
            spans.append((planned, ended))
            search = [(a, b) for a, r, b, _ in _experiments(story).values() if r["tier"] == "fast"]
            assert _most_at_once(search) <= QUOTAS.max_in_flight, report
            work.extend(search)
        assert _most_at_once(spans) <= QUOTAS.max_running, report
        assert _most_at_once(work) <= QUOTAS.max_in_flight_team, report
        # Those that waited were admitted in submission order.
        first_end = min(b for _, b in spans)
        waited = [c for c, (planned, _) in zip(mine, spans, strict=True) if planned > first_end]
        started = {c: spans[mine.index(c)][0] for c in waited}
        assert sorted(waited, key=lambda c: stories[c][0].position) == sorted(
            waited, key=started.__getitem__
        ), report
    # Alpha's six could not all run at once: two waited.
    alpha = [c for c in cids if teams[c] == "alpha"]
    first_end = min(
        next(e.position for e in stories[c] if e.type == "CompilationEnded") for c in alpha
    )
    late = [
        c
        for c in alpha
        if next(e.position for e in stories[c] if e.type == "CompilationPlanned") > first_end
    ]
    assert len(late) == TEAMS["alpha"] - QUOTAS.max_running, report


async def test_device_time_quota_stops_the_search_and_holds_new_compilations(
    stack: Stack,
) -> None:
    limit = QUOTAS.limits("metered")
    assert limit.device_seconds == 1.0 and limit.max_running == 2
    first = [await _submit(stack, "metered", wall_seconds=30.0) for _ in range(2)]
    waiting = await _submit(stack, "metered", wall_seconds=30.0)  # over max_running: pending
    await _ended(stack, first, timeout_s=60)
    stories = await _stories(stack.ledger, first)
    for story in stories.values():
        end = _end_of(story)
        assert end["status"] == "succeeded"
        assert "spent its device time" in end["reason"], end
        assert "KILN_QUOTA_DEVICE_SECONDS" in end["reason"]
    spent = sum(d["device_ms"] for s in stories.values() for *_, d in _experiments(s).values())
    assert spent / 1e3 >= limit.device_seconds

    # Both have ended, so a running slot is free, but the device time is spent: the third waits.
    await asyncio.sleep(2.0)
    got = await _get(stack, "metered", waiting)
    assert got.status == compiler_pb2.COMPILATION_STATUS_PENDING
    async with team_channel(stack.runner_addr, "metered") as channel:
        await compiler_pb2_grpc.CompilerStub(channel).Cancel(
            compiler_pb2.CancelRequest(compilation_id=waiting, reason="over quota"), timeout=20
        )
    await _ended(stack, [waiting], timeout_s=20)
    (story,) = (await _stories(stack.ledger, [waiting])).values()
    assert _end_of(story)["status"] == "cancelled"
    assert not _experiments(story)
    assert not any(e.type == "CompilationPlanned" for e in story)

    # What the runner knows of a team's device time comes from the ledger: a fresh reader (as
    # after a restart) finds the same.
    usage = TeamUsage(QUOTAS.period_s)
    reader = asyncio.create_task(usage.run(stack.ledger))
    try:
        await asyncio.wait_for(usage.loaded.wait(), 20)
    finally:
        await _stop(reader)
    assert usage.spent("metered") == pytest.approx(spent / 1e3)
    # Where it starts reading: after the last event recorded before the window (bisection).
    events = [e for story in stories.values() for e in story]
    first = min((e for e in events if e.type == "ExperimentCompleted"), key=lambda e: e.position)
    start = await position_before(stack.ledger, recorded_s(first), max(e.position for e in events))
    assert 0 < start < first.position
    async for before in stack.ledger.read_all(start - 1, max_count=1):
        assert before.position == start and recorded_s(before) < recorded_s(first)


async def test_submit_beyond_the_pending_limit_is_refused(stack: Stack) -> None:
    running = await _submit(stack, "crowded", wall_seconds=60.0)
    waiting = await _submit(stack, "crowded", wall_seconds=60.0)
    async with team_channel(stack.runner_addr, "crowded") as channel:
        stub = compiler_pb2_grpc.CompilerStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Submit(
                compiler_pb2.SubmitRequest(
                    workload=stack.workload, budget=common_pb2.Budget(wall_seconds=60.0)
                ),
                timeout=20,
            )
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "KILN_QUOTA_MAX_PENDING" in str(refused.value.details())
        assert (await _get(stack, "crowded", waiting)).status == (
            compiler_pb2.COMPILATION_STATUS_PENDING
        )
        for cid in (waiting, running):
            await stub.Cancel(compiler_pb2.CancelRequest(compilation_id=cid), timeout=20)
    await _ended(stack, [running, waiting], timeout_s=30)
    rows = await stack.ledger.query("compilations", {"team": "crowded"})
    assert len(rows) == 2 and {r["status"] for r in rows} == {"cancelled"}


async def _status(stack: Stack, cid: str) -> str:
    rows = await stack.ledger.query("compilations", {"compilation_id": cid})
    return str(rows[0]["status"]) if rows else ""


async def _projected_status(stack: Stack, cid: str, timeout_s: float = 10.0) -> str:
    """``cid``'s status once the compilations projection has its row (the projection follows
    the appends; under CI's load the Submit's row came after the first read)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not (status := await _status(stack, cid)):
        if asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.1)
    return status


async def _confirming(stack: Stack, team: str, wall_s: float) -> tuple[str, float]:
    """Submit until a compilation's confirmation is requested (with :data:`BOOST`, after its
    first search result; should the search find nothing faster than the baseline, it ends and
    another is submitted); returns its id and when its wall clock runs out (time.time())."""
    for _ in range(3):
        cid = await _submit(stack, team, wall_seconds=wall_s)
        while await _status(stack, cid) not in ("succeeded", "failed", "cancelled"):
            (story,) = (await _stories(stack.ledger, [cid])).values()
            if any(
                e.type == "ExperimentRequested" and json.loads(e.data)["agent"] == "confirm"
                for e in story
            ):
                planned = next(e for e in story if e.type == "CompilationPlanned")
                return cid, recorded_s(planned) + wall_s
            await asyncio.sleep(0.1)
    raise AssertionError("three compilations in a row found nothing to confirm")


async def test_a_confirmation_waiting_for_a_device_runs_after_the_wall_clock(stack: Stack) -> None:
    stack.pool.full_open.clear()  # the confirmation's reference holds the device, unmeasured
    try:
        cid, wall_end = await _confirming(stack, "solo", wall_s=6.0)
        await asyncio.sleep(max(0.0, wall_end - time.time()) + 1.0)
        assert await _status(stack, cid) == "running"  # past its wall clock, waiting
    finally:
        stack.pool.full_open.set()
    await _ended(stack, [cid], timeout_s=GRACE_S + 20)
    (story,) = (await _stories(stack.ledger, [cid])).values()
    end = _end_of(story)
    assert end["status"] == "succeeded"
    assert "wall-clock budget of 6 s is spent; its last confirmation ended" in end["reason"]
    assert _confirmed(story) >= 1
    experiments = _experiments(story).values()
    assert all(d["status"] != "cancelled" for _, r, _, d in experiments if r["tier"] == "full")
    # The agents' experiments still open when the wall clock ran out were closed at once.
    closed = [d for _, r, _, d in experiments if d["status"] == "cancelled"]
    assert all("the agents stopped before an engine answered" in d["error"] for d in closed)


async def test_a_confirmation_that_never_gets_a_device_is_cut_after_the_grace(
    stack: Stack,
) -> None:
    stack.pool.full_open.clear()
    try:
        cid, _ = await _confirming(stack, "solo", wall_s=6.0)
        await _ended(stack, [cid], timeout_s=GRACE_S + 30)
    finally:
        stack.pool.full_open.set()
    (story,) = (await _stories(stack.ledger, [cid])).values()
    end = _end_of(story)
    assert end["status"] == "succeeded"
    assert f"a confirmation still waiting for a device after {GRACE_S:g} s more" in end["reason"]
    requested = {e.stream_id for e in story if e.type == "ExperimentRequested"}
    assert requested == set(_experiments(story))  # nothing left open
    full = [d for _, r, _, d in _experiments(story).values() if r["tier"] == "full"]
    assert full and all(d["status"] == "cancelled" for d in full)


async def test_after_a_restart_the_running_keep_their_slots_and_the_pending_still_wait(
    stack: Stack,
) -> None:
    running = await _submit(stack, "restart", wall_seconds=4.0)
    pending = await _submit(stack, "restart", wall_seconds=4.0)
    for _ in range(300):
        if await _status(stack, running) == "running":
            break
        await asyncio.sleep(0.1)
    assert await _projected_status(stack, pending) == "pending"
    await stack.restart_runner()
    assert await _projected_status(stack, pending) == "pending"  # the resumed one holds the slot
    await _ended(stack, [running, pending], timeout_s=GRACE_S + 40)
    stories = await _stories(stack.ledger, [running, pending])
    ends = {c: _end_of(s) for c, s in stories.items()}
    assert {e["status"] for e in ends.values()} == {"succeeded"}, ends
    first_end = next(e.position for e in stories[running] if e.type == "CompilationEnded")
    second_start = next(e.position for e in stories[pending] if e.type == "CompilationPlanned")
    assert second_start > first_end  # one at a time, across the restart
