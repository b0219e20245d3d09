"""A compilation through all four services as separate processes, over real gRPC, NATS and
PostgreSQL, with the real engine pool measuring on the CPU: the ``kiln compile`` CLI end to end,
SIGKILL of the agent runner and of the engine pool mid-compilation, and SIGKILL of an engine
worker process (a child of the engine pool) mid-experiment, which is run again rather than
recorded as the candidate's crash."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import psycopg
import pytest
import pytest_asyncio

from kiln.common.client import team_channel
from kiln.common.settings import KilnSettings
from kiln.domain.candidate import REFERENCE_CANDIDATE
from kiln.ledger.db import create_engine, libpq_dsn
from kiln.ledger.replay import replay
from kiln.v1 import compiler_pb2_grpc, engine_pool_pb2, engine_pool_pb2_grpc

from ..pki import team_tls
from .processes import ServiceProcess, free_port, service_env

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
LLAMA = DATA / "models" / "llama-3.2-1b.json"
TRACE = DATA / "traces" / "azure_llm_2023_conv.csv"

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.integration,
    pytest.mark.skipif(not LLAMA.is_file() or not TRACE.is_file(), reason="../shared/data absent"),
]

SERVICES = ("ledger", "cost-model", "engine-pool", "agent-runner")


def tiny_llama(tmp_path: Path) -> Path:
    """Llama-3.2-1B's config shrunk so an engine builds and measures in well under a second
    (same family, rope scaling and GQA ratio)."""
    cfg = json.loads(LLAMA.read_text())
    cfg.update(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=2048,
    )
    path = tmp_path / "tiny-llama.json"
    path.write_text(json.dumps(cfg))
    return path


@dataclass
class Deployment:
    """The four services of one test, and what they share."""

    procs: dict[str, ServiceProcess]
    env: dict[str, str]
    database_url: str

    @property
    def compiler_addr(self) -> str:
        return self.procs["agent-runner"].addr


@pytest_asyncio.fixture
async def deployment(settings: KilnSettings, tmp_path: Path) -> AsyncIterator[Deployment]:
    addrs = {name: f"127.0.0.1:{free_port()}" for name in SERVICES}
    prefix = f"ke{uuid.uuid4().hex[:8]}"  # its own work queue: no other consumer may share it
    env = service_env(str(settings.database_url), str(settings.nats_url), prefix, tmp_path, addrs)
    env.update(KILN_ENGINE_ACK_WAIT_S="5", KILN_ENGINE_MEASURE_BUDGET_S="0.2")
    # A fast-tier and a full-tier engine stay warm side by side: confirmations on the full
    # tier do not rebuild the fast engine each time (tiny models: memory is no concern).
    env.update(KILN_ENGINE_MAX_ENGINES="2")
    procs = {n: ServiceProcess(n, addrs[n], env, tmp_path / f"{n}.log") for n in SERVICES}
    try:
        for proc in procs.values():
            await proc.start()
        yield Deployment(procs, env, str(settings.database_url))
    finally:
        for proc in reversed(procs.values()):
            proc.stop()


def _events_of(database_url: str, compilation_id: str) -> list[dict[str, Any]]:
    with psycopg.connect(libpq_dsn(database_url)) as conn:
        rows = conn.execute(
            "SELECT position, stream_id, stream_version, type, data FROM events "
            "WHERE stream_id = %s OR data->>'compilation_id' = %s ORDER BY position",
            (f"compilation-{compilation_id}", compilation_id),
        ).fetchall()
    return [
        {"position": p, "stream_id": s, "version": v, "type": t, "data": d}
        for p, s, v, t, d in rows
    ]


async def _wait_for(
    database_url: str, compilation_id: str, kind: str, count: int, timeout_s: float
) -> list[dict[str, Any]]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        events = _events_of(database_url, compilation_id)
        if sum(e["type"] == kind for e in events) >= count:
            return events
        if loop.time() > deadline:
            got = Counter(e["type"] for e in events)
            raise AssertionError(f"waited {timeout_s}s for {count} {kind}; have {dict(got)}")
        await asyncio.sleep(0.2)


def _assert_sound(events: list[dict[str, Any]], max_experiments: int) -> None:
    """No event lost or duplicated: one completion per request, no candidate twice on a tier
    (but the reference, measured again on the full tier for every confirmation), bests only
    from the full tier, versions contiguous per stream, one end, the budget respected."""
    requested = {e["stream_id"]: e for e in events if e["type"] == "ExperimentRequested"}
    completed = Counter(e["stream_id"] for e in events if e["type"] == "ExperimentCompleted")
    assert set(completed) == set(requested), "a request without a completion, or vice versa"
    assert max(completed.values()) == 1, "an experiment completed twice"
    candidates = Counter(
        (e["data"]["candidate_id"], e["data"]["tier"])
        for e in requested.values()
        if (e["data"]["candidate_id"], e["data"]["tier"]) != (REFERENCE_CANDIDATE.id, "full")
    )
    assert max(candidates.values()) == 1, f"a candidate was measured twice: {candidates}"
    bests = [e for e in events if e["type"] == "BestCandidateImproved"]
    assert all(e["data"]["tier"] == "full" for e in bests)
    by_stream: dict[str, list[int]] = {}
    for e in events:
        by_stream.setdefault(e["stream_id"], []).append(e["version"])
    for stream, versions in by_stream.items():
        assert versions == list(range(1, len(versions) + 1)), f"{stream}: versions {versions}"
    ends = [e for e in events if e["type"] == "CompilationEnded"]
    assert len(ends) == 1 and ends[0]["data"]["status"] == "succeeded", ends
    counted = [
        e
        for e in events
        if e["type"] == "ExperimentCompleted" and e["data"]["status"] != "cancelled"
    ]
    assert len(counted) <= max_experiments


def _submit_request(
    model: Path, budget_s: float, max_experiments: int, agents: list[str] | None = None
) -> Any:
    from kiln.cli.compile import build_request

    return build_request(model, TRACE, "cpu", 0, budget_s, max_experiments, "", agents or [])


def _engine_workers(pool_pid: int) -> dict[int, psutil.Process]:
    """The engine worker processes of the engine pool ``pool_pid``, by pid: its descendants
    started by multiprocessing's spawn (not its resource tracker)."""
    workers = {}
    for child in psutil.Process(pool_pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "spawn_main" in " ".join(child.cmdline()):
                workers[child.pid] = child
    return workers


async def _kill_a_busy_engine(deployment: Deployment, timeout_s: float) -> list[int]:
    """SIGKILL engine worker processes as soon as the engine pool reports one running an
    experiment (ListEngines: BUSY): that one by its pid, or every worker when the pool does not
    report pids. Returns the pids killed."""
    pool = deployment.procs["engine-pool"]
    assert pool.proc is not None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with team_channel(pool.addr, "e2e") as ch:
        stub = engine_pool_pb2_grpc.EnginePoolStub(ch)
        while loop.time() < deadline:
            reply = await stub.ListEngines(
                engine_pool_pb2.ListEnginesRequest(local_only=True), timeout=10
            )
            busy = [e for e in reply.engines if e.state == engine_pool_pb2.ENGINE_STATE_BUSY]
            workers = _engine_workers(pool.proc.pid) if busy else {}
            chosen = [workers[e.pid] for e in busy if e.pid in workers] or list(workers.values())
            for worker in chosen:
                with contextlib.suppress(psutil.NoSuchProcess):
                    worker.kill()
            if chosen:
                return [w.pid for w in chosen]
            await asyncio.sleep(0.02)
    raise AssertionError(f"no engine was busy within {timeout_s}s")


async def test_compilation_survives_sigkill_of_agent_runner_and_engine_pool(
    deployment: Deployment, tmp_path: Path
) -> None:
    request = _submit_request(tiny_llama(tmp_path), budget_s=120, max_experiments=12)
    async with team_channel(deployment.compiler_addr, "e2e") as ch:
        compilation = await compiler_pb2_grpc.CompilerStub(ch).Submit(request, timeout=60)
    cid = compilation.compilation_id
    db = deployment.database_url

    await _wait_for(db, cid, "ExperimentCompleted", 3, timeout_s=120)
    deployment.procs["agent-runner"].kill()
    await deployment.procs["agent-runner"].start()

    before = sum(e["type"] == "ExperimentCompleted" for e in _events_of(db, cid))
    await _wait_for(db, cid, "ExperimentRequested", before + 1, timeout_s=120)
    deployment.procs["engine-pool"].kill()  # mid-experiment: its work must be redelivered
    await deployment.procs["engine-pool"].start()

    events = await _wait_for(db, cid, "CompilationEnded", 1, timeout_s=240)
    _assert_sound(events, max_experiments=12)
    assert any(e["type"] == "BaselineMeasured" for e in events)
    engine = create_engine(db)
    try:
        for _ in range(50):  # the ledger's projector folds the last events shortly
            report = await replay(engine)
            if report.checkpoint_position >= events[-1]["position"]:
                break
            await asyncio.sleep(0.1)
        assert report.equal, [p.differences for p in report.projections]
    finally:
        await engine.dispose()


async def test_compilation_survives_an_engine_crash_mid_experiment(
    deployment: Deployment, tmp_path: Path
) -> None:
    # One agent (coordinate descent walks op swaps before torch_compile): short experiments.
    request = _submit_request(tiny_llama(tmp_path), 180, max_experiments=7, agents=["coordinate"])
    async with team_channel(deployment.compiler_addr, "e2e") as ch:
        compilation = await compiler_pb2_grpc.CompilerStub(ch).Submit(request, timeout=60)
    cid = compilation.compilation_id
    db = deployment.database_url

    await _wait_for(db, cid, "ExperimentCompleted", 2, timeout_s=120)  # engines are warm
    killed = await _kill_a_busy_engine(deployment, timeout_s=60)

    events = await _wait_for(db, cid, "CompilationEnded", 1, timeout_s=240)
    _assert_sound(events, max_experiments=7)  # ... and it succeeded
    results = [e["data"] for e in events if e["type"] == "ExperimentCompleted"]
    # The engine was killed from outside: the pool restarted it and ran the experiment again;
    # the candidate is not blamed (issue 14).
    assert "work.engine_died" in deployment.procs["engine-pool"].log_tail(1_000_000), killed
    blamed = [(d["status"], d["error"]) for d in results if "engine process died" in d["error"]]
    assert not blamed, f"killed {killed}; results: {blamed}"
    assert len(results) == 7 and all(d["status"] != "cancelled" for d in results)
    end = events[-1]["data"]
    reason = end["reason"]
    if end["outcome"] != "confirmed":  # it says why nothing was confirmed first (issue 17)
        assert reason.startswith("no candidate confirmed: "), reason
        reason = reason.split("; ", 1)[1]
    assert reason.startswith("the experiment budget is spent (7 of 7 experiments)"), reason
    assert any(e["type"] == "TierAgreement" for e in events)


async def test_kiln_compile_cli_end_to_end(deployment: Deployment, tmp_path: Path) -> None:
    model = tiny_llama(tmp_path)
    args = [
        sys.executable, "-m", "kiln", "compile", "--model", str(model), "--traffic", str(TRACE),
        "--hardware", "cpu", "--budget", "90s", "--max-experiments", "8",
    ]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        *args, env=deployment.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 240)
    text = out.decode()
    assert proc.returncode == 0, err.decode()[-2000:] + text
    assert "succeeded" in text and "baseline" in text and "experiments" in text
    assert "fast vs full" in text  # the tier agreement, at the end of `kiln compile`
    # stderr is a pipe, not a terminal: progress comes as one plain line per event.
    progress = err.decode()
    assert re.search(r"^\[\s*\d+\.\d s\] baseline \d", progress, re.M), progress[-2000:]
    assert re.search(r"^\[\s*\d+\.\d s\] ended: succeeded", progress, re.M), progress[-2000:]
    match = re.search(r"compilation ([0-9a-f]{32})", text)
    assert match, text
    shown = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kiln", "compilations", "show", match.group(1),
        env=deployment.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    show_out, _ = await shown.communicate()
    assert shown.returncode == 0 and "fast vs full" in show_out.decode()
    listed = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kiln", "compilations", "list", env=deployment.env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    listing, _ = await listed.communicate()
    assert listed.returncode == 0 and "tiny-llama" in listing.decode()
    # Every --json is JSON lines: one object per line (issue 17).
    for command in (["list"], ["show", match.group(1)], ["curve", match.group(1)]):
        as_json = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kiln", "compilations", *command, "--json",
            env=deployment.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        json_out, json_err = await as_json.communicate()
        assert as_json.returncode == 0, json_err.decode()
        rows = [json.loads(line) for line in json_out.decode().splitlines()]
        assert all(isinstance(r, dict) for r in rows), command
        if command[0] != "curve":
            assert any(r.get("compilation_id") == match.group(1) for r in rows), rows
    # A best with moves says what each bought (or that it was not measured apart).
    if "best candidate" in text:
        assert "what each move bought" in text, text
    # `kiln compilations cancel`: another team (with its own certificate) cannot even see it;
    # the owner is told it has ended.
    team_tls("someone-else")  # issued into the session's PKI, where the CLI finds it
    for team, needle in (
        ("someone-else", "NOT_FOUND"),
        (None, "FAILED_PRECONDITION"),
    ):
        env = dict(deployment.env, **({"KILN_TEAM": team} if team else {}))
        cancel = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kiln", "compilations", "cancel", match.group(1),
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        _, cancel_err = await cancel.communicate()
        lines = cancel_err.decode().strip().splitlines()
        assert cancel.returncode == 1 and len(lines) == 1 and needle in lines[0], lines
