"""Honest ends of ``kiln compile`` (issue 17): Ctrl-C cancels the compilation in the ledger (no
later runner resumes it); a compilation that confirmed nothing says why in its outcome and
reason; the summary puts the full-tier reference beside a full-tier best. Real ledger, cost
model, engine pool (engines simulated) and agent runner over gRPC
(:mod:`tests.integration.pool_stack`), the CLI as a child process."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from rich.console import Console

from kiln.cli.compile import CANCEL_REASON
from kiln.cli.compile_view import summary_table
from kiln.common.settings import KilnSettings
from kiln.domain.judging import NONE_CONFIRMED
from kiln.v1 import common_pb2, compiler_pb2

from ..pki import team_tls
from .pool_stack import PoolStack, pool_stack
from .serving import run_command

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
MODEL = DATA / "models" / "llama-3.2-1b.json"
TRACE = DATA / "traces" / "azure_llm_2023_conv.csv"

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not MODEL.is_file() or not TRACE.is_file(), reason="../shared/data is absent"
    ),
]

TEAM = "outcomes"
ENDED = (
    compiler_pb2.COMPILATION_STATUS_SUCCEEDED,
    compiler_pb2.COMPILATION_STATUS_FAILED,
    compiler_pb2.COMPILATION_STATUS_CANCELLED,
)


@pytest_asyncio.fixture(scope="module")
async def stack(settings: KilnSettings) -> AsyncIterator[PoolStack]:
    async with pool_stack(settings, "ko") as s:
        await s.start_runner()
        yield s


def _engines(stack: PoolStack, boost: float, full_boost: float | None = None) -> Any:
    """The CPU pool's simulated engines, every candidate ``boost`` times faster than the fake
    model says (``full_boost`` on the full tier)."""
    engines = stack.pools["cpu-pool"].engines
    engines.boost = boost
    engines.full_boost = boost if full_boost is None else full_boost
    engines.full_open.set()
    return engines


def _cli_env(stack: PoolStack, tmp_path: Path) -> dict[str, str]:
    """The CLI child's environment: the runner's address, the team (its certificate issued)."""
    team_tls(TEAM)
    return {
        "KILN_AGENT_RUNNER_ADDR": stack.runner_addr,
        "KILN_STATE_DIR": str(tmp_path),
        "KILN_TEAM": TEAM,
    }


async def _compile(stack: PoolStack, batch: int, wall_s: float) -> compiler_pb2.Compilation:
    """Submit on cpu (``batch``: a workload of its own, so no result is reused from another
    test) and wait for the end."""
    request = compiler_pb2.SubmitRequest(
        workload=common_pb2.Workload(
            model=common_pb2.ModelSpec(name="llama-3.2-1b", config_json=MODEL.read_text()),
            traffic=common_pb2.TrafficShape(batch_size=batch, context_len=256),
            hardware=common_pb2.HardwareTarget(name="cpu"),
        ),
        budget=common_pb2.Budget(wall_seconds=wall_s),
        agents=["coordinate"],
    )
    async with stack.compiler(TEAM) as stub:
        reply = await stub.Submit(request, timeout=30)
        async with asyncio.timeout(wall_s + 60):
            while True:
                get = compiler_pb2.GetRequest(compilation_id=reply.compilation_id)
                snap = await stub.Get(get, timeout=20)
                if snap.status in ENDED:
                    return snap
                await asyncio.sleep(0.5)


def _text(snap: compiler_pb2.Compilation) -> str:
    console = Console(record=True, width=200)
    console.print(summary_table(snap))
    return console.export_text()


def _ended_event(events: list[Any]) -> dict[str, Any]:
    assert events[-1].type == "CompilationEnded"
    return dict(json.loads(events[-1].data))


async def test_ctrl_c_cancels_the_compilation_and_no_later_runner_resumes_it(
    stack: PoolStack, tmp_path: Path
) -> None:
    _engines(stack, 1.0)
    cid = f"ctrl-c-{uuid.uuid4().hex[:12]}"
    args = ["--model", str(MODEL), "--traffic", str(TRACE), "--hardware", "cpu", "--batch", "7"]
    args += ["--budget", "5m", "--id", cid, "--agent", "coordinate"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kiln",
        "compile",
        *args,
        env={**os.environ, "COLUMNS": "200", **_cli_env(stack, tmp_path)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(90):  # until it runs: the baseline is measured
            while not any(e.type == "BaselineMeasured" for e in await _events_or_none(stack, cid)):
                assert proc.returncode is None, (await proc.communicate())[1].decode()
                await asyncio.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    text = out.decode() + err.decode()
    assert proc.returncode == 130, text
    assert "Traceback" not in text, text
    said = [line for line in text.splitlines() if "cancelled compilation" in line]
    assert said == [f"cancelled compilation {cid} (Ctrl-C)"], text
    events = await stack.events(cid)
    asked = [json.loads(e.data) for e in events if e.type == "CompilationCancelRequested"]
    assert [a["reason"] for a in asked] == [CANCEL_REASON]
    assert _ended_event(events)["status"] == "cancelled"
    # A restart (the next `kiln up`) finds it ended: nothing resumes it, nothing is appended.
    await stack.stop_runner()
    runner = await stack.start_runner()
    await asyncio.sleep(1.0)
    assert runner.runner(cid) is None
    assert len(await stack.events(cid)) == len(events)


async def _events_or_none(stack: PoolStack, cid: str) -> list[Any]:
    try:
        return await stack.events(cid)
    except Exception:  # not submitted yet
        return []


async def test_nothing_beat_the_baseline_is_said(stack: PoolStack) -> None:
    _engines(stack, 0.5)  # every candidate at half the reference's speed
    snap = await _compile(stack, batch=2, wall_s=6.0)
    assert snap.status == compiler_pb2.COMPILATION_STATUS_SUCCEEDED, snap.reason
    assert not snap.HasField("best")
    assert snap.outcome == "none_beat_the_baseline"
    assert snap.reason.startswith(NONE_CONFIRMED + "none of the "), snap.reason
    assert "beat the reference there; the wall-clock budget" in snap.reason, snap.reason
    text = _text(snap)
    assert "succeeded, but no candidate was confirmed (the wall-clock budget" in text, text
    assert re.search(r"│ best\s+│ none: none of the \d+ candidates measured correct", text), text
    ended = _ended_event(await stack.events(snap.compilation_id))
    assert ended["outcome"] == "none_beat_the_baseline"


async def test_every_candidate_losing_on_the_full_tier_is_said(stack: PoolStack) -> None:
    _engines(stack, 1.5, full_boost=0.7)  # fast-tier winners, full-tier losers
    snap = await _compile(stack, batch=3, wall_s=8.0)
    assert snap.status == compiler_pb2.COMPILATION_STATUS_SUCCEEDED, snap.reason
    assert not snap.HasField("best")
    assert snap.outcome == "lost_on_full_tier", snap.reason
    assert re.match(
        re.escape(NONE_CONFIRMED) + r"\d+ candidate\(s\) measured on the full tier and none beat "
        r"the reference measured next to it beyond timing noise \(best 0\.\d\dx\)",
        snap.reason,
    ), snap.reason


async def test_a_budget_spent_before_any_confirmation_is_said(stack: PoolStack) -> None:
    engines = _engines(stack, 1.5)
    engines.full_open.clear()  # a confirmation holds the device and never answers
    try:
        snap = await _compile(stack, batch=4, wall_s=6.0)
    finally:
        engines.full_open.set()
    assert snap.status == compiler_pb2.COMPILATION_STATUS_SUCCEEDED, snap.reason
    assert not snap.HasField("best")
    assert snap.outcome == "unconfirmed", snap.reason
    assert snap.reason.startswith(NONE_CONFIRMED + "the fast tier's leader ("), snap.reason
    assert "the full tier" in snap.reason.split("; ")[0], snap.reason


async def test_a_confirmed_best_is_shown_beside_the_full_tier_reference(
    stack: PoolStack, tmp_path: Path
) -> None:
    _engines(stack, 1.4)
    args = ["--model", str(MODEL), "--traffic", str(TRACE), "--hardware", "cpu", "--batch", "9"]
    args += ["--budget", "8s", "--agent", "coordinate"]
    code, out = await run_command(
        "-m", "kiln", "compile", *args, env=_cli_env(stack, tmp_path), timeout_s=120
    )
    assert code == 0, out
    assert "no candidate confirmed" not in out and "warning" not in out, out
    ref = re.search(r"│ baseline\s+│ ([\d,.]+) tok/s \(full tier, the reference measured", out)
    fast = re.search(r"│ fast-tier baseline\s+│ ([\d,.]+) tok/s \(fast tier", out)
    best = re.search(r"│ best\s+│ ([\d,.]+) tok/s", out)
    assert ref and fast and best, out
    # like with like: the full-tier best is within a few times its full-tier reference, while the
    # fast-tier baseline (2 layers) is another scale altogether
    assert float(best[1].replace(",", "")) > float(ref[1].replace(",", "")), out
