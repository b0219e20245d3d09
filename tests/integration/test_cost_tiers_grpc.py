"""The cost model's tiers 2 and 3 through real services: the ledger on PostgreSQL, NATS, an
engine pool with the CPU device (its microbenchmark responder running torch ops in its
subprocess, its engines measuring a real model) and the cost model over gRPC.

Tier 2: the first Explain of a model answers from the roofline and makes the cost model ask the
engine pool for the model's microbenchmarks; the pool times them and appends them to the
ledger; the cost model reads them back and answers from them, interpolating between measured
shapes; a restarted cost model reuses them without a new run. Tier 3: engine measurements of
the model recorded as ``ExperimentCompleted`` calibrate the decode step, with its residual.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import pytest_asyncio
from google.protobuf.json_format import ParseDict

from kiln.common import nats as kn
from kiln.common.client import team_channel
from kiln.common.microbench_wire import MicrobenchReply, microbench_subject
from kiln.common.settings import KilnSettings
from kiln.cost_model.app import CostModelApp
from kiln.cost_model.knowledge import CostSettings
from kiln.domain.candidate import REFERENCE_CANDIDATE
from kiln.engine_pool.app import EnginePoolApp
from kiln.events.microbenchmarks import PREFIX
from kiln.ledger.app import LedgerApp
from kiln.ledger.client import LedgerClient
from kiln.ledger.model import NewEvent
from kiln.v1 import (
    common_pb2,
    cost_model_pb2,
    cost_model_pb2_grpc,
    engine_pool_pb2,
    engine_pool_pb2_grpc,
)

from ..pki import service_tls
from ..unit.engine_testing import TINY_LLAMA, engine_settings
from .serving import serve_in_task

pytestmark = pytest.mark.integration

WAIT_S = 120.0


@dataclass
class Stack:
    cfg: KilnSettings
    ledger: LedgerClient
    pool: EnginePoolApp
    pool_addr: str
    cost_addr: str
    config: dict[str, Any]
    tasks: list[asyncio.Task[None]]


def _config() -> dict[str, Any]:
    """The tiny Llama with an FFN and vocabulary of this run's own (its GEMM shapes are in no
    other test's table)."""
    rng = random.Random(uuid.uuid4().int)
    return TINY_LLAMA | {
        "intermediate_size": 256 + 32 * rng.randint(1, 60),
        "vocab_size": 512 + 64 * rng.randint(1, 60),
        "num_hidden_layers": 2,
    }


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


@pytest_asyncio.fixture(scope="module")
async def stack(settings: KilnSettings) -> AsyncIterator[Stack]:
    prefix = "ct" + uuid.uuid4().hex[:10]
    cfg = settings.model_copy(
        update={"subject_prefix": prefix, "metrics_port": 0, "grace_period_s": 1.0}
    )
    ledger_task, ledger_addr = await serve_in_task(LedgerApp(cfg), cfg)
    cfg = cfg.model_copy(update={"ledger_addr": ledger_addr})
    pool = EnginePoolApp(cfg, engine_settings(max_batch=4, repeats=5))
    pool_task, pool_addr = await serve_in_task(pool, cfg)
    await asyncio.wait_for(pool.microbench.connected.wait(), 20)
    cost = CostModelApp(cfg, CostSettings(microbench=True, microbench_budget_s=20.0))
    cost_task, cost_addr = await serve_in_task(cost, cfg)
    await asyncio.wait_for(cost.knowledge.caught_up.wait(), 30)
    async with LedgerClient(ledger_addr, "reader", tls=service_tls("agent-runner")) as ledger:
        yield Stack(cfg, ledger, pool, pool_addr, cost_addr, _config(), [])
    for task in (cost_task, pool_task, ledger_task):
        await _stop(task)
    nc = await kn.connect(cfg.require_nats_url(), "test-cost-tiers")
    await kn.delete_streams(nc.jetstream(), prefix)
    await nc.close()


