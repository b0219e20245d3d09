"""A deployment end to end, the four services as processes over real gRPC, NATS and PostgreSQL
on the CPU with a tiny model: created (its first compilation promoted), fed a drifting replay
(an Azure conversation slice, then the same slice with prompts x1.8) through the
``kiln traffic observe`` CLI, drift detected, the warm-started recompilation (the active
candidate as its incumbent) resumed after a SIGKILL of the agent runner, ending in a promotion
or a recorded decline; nothing recorded twice; another team cannot see, observe or roll back
the deployment (NOT_FOUND, as an unknown one)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import psycopg
import pytest

from kiln.common.client import team_channel
from kiln.common.settings import KilnSettings
from kiln.domain.deployment import deployment_id
from kiln.ledger.db import libpq_dsn
from kiln.v1 import common_pb2, deployments_pb2, deployments_pb2_grpc
from tests.databases import scratch_database

from ..pki import team_tls
from .test_compile_e2e import TRACE, Deployment, _submit_request, deployment, tiny_llama

__all__ = ["deployment"]  # the fixture, shared with the compile e2e

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

WINDOW_S = 120.0


@pytest.fixture(scope="module")
def settings(settings: KilnSettings, postgres_server_url: str) -> Iterator[KilnSettings]:
    """The session's settings on a database of this module's own: the agent runners of later
    tests on this worker must not resume the deployment (its controller) or its compilations."""
    with scratch_database(postgres_server_url) as url:
        yield settings.model_copy(update={"database_url": url})


SLICE_S = 480.0


def _events(db: str, did: str) -> list[dict[str, Any]]:
    with psycopg.connect(libpq_dsn(db)) as conn:
        rows = conn.execute(
            "SELECT position, stream_version, type, data FROM events WHERE stream_id = %s "
            "ORDER BY position",
            (f"deployment-{did}",),
        ).fetchall()
    return [{"position": p, "version": v, "type": t, "data": d} for p, v, t, d in rows]


def _compilation_events(db: str, cid: str) -> list[dict[str, Any]]:
    with psycopg.connect(libpq_dsn(db)) as conn:
        rows = conn.execute(
            "SELECT type, data FROM events WHERE stream_id = %s OR data->>'compilation_id' = %s "
            "ORDER BY position",
            (f"compilation-{cid}", cid),
        ).fetchall()
    return [{"type": t, "data": d} for t, d in rows]


async def _wait(db: str, did: str, kinds: tuple[str, ...], timeout_s: float) -> list[dict]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        events = _events(db, did)
        if any(e["type"] in kinds for e in events):
            return events
        if loop.time() > deadline:
            got = Counter(e["type"] for e in events)
            raise AssertionError(f"waited {timeout_s}s for {kinds}; have {dict(got)}")
        await asyncio.sleep(0.3)


def _slice(tmp_path: Path) -> Path:
    """The Azure conversation trace's first SLICE_S seconds (an Azure CSV)."""
    from kiln.workloads.traffic import read_trace

    lines = TRACE.read_text().splitlines()
    trace = read_trace(TRACE)
    keep = sum(1 for r in trace.requests if r.arrival_s < SLICE_S)
    path = tmp_path / "slice.csv"
    path.write_text("\n".join(lines[: keep + 1]) + "\n")
    return path


