"""What the dashboard's integration and browser tests share: a short compilation on the pool
stack (:mod:`tests.integration.pool_stack`: real ledger, cost model, engine pool with simulated
engines, agent runner) and ``kiln dashboard`` started as a child process the way a user starts
it, acting for one team with that team's certificate.

A child process, not a task here: the dashboard's gRPC clients would otherwise run in a second
event loop beside the servers of this one (see :func:`tests.integration.serving.run_command`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from kiln.common.settings import KilnSettings
from kiln.v1 import common_pb2, compiler_pb2

from ..integration.pool_stack import PoolStack, pool_stack
from ..pki import team_tls

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
MODEL = DATA / "models" / "llama-3.2-1b.json"

ENDED = (
    compiler_pb2.COMPILATION_STATUS_SUCCEEDED,
    compiler_pb2.COMPILATION_STATUS_FAILED,
    compiler_pb2.COMPILATION_STATUS_CANCELLED,
)


@dataclass
class DashboardProcess:
    """A running ``kiln dashboard``: its base URL (``http://127.0.0.1:PORT/``) and log."""

    url: str
    proc: asyncio.subprocess.Process
    log: Path


@contextlib.asynccontextmanager
async def dashboard_stack(settings: KilnSettings, letters: str) -> AsyncIterator[PoolStack]:
    """:func:`~tests.integration.pool_stack.pool_stack` with its runner started, simulated
    engines answering."""
    async with pool_stack(settings, letters) as stack:
        await stack.start_runner()
        engines_ready(stack)
        yield stack


def cli_env(stack: PoolStack, team: str, state_dir: Path) -> dict[str, str]:
    """The environment of a CLI child acting for ``team`` against ``stack``."""
    team_tls(team)  # its certificate, issued by the session's CA
    s = stack.settings
    return {
        "KILN_AGENT_RUNNER_ADDR": stack.runner_addr,
        "KILN_LEDGER_ADDR": s.ledger_addr,
        "KILN_TEAM": team,
        "KILN_STATE_DIR": str(state_dir),
        "KILN_NATS_URL": s.nats_url or "",
        "KILN_SUBJECT_PREFIX": s.subject_prefix,
        "KILN_LOG_FORMAT": "console",
    }


@contextlib.asynccontextmanager
async def dashboard(
    stack: PoolStack,
    team: str,
    state_dir: Path,
    *,
    listen: str = "127.0.0.1:0",
    extra_env: dict[str, str] | None = None,
) -> AsyncIterator[DashboardProcess]:
    """``python -m kiln dashboard --listen LISTEN`` for ``team``; yields once it listens."""
    await asyncio.to_thread(state_dir.mkdir, parents=True, exist_ok=True)
    log = state_dir / "dashboard.log"
    env = {**os.environ, **cli_env(stack, team, state_dir), **(extra_env or {})}
    with log.open("wb") as sink:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "kiln",
            "dashboard",
            "--listen",
            listen,
            env=env,
            stdout=sink,
            stderr=sink,
        )
    try:
        url = ""
        async with asyncio.timeout(60):
            while not url:
                m = re.search(r"at (http://\S+/)", log.read_text(errors="replace"))
                if m:
                    url = m.group(1)
                elif proc.returncode is not None:
                    raise AssertionError(f"kiln dashboard exited: {log.read_text()}")
                else:
                    await asyncio.sleep(0.1)
        yield DashboardProcess(url, proc, log)
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()


def submit_request(batch: int, wall_s: float, cid: str = "") -> compiler_pb2.SubmitRequest:
    """A cpu compilation of llama-3.2-1b's architecture at ``batch`` (a workload of its own per
    test, so no result is reused), the ``coordinate`` agent only."""
    return compiler_pb2.SubmitRequest(
        compilation_id=cid,
        workload=common_pb2.Workload(
            model=common_pb2.ModelSpec(name="llama-3.2-1b", config_json=MODEL.read_text()),
            traffic=common_pb2.TrafficShape(batch_size=batch, context_len=256),
            hardware=common_pb2.HardwareTarget(name="cpu"),
        ),
        budget=common_pb2.Budget(wall_seconds=wall_s),
        agents=["coordinate"],
    )


async def submit(stack: PoolStack, team: str, batch: int, wall_s: float) -> str:
    """Submit as ``team``; the compilation's id."""
    async with stack.compiler(team) as stub:
        reply = await stub.Submit(submit_request(batch, wall_s), timeout=30)
    return str(reply.compilation_id)


async def wait_ended(stack: PoolStack, team: str, cid: str, timeout_s: float = 120) -> None:
    """Until the compilation has ended."""
    async with stack.compiler(team) as stub, asyncio.timeout(timeout_s):
        while True:
            snap = await stub.Get(compiler_pb2.GetRequest(compilation_id=cid), timeout=20)
            if snap.status in ENDED:
                return
            await asyncio.sleep(0.5)


def engines_ready(stack: PoolStack) -> None:
    """Let the simulated full-tier engines answer (they may be held by other tests' settings)."""
    engines = stack.pools["cpu-pool"].engines
    engines.boost = 1.3
    engines.full_boost = 1.3
    engines.full_open.set()