def _workload(config: dict[str, Any], batch: int = 1, context: int = 64) -> common_pb2.Workload:
    return common_pb2.Workload(
        model=common_pb2.ModelSpec(
            name="tiny-cost", config_json=json.dumps(config), dtype="float32"
        ),
        traffic=common_pb2.TrafficShape(
            isl_tokens=common_pb2.Distribution(p50=context),
            osl_tokens=common_pb2.Distribution(p50=4),
            batch_size=batch,
            context_len=context,
        ),
        hardware=common_pb2.HardwareTarget(name="cpu", num_devices=1),
    )


async def _explain(addr: str, config: dict[str, Any], batch: int = 1, context: int = 64) -> Any:
    async with team_channel(addr, "search") as ch:
        stub = cost_model_pb2_grpc.CostModelStub(ch)
        request = cost_model_pb2.ExplainRequest(
            workload=_workload(config, batch, context),
            plan=common_pb2.ParallelismPlan(tp=1, batch_size=batch),
        )
        return await stub.Explain(request, timeout=30)


async def _explain_until(addr: str, config: dict[str, Any], tier: str, **kw: int) -> Any:
    """Explain until TPOT comes from ``tier`` with this model's own QKV GEMM measured (not
    scaled from another model's shapes in the same device's table)."""
    async with asyncio.timeout(WAIT_S):
        while True:
            reply = await _explain(addr, config, **kw)
            qkv = _terms(reply).get("decode.op.qkv_proj_ms")
            own = qkv is not None and not qkv.source.startswith("scaled")
            if reply.plan.estimate_tier == tier and own:
                return reply
            await asyncio.sleep(0.5)


def _terms(reply: Any) -> dict[str, Any]:
    return {t.name: t for t in reply.terms}


async def _tables(ledger: LedgerClient) -> list[Any]:
    return [e async for e in ledger.read_all(types=["MicrobenchmarkMeasured"])]


def _gemm_ms(events: list[Any], m: int, n: int, k: int) -> float:
    """The newest measured time of that GEMM in the ledger's microbenchmark events."""
    found = [
        r["ms"]
        for e in events
        for r in json.loads(e.data)["results"]
        if r["op"] == "gemm" and r["dtype"] == "float32" and r["shape"] == {"m": m, "n": n, "k": k}
    ]
    assert found, f"no gemm {m}x{n}x{k} in the ledger"
    return float(found[-1])


async def test_tier2_is_measured_on_the_pool_stored_in_the_ledger_and_used(stack: Stack) -> None:
    cfg = stack.config
    first = await _explain(stack.cost_addr, cfg)  # these shapes are new: the pool is asked
    qkv = _terms(first).get("decode.op.qkv_proj_ms")
    assert qkv is None or qkv.source.startswith("scaled")  # at most another model's, scaled
    roofline_tpot = float(_terms(first)["decode.memory_time_ms"].value)
    reply = await _explain_until(stack.cost_addr, cfg, "microbenchmark")
    terms = _terms(reply)
    assert terms["tier.tpot_ms"].source == "microbenchmark"
    assert "tiers: TPOT microbenchmark, TTFT microbenchmark" in reply.text
    events = await _tables(stack.ledger)
    assert events and all(e.stream_id.startswith(PREFIX + "cpu-") for e in events)
    newest = json.loads(events[-1].data)
    assert newest["device_kind"] == "cpu" and newest["versions"]["torch"]
    assert any("CUDA-graph" in s["reason"] for s in newest["skipped"])
    # the decode step's QKV projection at batch 1 is exactly the measured GEMM, per layer
    h, d = cfg["hidden_size"], cfg["head_dim"]
    qkv_n = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * d
    measured = _gemm_ms(events, 1, qkv_n, h)
    layers = cfg["num_hidden_layers"]
    assert terms["decode.op.qkv_proj_ms"].value == pytest.approx(layers * measured)
    assert terms["decode.op.qkv_proj_ms"].source.startswith("measured")
    down = _gemm_ms(events, 1, h, cfg["intermediate_size"])
    assert terms["decode.op.mlp_down_ms"].value == pytest.approx(layers * down)
    assert terms["decode.measured_share"].value == pytest.approx(1.0)
    assert terms["decode.measured_ops_ms"].value != pytest.approx(roofline_tpot)
    assert terms["decode.kernel_overhead_ms"].source.count("measured on cpu") == 1


