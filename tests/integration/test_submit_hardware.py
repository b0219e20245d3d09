"""Submit refuses hardware no engine pool serves, and no pool measures another kind's work
(issue 17): real ledger, cost model, engine pools (EnginePoolApp: registry and work queue on the
real NATS; engines simulated) and agent runner, over gRPC (:mod:`tests.integration.pool_stack`).

Before, the embedded default's CPU pool (``KILN_ENGINE_HARDWARE=*``) took an h100 compilation's
work, most experiments failed there and it ended "succeeded" with no best."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from google.protobuf.json_format import ParseDict

from kiln.common.client import team_channel
from kiln.common.settings import KilnSettings
from kiln.domain.candidate import Candidate
from kiln.engine_pool.devices import Device
from kiln.v1 import common_pb2, compiler_pb2, engine_pool_pb2, engine_pool_pb2_grpc

from ..pki import service_tls, team_tls
from ..unit.engine_testing import tiny_workload
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

TEAM = "hardware"
H100 = Device("cuda:0", "h100", "NVIDIA H100 80GB HBM3", "")
"""A simulated GPU of kind h100 (the kind a real H100's name gives)."""


@pytest_asyncio.fixture(scope="module")
async def stack(settings: KilnSettings) -> AsyncIterator[PoolStack]:
    async with pool_stack(settings, "kh") as s:
        await s.start_runner()
        yield s


def _request(hardware: str, devices: int = 0, **kw: Any) -> compiler_pb2.SubmitRequest:
    return compiler_pb2.SubmitRequest(
        compilation_id=kw.pop("compilation_id", f"hw-{uuid.uuid4().hex[:12]}"),
        workload=common_pb2.Workload(
            model=common_pb2.ModelSpec(name="llama-3.2-1b", config_json=MODEL.read_text()),
            traffic=common_pb2.TrafficShape(batch_size=4, context_len=256),
            hardware=common_pb2.HardwareTarget(name=hardware, num_devices=devices),
        ),
        budget=common_pb2.Budget(wall_seconds=kw.pop("wall_s", 15.0)),
        agents=["coordinate"],
        baselines=["none"],
        **kw,
    )


def _cli_env(stack: PoolStack, tmp_path: Path) -> dict[str, str]:
    """The CLI child's environment: the runner's address, the team (its certificate issued)."""
    team_tls(TEAM)
    return {
        "KILN_AGENT_RUNNER_ADDR": stack.runner_addr,
        "KILN_STATE_DIR": str(tmp_path),
        "KILN_TEAM": TEAM,
    }


async def _ended(stack: PoolStack, cid: str, timeout_s: float = 90.0) -> compiler_pb2.Compilation:
    async with stack.compiler(TEAM) as stub:
        async with asyncio.timeout(timeout_s):
            while True:
                snap = await stub.Get(compiler_pb2.GetRequest(compilation_id=cid), timeout=20)
                if snap.status in (
                    compiler_pb2.COMPILATION_STATUS_SUCCEEDED,
                    compiler_pb2.COMPILATION_STATUS_FAILED,
                    compiler_pb2.COMPILATION_STATUS_CANCELLED,
                ):
                    return snap
                await asyncio.sleep(0.5)


async def test_a_cpu_pool_told_any_hardware_serves_cpu_only(stack: PoolStack) -> None:
    pool = stack.pools["cpu-pool"]
    assert pool.app.engine_settings.hardware == "*"  # as the embedded default starts it
    assert pool.app.consumer.hardware == ["cpu"]
    assert not pool.app.consumer.serves("h100", "any-model")
    async with team_channel(pool.addr, TEAM) as ch:
        reply = await engine_pool_pb2_grpc.EnginePoolStub(ch).ListEngines(
            engine_pool_pb2.ListEnginesRequest(local_only=True), timeout=10
        )
    assert list(reply.pools[0].hardware) == ["cpu"]


async def test_submit_for_hardware_no_pool_serves_is_refused_and_records_nothing(
    stack: PoolStack,
) -> None:
    cid = f"h100-{uuid.uuid4().hex[:12]}"
    async with stack.compiler(TEAM) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Submit(_request("h100", compilation_id=cid), timeout=30)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = err.value.details() or ""
    assert "no engine pool serves hardware 'h100'" in details, details
    assert "serve cpu" in details and "cpu-pool" in details, details
    rows = await stack.ledger.query("compilations", {"team": TEAM})
    assert cid not in {r["compilation_id"] for r in rows}


async def test_the_cli_refuses_it_in_one_line(stack: PoolStack, tmp_path: Path) -> None:
    args = ["--model", str(MODEL), "--traffic", str(TRACE), "--hardware", "h100"]
    code, out = await run_command("-m", "kiln", "compile", *args, env=_cli_env(stack, tmp_path))
    assert code == 1, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in out, out
    assert lines[0].startswith("error: FAILED_PRECONDITION: no engine pool serves hardware 'h100'")


async def test_more_devices_than_the_pools_have_is_a_one_line_warning(
    stack: PoolStack, tmp_path: Path
) -> None:
    cid = f"dev-{uuid.uuid4().hex[:12]}"
    args = ["--model", str(MODEL), "--traffic", str(TRACE), "--hardware", "cpu"]
    args += ["--devices", "4", "--detach", "--id", cid, "--agent", "coordinate"]
    code, out = await run_command("-m", "kiln", "compile", *args, env=_cli_env(stack, tmp_path))
    try:
        assert code == 0, out
        warnings = [line for line in out.splitlines() if line.startswith("warning:")]
        assert len(warnings) == 1, out
        assert "num_devices is 4, but the engine pools serving cpu have 1 cpu device" in out
    finally:
        async with stack.compiler(TEAM) as stub:
            await stub.Cancel(compiler_pb2.CancelRequest(compilation_id=cid), timeout=30)


async def test_run_experiment_refuses_another_kind(stack: PoolStack) -> None:
    h100 = tiny_workload()
    h100["hardware"] = {"name": "h100", "num_devices": 1}
    request = engine_pool_pb2.RunExperimentRequest(
        experiment=common_pb2.Experiment(
            experiment_id="exp-h100-on-cpu",
            candidate=Candidate().to_proto(),
            tier=common_pb2.TIER_FAST,
            workload=ParseDict(h100, common_pb2.Workload()),
        )
    )
    addr = stack.pools["cpu-pool"].addr
    async with team_channel(addr, TEAM, tls=service_tls("agent-runner")) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await engine_pool_pb2_grpc.EnginePoolStub(ch).RunExperiment(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no 'h100' device" in (err.value.details() or "")
    # nothing ran for it (an earlier test's cancelled compilation may still finish a run here)
    runs = stack.pools["cpu-pool"].engines.runs
    assert not [r for r in runs if r.experiment_id == "exp-h100-on-cpu"], runs


async def test_a_pool_of_that_kind_serves_it_and_only_that_pool_measures(
    stack: PoolStack,
) -> None:
    gpu = await stack.add_pool("h100-pool", [H100], boost=1.3)
    async with stack.compiler(TEAM) as stub:
        reply = await stub.Submit(_request("h100", wall_s=10.0), timeout=30)
    snap = await _ended(stack, reply.compilation_id)
    assert snap.status == compiler_pb2.COMPILATION_STATUS_SUCCEEDED, snap.reason
    cid = reply.compilation_id
    on_gpu = [r for r in gpu.engines.runs if r.compilation_id == cid]
    on_cpu = [r for r in stack.pools["cpu-pool"].engines.runs if r.compilation_id == cid]
    assert on_gpu and not on_cpu
    assert {r.device for r in on_gpu} == {"cuda:0"}
    assert not any(".h100." in s for s in stack.pools["cpu-pool"].app.consumer.subjects)
    engines = set()
    async for event in stack.ledger.read_all(0, types=["ExperimentCompleted"]):
        data = json.loads(event.data)
        if data.get("compilation_id") == cid and data.get("engine_id"):
            engines.add(data["engine_id"].rsplit("/", 1)[-1])
    assert engines == {"cuda:0"}  # every measurement recorded is the h100 pool's