async def _cli(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kiln", *args, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode or 0, out.decode(), err.decode()


@pytest.mark.timeout(900)
async def test_a_drifting_deployment_recompiles_and_decides(
    deployment: Deployment, tmp_path: Path
) -> None:
    db, env = deployment.database_url, deployment.env
    model = tiny_llama(tmp_path)
    # the experiment budget ends each compilation; the wall clock only bounds a loaded host
    # (the first compilation's baseline includes building the engine: 50 s was not enough there)
    submit = _submit_request(model, budget_s=150, max_experiments=10, agents=["coordinate"])
    policy = deployments_pb2.DeploymentPolicy(
        window_s=WINDOW_S,
        step_s=WINDOW_S,
        min_requests=20,
        consecutive=2,
        budget=common_pb2.Budget(wall_seconds=150, max_experiments=10),
        agents=["coordinate"],
        max_recompilations=1,
    )
    request = deployments_pb2.CreateDeploymentRequest(
        name="chat.eu", workload=submit.workload, policy=policy
    )
    async with team_channel(deployment.compiler_addr, "e2e") as ch:
        stub = deployments_pb2_grpc.DeploymentsStub(ch)
        created = await stub.Create(request, timeout=60)
        with pytest.raises(grpc.RpcError) as again:
            await stub.Create(request, timeout=60)
        assert again.value.code() == grpc.StatusCode.ALREADY_EXISTS
    did = created.deployment_id
    assert did == deployment_id("e2e", "chat.eu")

    events = await _wait(db, did, ("CandidatePromoted", "PromotionDeclined"), 300)
    initial = next((e for e in events if e["type"] == "CandidatePromoted"), None)
    assert initial is not None, [e["data"].get("reason") for e in events]
    assert initial["data"]["reason"] == "initial"
    active = initial["data"]["candidate_id"]

    # The drifting replay: the slice, then the same slice with prompts x1.8 after it.
    trace = _slice(tmp_path)
    code, out, err = await _cli(env, "traffic", "observe", "chat.eu", str(trace), "--speed", "0")
    assert code == 0, err
    code, out, err = await _cli(
        env, "traffic", "observe", "chat.eu", str(trace), "--speed", "0", "--scale-isl", "1.8",
        "--close",
    )  # fmt: skip
    assert code == 0, err
    events = await _wait(db, did, ("RecompilationStarted",), 90)
    drift = [e for e in events if e["type"] == "DriftDetected"]
    assert len(drift) == 1 and drift[0]["data"]["dominant"] in ("isl", "context")
    started = [e["data"] for e in events if e["type"] == "RecompilationStarted"][-1]
    assert started["reason"] in ("drift", "predicted_drop")
    assert started["incumbent_candidate_id"] == active
    assert started["warm_start_compilation_ids"] == [initial["data"]["compilation_id"]]
    windows = [e["data"] for e in events if e["type"] == "TrafficWindowObserved"]
    first_drifted = next(w for w in windows if w["drifted"])
    assert first_drifted["start_s"] >= SLICE_S - WINDOW_S  # stationary windows never drifted

    # SIGKILL mid-recompilation: the next agent runner resumes it and the controller decides.
    cid = started["compilation_id"]
    for _ in range(300):
        if any(e["type"] == "ExperimentCompleted" for e in _compilation_events(db, cid)):
            break
        await asyncio.sleep(0.2)
    deployment.procs["agent-runner"].kill()
    await deployment.procs["agent-runner"].start()
    events = await _wait_verdict(db, did, initial["position"], 300)
    verdict = next(e for e in events if e["type"] in ("CandidatePromoted", "PromotionDeclined"))
    data = verdict["data"]
    assert data["compilation_id"] == cid
    if verdict["type"] == "CandidatePromoted":
        c = data["comparison"]  # measured against the active one, at the new shape
        assert c["incumbent_candidate_id"] == active and c["challenger_better"]
        assert c["incumbent_tokens_per_s"] and c["challenger_tokens_per_s"]
        assert data["shape"] == started["shape"]
    else:
        assert data["reason"]
    compared = [e for e in _compilation_events(db, cid) if e["type"] == "IncumbentCompared"]
    if verdict["type"] == "CandidatePromoted":
        assert compared and compared[0]["data"]["incumbent_candidate_id"] == active

    # Nothing recorded twice: contiguous versions, one event per window index.
    everything = _events(db, did)
    assert [e["version"] for e in everything] == list(range(1, len(everything) + 1))
    indices = [e["data"]["index"] for e in everything if e["type"] == "TrafficWindowObserved"]
    assert indices == list(range(len(indices)))
    ends = Counter(
        e["data"]["compilation_id"]
        for e in everything
        if e["type"] in ("CandidatePromoted", "PromotionDeclined")
    )
    assert max(ends.values()) == 1

    # People see it: show and history.
    code, out, err = await _cli(env, "deployments", "show", "chat.eu")
    assert code == 0, err
    assert "what drifted" in out and "what it bought" in out
    code, out, err = await _cli(env, "deployments", "history", "chat.eu", "--no-windows")
    assert code == 0 and "DriftDetected" in out and "RecompilationStarted" in out, err

    # Another team: NOT_FOUND for everything, exactly as an unknown name.
    team_tls("intruder")
    other = dict(env, KILN_TEAM="intruder")
    for args in (
        ("deployments", "show", "chat.eu"),
        ("deployments", "show", "e2e/chat.eu"),
        ("deployments", "rollback", "e2e/chat.eu"),
        ("traffic", "observe", "e2e/chat.eu", str(trace), "--speed", "0"),
    ):
        code, out, err = await _cli(other, *args)
        lines = err.strip().splitlines()
        assert code == 1 and lines and "NOT_FOUND" in lines[-1], (args, err)
    code, out, err = await _cli(env, "deployments", "show", "nope")
    assert code == 1 and "NOT_FOUND" in err


async def _wait_verdict(db: str, did: str, after: int, timeout_s: float) -> list[dict]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        events = [e for e in _events(db, did) if e["position"] > after]
        if any(e["type"] in ("CandidatePromoted", "PromotionDeclined") for e in events):
            return events
        if loop.time() > deadline:
            raise AssertionError(
                f"no verdict in {timeout_s}s: {Counter(e['type'] for e in events)}"
            )
        await asyncio.sleep(0.5)