async def test_tier2_interpolates_between_measured_batches(stack: Stack) -> None:
    cfg = stack.config
    await _explain_until(stack.cost_addr, cfg, "microbenchmark")
    reply = await _explain(stack.cost_addr, cfg, batch=3)  # the grid measured m = 1 and 4
    term = _terms(reply)["decode.op.qkv_proj_ms"]
    assert term.source.startswith("interpolated")
    events = await _tables(stack.ledger)
    h, d = cfg["hidden_size"], cfg["head_dim"]
    n = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * d
    lo, hi = _gemm_ms(events, 1, n, h), _gemm_ms(events, 4, n, h)
    expect = cfg["num_hidden_layers"] * (lo + (hi - lo) * 2 / 3)
    assert term.value == pytest.approx(expect)


async def test_a_restarted_cost_model_reuses_the_table_from_the_ledger(stack: Stack) -> None:
    cfg = stack.config
    await _explain_until(stack.cost_addr, cfg, "microbenchmark")
    before = len(await _tables(stack.ledger))
    fresh = CostModelApp(stack.cfg, CostSettings(microbench=True, microbench_budget_s=20.0))
    task, addr = await serve_in_task(fresh, stack.cfg)
    try:
        await asyncio.wait_for(fresh.knowledge.caught_up.wait(), 30)
        reply = await _explain(addr, cfg)
        assert reply.plan.estimate_tier == "microbenchmark"  # at once: read off the ledger
        await asyncio.sleep(1.0)
        assert len(await _tables(stack.ledger)) == before  # no new run was asked for
    finally:
        await _stop(task)


async def test_a_malformed_microbenchmark_request_gets_a_reason(stack: Stack) -> None:
    nc = await kn.connect(stack.cfg.require_nats_url(), "test-cost-tiers-bad")
    try:
        subject = microbench_subject(stack.cfg.subject_prefix, "cpu")
        bad = json.dumps({"device_kind": "cpu", "gemm": [{"n": 0, "k": 4, "ms": [1]}]})
        reply = MicrobenchReply.model_validate_json(
            (await nc.request(subject, bad.encode(), 30)).data
        )
        assert not reply.ok and "gemm.0.n" in reply.error and "greater than or equal" in reply.error
        huge = json.dumps({"device_kind": "cpu", "gemm": [{"n": 1 << 20, "k": 1 << 20, "ms": [1]}]})
        reply = MicrobenchReply.model_validate_json(
            (await nc.request(subject, huge.encode(), 30)).data
        )
        assert not reply.ok and "too large" in reply.error
    finally:
        await nc.close()


async def _measure(stack: Stack, batch: int, context: int) -> common_pb2.Measurement:
    """A full-tier measurement of the reference forward by the pool's CPU engine."""
    workload = {
        "model": {"name": "tiny-cost", "config_json": json.dumps(stack.config), "dtype": "float32"},
        "traffic": {"source": "synthetic", "batch_size": batch, "context_len": context},
        "hardware": {"name": "cpu", "num_devices": 1},
    }
    experiment = common_pb2.Experiment(
        experiment_id=f"e{uuid.uuid4().hex[:12]}",
        candidate=REFERENCE_CANDIDATE.to_proto(),
        tier=common_pb2.TIER_FULL,
        agent="test",
        workload=ParseDict(workload, common_pb2.Workload()),
    )
    async with team_channel(stack.pool_addr, "search", tls=service_tls("agent-runner")) as ch:
        stub = engine_pool_pb2_grpc.EnginePoolStub(ch)
        m = await stub.RunExperiment(
            engine_pool_pb2.RunExperimentRequest(experiment=experiment), timeout=180
        )
    assert m.status == common_pb2.EXPERIMENT_STATUS_OK, m.error
    return m


async def test_tier3_calibrates_the_decode_step_against_engine_measurements(stack: Stack) -> None:
    cfg = stack.config
    base = await _explain_until(stack.cost_addr, cfg, "microbenchmark")
    assert "calibration (measured passes): none of this model" in base.text
    points = [(1, 40), (4, 40), (4, 100)]
    measured = [await _measure(stack, b, c) for b, c in points]
    cid = f"c{uuid.uuid4().hex[:12]}"
    workload = {
        "model": {"name": "tiny-cost", "config_json": json.dumps(cfg), "dtype": "float32"},
        "hardware": {"name": "cpu", "num_devices": 1},
    }
    submitted = {
        "workload_key": "wk-" + cid,
        "model_name": "tiny-cost",
        "hardware": "cpu",
        "workload": workload,
        "budget": {"wall_seconds": 60, "max_experiments": 0},
    }
    async with LedgerClient(stack.cfg.ledger_addr, "search", tls=service_tls("agent-runner")) as r:
        await r.append(f"compilation-{cid}", [NewEvent("CompilationSubmitted", submitted)])
    async with LedgerClient(stack.cfg.ledger_addr, "search", tls=service_tls("engine-pool")) as e:
        for m in measured:
            body = {
                "compilation_id": cid,
                "candidate_id": REFERENCE_CANDIDATE.id,
                "status": "ok",
                "correct": True,
                "median_ms": m.timing.median_ms,
                "tier": "full",
                "batch_size": m.batch_size,
                "context_len": m.context_len,
            }
            await e.append(
                f"experiment-e{uuid.uuid4().hex[:12]}", [NewEvent("ExperimentCompleted", body)]
            )
        # a wrong answer is no evidence, however fast
        wrong = body | {"correct": False, "status": "incorrect", "median_ms": 1e-3}
        await e.append(
            f"experiment-e{uuid.uuid4().hex[:12]}", [NewEvent("ExperimentCompleted", wrong)]
        )
    # the calibration: the geometric mean of measured over the tier-2 prediction at each point
    ratios = []
    for m in measured:
        at = _terms(await _explain(stack.cost_addr, cfg, batch=m.batch_size, context=m.context_len))
        predicted = at.get("decode.uncalibrated_ms") or at["tpot_ms"]
        ratios.append(m.timing.median_ms / predicted.value)
    factor = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    async with asyncio.timeout(WAIT_S):  # until the follower has folded all three
        while True:
            reply = await _explain(stack.cost_addr, cfg, 4, 100)
            if "from 3 measured pass(es)" in reply.text:
                break
            await asyncio.sleep(0.3)
    assert reply.plan.estimate_tier == "measured"
    terms = _terms(reply)
    assert terms["decode.calibration_factor"].value == pytest.approx(factor, rel=1e-6)
    residual = sorted(abs(factor / r - 1) for r in ratios)[1]  # |f·predicted/measured - 1|
    assert terms["decode.calibration_residual"].value == pytest.approx(residual, rel=1e-6)
    assert "3 measured pass(es)" in reply.text and "leave-one-out" in reply.text
    assert "tiers: TPOT measured, TTFT microbenchmark" in reply.text
    # at a measured point the calibrated step is the prediction times the factor (one device)
    uncal = terms["decode.uncalibrated_ms"].value
    assert terms["tpot_ms"].value == pytest.approx(uncal * factor, rel=1e-6)


async def test_a_kind_no_pool_has_stays_on_the_roofline_and_says_so(stack: Stack) -> None:
    workload = _workload(stack.config)
    workload.hardware.name = "h200"  # no engine pool of this kind: the ask goes unanswered
    async with team_channel(stack.cost_addr, "search") as ch:
        stub = cost_model_pb2_grpc.CostModelStub(ch)
        request = cost_model_pb2.ExplainRequest(
            workload=workload, plan=common_pb2.ParallelismPlan(tp=1, batch_size=1)
        )
        for _ in range(2):  # asked once in the background; answers meanwhile
            reply = await stub.Explain(request, timeout=10)
            assert reply.plan.estimate_tier == "roofline"
            assert "microbenchmarks: none measured on h200 yet" in reply.text
            assert "tiers: TPOT roofline, TTFT roofline" in reply.text
            await asyncio.sleep(0.5)
