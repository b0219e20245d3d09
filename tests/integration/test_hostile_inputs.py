"""Hostile inputs against the ledger, the cost model and the Compiler API over real gRPC.

In-process servers (``kiln.common.server.serve``) on the real PostgreSQL and NATS: every input
below must get a clear status (INVALID_ARGUMENT, OUT_OF_RANGE, NOT_FOUND) with a message no longer
than :data:`kiln.common.errors.MAX_MESSAGE_CHARS`, within seconds, never INTERNAL or a hang; and
the cost model's health check must keep answering while a large plan is computed.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kiln.agent_runner.app import AgentRunnerApp
from kiln.agent_runner.config import RunnerConfig
from kiln.common.client import team_channel
from kiln.common.errors import MAX_MESSAGE_CHARS
from kiln.common.server import serve
from kiln.common.settings import KilnSettings
from kiln.cost_model.app import create_app as create_cost_model
from kiln.ledger.app import LedgerApp
from kiln.v1 import (
    common_pb2,
    compiler_pb2,
    compiler_pb2_grpc,
    cost_model_pb2,
    cost_model_pb2_grpc,
    ledger_pb2,
    ledger_pb2_grpc,
)
from tests.databases import scratch_database
from tests.pki import service_tls

MODELS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "models"

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not MODELS.is_dir(), reason="../shared/data/models is absent"),
]

TEAM = "search"
MEGABYTE = "x" * (1 << 20)
"""A 1 MB text: an error that quoted it whole would pass gRPC's metadata limit."""
ANSWER_S = 5.0
"""Each refusal must come within this (the review saw a 6-minute hang and an 11 s freeze)."""
BAD = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.PERMISSION_DENIED,
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _serve(app: Any, cfg: KilnSettings, addr: str) -> asyncio.Task[None]:
    started = asyncio.Event()
    task = asyncio.create_task(serve(app, cfg, listen=addr, started=started, handle_signals=False))
    await asyncio.wait_for(started.wait(), 20)
    return task


@dataclass
class Stubs:
    """Clients of the module's servers (asyncio stubs: typed Any, as the generated stubs'
    annotations describe the synchronous API)."""

    ledger: Any
    cost: Any
    cost_health: Any
    compiler: Any
    team_ledger: Any
    """The ledger as a team: its reads are scoped to the team's streams."""


@pytest.fixture(scope="module")
def hostile_database(postgres_server_url: str) -> Iterator[str]:
    """A database of its own: the agent runner resumes every running compilation it finds, and
    earlier modules of a full run leave some in the session's database."""
    with scratch_database(postgres_server_url) as url:
        yield url


@pytest_asyncio.fixture(scope="module")
async def stubs(settings: KilnSettings, hostile_database: str) -> AsyncIterator[Stubs]:
    prefix = f"{settings.subject_prefix}hi"
    ledger_addr, cost_addr, runner_addr = (f"127.0.0.1:{_free_port()}" for _ in range(3))
    cfg = settings.model_copy(
        update={
            "database_url": hostile_database,
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
    runner = AgentRunnerApp(cfg, RunnerConfig(resume_retry_s=0.5))
    tasks.append(await _serve(runner, cfg, runner_addr))
    await asyncio.wait_for(runner.resumed.wait(), 20)
    async with (  # the ledger's writers are services: hostile input as a (compromised) one
        team_channel(ledger_addr, TEAM, tls=service_tls("agent-runner")) as lch,
        team_channel(cost_addr, TEAM) as cch,
        team_channel(runner_addr, TEAM) as rch,
        team_channel(ledger_addr, TEAM) as tch,
    ):
        yield Stubs(
            ledger_pb2_grpc.LedgerStub(lch),
            cost_model_pb2_grpc.CostModelStub(cch),
            health_pb2_grpc.HealthStub(cch),
            compiler_pb2_grpc.CompilerStub(rch),
            ledger_pb2_grpc.LedgerStub(tch),
        )
    for task in reversed(tasks):
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _refused(
    call: Callable[[], Awaitable[Any]], codes: set[grpc.StatusCode] | grpc.StatusCode
) -> str:
    """Run ``call``; it must fail within ANSWER_S with one of ``codes`` and a bounded, non-empty
    message (returned)."""
    wanted = {codes} if isinstance(codes, grpc.StatusCode) else codes
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(call(), ANSWER_S * 4)
    took = time.monotonic() - started
    err = info.value
    details = err.details() or ""
    assert err.code() in wanted, f"{err.code()} ({details[:300]})"
    assert 0 < len(details) <= MAX_MESSAGE_CHARS, len(details)
    assert took < ANSWER_S, f"answered after {took:.1f} s"
    return details


async def _read_all(stub: Any, **fields: Any) -> list[Any]:
    return [e async for e in stub.ReadAll(ledger_pb2.ReadAllRequest(**fields), timeout=30)]


# --------------------------------------------------------------------------------------- #
# Ledger                                                                                   #
# --------------------------------------------------------------------------------------- #

OUT_OF_RANGE = grpc.StatusCode.OUT_OF_RANGE
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("position", [2**63, 2**64 - 1])
async def test_ledger_positions_beyond_bigint_are_out_of_range(stubs: Stubs, position: int) -> None:
    msg = await _refused(lambda: _read_all(stubs.ledger, after_position=position), OUT_OF_RANGE)
    assert "after_position" in msg
    read = ledger_pb2.ReadStreamRequest(stream_id="compilation-x", from_version=position)
    msg = await _refused(lambda: stubs.ledger.ReadStream(read, timeout=30), OUT_OF_RANGE)
    assert "from_version" in msg
    append = ledger_pb2.AppendRequest(
        stream_id="compilation-x",
        expected_version=ledger_pb2.ExpectedVersion(exact=position),
        events=[ledger_pb2.EventData(event_id=str(uuid.uuid4()), type="X", data=b"{}")],
    )
    msg = await _refused(lambda: stubs.ledger.Append(append, timeout=30), OUT_OF_RANGE)
    assert "expected_version" in msg
    watch = compiler_pb2.WatchRequest(compilation_id="x", after_position=position)

    async def watch_one() -> None:
        async for _ in stubs.compiler.Watch(watch, timeout=30):
            return

    await _refused(watch_one, OUT_OF_RANGE)


@pytest.mark.parametrize(
    "fields",
    [
        {"stream_prefix": "compilation-\x00"},
        {"stream_prefix": MEGABYTE},
        {"types": ["CompilationSubmitted\x00"]},
        {"types": [MEGABYTE]},
        {"types": [f"Type{i}" for i in range(100_000)]},
    ],
    ids=["prefix-nul", "prefix-1mb", "type-nul", "type-1mb", "types-100k"],
)
async def test_ledger_read_all_filters(stubs: Stubs, fields: dict[str, Any]) -> None:
    await _refused(lambda: _read_all(stubs.ledger, **fields), INVALID)


async def test_ledger_read_all_repeated_types_are_one_filter(stubs: Stubs) -> None:
    """100,000 copies of a known type are one filter (PostgreSQL takes at most 65,535 query
    parameters; the review's call failed INTERNAL)."""
    started = time.monotonic()
    events = await _read_all(stubs.ledger, types=["CompilationSubmitted"] * 100_000, max_count=5)
    assert all(e.type == "CompilationSubmitted" for e in events)
    assert time.monotonic() - started < ANSWER_S


@pytest.mark.parametrize(
    "stream_id", ["compilation-a\x00b", "compilation-" + MEGABYTE, MEGABYTE], ids=str.__len__
)
async def test_ledger_stream_ids(stubs: Stubs, stream_id: str) -> None:
    read = ledger_pb2.ReadStreamRequest(stream_id=stream_id)
    await _refused(lambda: stubs.ledger.ReadStream(read, timeout=30), INVALID)
    await _refused(lambda: stubs.team_ledger.ReadStream(read, timeout=30), INVALID)  # scoped


def _compilation_cols_query(filters: dict[str, str], **kw: Any) -> ledger_pb2.QueryRequest:
    return ledger_pb2.QueryRequest(
        projection=ledger_pb2.PROJECTION_COMPILATIONS, filter=filters, **kw
    )


@pytest.mark.parametrize(
    ("filters", "codes"),
    [
        ({"team": "a\x00b"}, INVALID),
        ({"team\x00": "a"}, INVALID),
        ({MEGABYTE: "a"}, INVALID),
        ({"team": MEGABYTE}, INVALID),
        ({"experiments_done": "9" * 30}, OUT_OF_RANGE),
        ({"experiments_done": str(2**63)}, OUT_OF_RANGE),
        ({"experiments_done": "1e400"}, INVALID),
        ({"budget_wall_seconds": "1e400"}, {INVALID, OUT_OF_RANGE}),
        ({"budget_wall_seconds": "nan"}, INVALID),
        ({"created_at": "2024-01-01T00:00:00\x00+00:00"}, INVALID),
    ],
    ids=lambda v: repr(v)[:40] if isinstance(v, dict) else "",
)
async def test_ledger_query_filters(stubs: Stubs, filters: dict[str, str], codes: Any) -> None:
    q = _compilation_cols_query(filters)
    await _refused(lambda: stubs.ledger.Query(q, timeout=30), codes)


def _token(after: list[Any], query_id: str = "") -> str:
    return base64.urlsafe_b64encode(json.dumps({"after": after, "q": query_id}).encode()).decode()


@pytest.mark.parametrize(
    "token",
    [MEGABYTE, "\x00", _token(["2024-01-01T00:00:00+00:00", "a\x00b"]), _token([MEGABYTE, "x"])],
    ids=["1mb", "nul", "nul-inside", "1mb-inside"],
)
async def test_ledger_query_page_tokens(stubs: Stubs, token: str) -> None:
    q = _compilation_cols_query({}, page_token=token)
    await _refused(lambda: stubs.ledger.Query(q, timeout=30), INVALID)


async def test_ledger_query_page_token_of_this_query_with_hostile_values(stubs: Stubs) -> None:
    """A token forged with the right query id still cannot carry NUL or out-of-range values."""
    from kiln.ledger.query import _query_id

    for after in (["2024-01-01T00:00:00+00:00", "a\x00b"], ["not a time", "a"]):
        q = _compilation_cols_query({}, page_token=_token(after, _query_id("compilations", {})))
        await _refused(partial(stubs.ledger.Query, q, timeout=30), INVALID)


def _event(**fields: Any) -> ledger_pb2.EventData:
    base: dict[str, Any] = {
        "event_id": str(uuid.uuid4()),
        "type": "CompilationCancelRequested",
        "data": json.dumps({"compilation_id": "x", "reason": "r"}).encode(),
    }
    return ledger_pb2.EventData(**(base | fields))


@pytest.mark.parametrize(
    ("stream_id", "event"),
    [
        ("compilation-x", _event(event_id=MEGABYTE)),
        ("compilation-x", _event(type=MEGABYTE)),
        ("compilation-x", _event(type="A\x00")),
        ("compilation-x", _event(data=MEGABYTE.encode())),
        ("compilation-x", _event(data=b'{"compilation_id": "x\\u0000", "reason": "r"}')),
        ("compilation-x", _event(data=b'{"compilation_id": 1e400, "reason": "r"}')),
        ("compilation-x", _event(correlation_id="a\x00b")),
        ("compilation-x", _event(correlation_id=MEGABYTE)),
        ("compilation-x", _event(causation_id="a\x00b")),
        ("compilation-x", _event(schema_version=2**32 - 1)),
        ("compilation-" + MEGABYTE, _event()),
    ],
    ids=lambda v: "" if isinstance(v, str) else None,
)
async def test_ledger_append_fields(
    stubs: Stubs, stream_id: str, event: ledger_pb2.EventData
) -> None:
    req = ledger_pb2.AppendRequest(stream_id=stream_id, events=[event])
    await _refused(lambda: stubs.ledger.Append(req, timeout=30), INVALID)


# --------------------------------------------------------------------------------------- #
# Model configs (cost model Plan and Compiler Submit)                                      #
# --------------------------------------------------------------------------------------- #


def _config(model: str = "qwen3-30b-a3b", **changes: Any) -> str:
    cfg = json.loads((MODELS / f"{model}.json").read_text())
    cfg.update(changes)
    return json.dumps(cfg)


HOSTILE_CONFIGS = {
    "layers-3e8": _config(num_hidden_layers=300_000_000),
    "layers-3e8-dense": _config("llama-3.2-1b", num_hidden_layers=300_000_000),
    "zero-heads": _config("llama-3.2-1b", num_attention_heads=0),
    "zero-kv-heads": _config("llama-3.2-1b", num_key_value_heads=0),
    "negative-hidden": _config("llama-3.2-1b", hidden_size=-4096),
    "hidden-1e400": _config("llama-3.2-1b").replace('"hidden_size": 2048', '"hidden_size": 1e400'),
    "vocab-1e400": _config("llama-3.2-1b").replace('"vocab_size": 128256', '"vocab_size": 1e400'),
    "hidden-fraction": _config("llama-3.2-1b", hidden_size=2048.5),
    "hidden-text": _config("llama-3.2-1b", hidden_size="many"),
    "hidden-true": _config("llama-3.2-1b", hidden_size=True),
    "vocab-2e9": _config("llama-3.2-1b", vocab_size=2_000_000_000),
    "experts-1e9": _config(num_experts=1_000_000_000),
    "top-k-above-experts": _config(num_experts_per_tok=1000),
    "sparse-step-0": _config(decoder_sparse_step=0),
    "mlp-only-huge": _config(mlp_only_layers=list(range(100_000))),
    "mlp-only-text": _config(mlp_only_layers="all"),
    "head-dim-1e6": _config("llama-3.2-1b", head_dim=1_000_000),
    "eps-nan": _config("llama-3.2-1b").replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": NaN'),
    "theta-negative": _config("llama-3.2-1b", rope_theta=-1.0),
    "context-1e12": _config("llama-3.2-1b", max_position_embeddings=10**12),
    "nested-deep": "[" * 100_000 + "]" * 100_000,
    "not-json-1mb": MEGABYTE,
    "type-1mb": json.dumps({"model_type": MEGABYTE}),
    "not-object": "[1, 2, 3]",
}


def _workload(config_json: str, devices: int = 1, **traffic: Any) -> common_pb2.Workload:
    shape: dict[str, Any] = {
        "isl_tokens": common_pb2.Distribution(p50=1024),
        "osl_tokens": common_pb2.Distribution(p50=128),
        "batch_size": 1,
        "context_len": 1088,
    }
    return common_pb2.Workload(
        model=common_pb2.ModelSpec(name="m", config_json=config_json),
        traffic=common_pb2.TrafficShape(**(shape | traffic)),
        hardware=common_pb2.HardwareTarget(name="h200", num_devices=devices),
    )


def _submit(workload: common_pb2.Workload, **kw: Any) -> compiler_pb2.SubmitRequest:
    return compiler_pb2.SubmitRequest(
        workload=workload, budget=common_pb2.Budget(wall_seconds=60), **kw
    )


@pytest.mark.parametrize("name", sorted(HOSTILE_CONFIGS))
async def test_hostile_model_configs(stubs: Stubs, name: str) -> None:
    wl = _workload(HOSTILE_CONFIGS[name])
    plan = cost_model_pb2.PlanRequest(workload=wl)
    await _refused(lambda: stubs.cost.Plan(plan, timeout=60), {INVALID, OUT_OF_RANGE})
    explain = cost_model_pb2.ExplainRequest(workload=wl)
    await _refused(lambda: stubs.cost.Explain(explain, timeout=60), {INVALID, OUT_OF_RANGE})
    submit = _submit(wl)
    await _refused(lambda: stubs.compiler.Submit(submit, timeout=60), {INVALID, OUT_OF_RANGE})


# --------------------------------------------------------------------------------------- #
# Devices, traffic, plans                                                                  #
# --------------------------------------------------------------------------------------- #

LLAMA = _config("llama-3.2-1b")

HOSTILE_WORKLOADS = {
    "devices-2^32-1": _workload(LLAMA, devices=2**32 - 1),
    "devices-65537": _workload(LLAMA, devices=65_537),
    "batch-2^32-1": _workload(LLAMA, batch_size=2**32 - 1),
    "context-2^32-1": _workload(LLAMA, context_len=2**32 - 1),
    "isl-1e300": _workload(LLAMA, isl_tokens=common_pb2.Distribution(p50=1e300)),
    "osl-inf": _workload(LLAMA, osl_tokens=common_pb2.Distribution(p50=float("inf"))),
    "skew-1e300": _workload(LLAMA, expert_load_skew=1e300),
    "zipf-1e300": _workload(LLAMA, expert_zipf_exponent=1e300),
    "concurrency-1e300": _workload(LLAMA, mean_concurrency=1e300),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_WORKLOADS))
async def test_hostile_workloads(stubs: Stubs, name: str) -> None:
    wl = HOSTILE_WORKLOADS[name]
    plan = cost_model_pb2.PlanRequest(workload=wl)
    await _refused(lambda: stubs.cost.Plan(plan, timeout=60), {INVALID, OUT_OF_RANGE})
    submit = _submit(wl)
    await _refused(lambda: stubs.compiler.Submit(submit, timeout=60), {INVALID, OUT_OF_RANGE})


@pytest.mark.parametrize(
    "plan",
    [
        common_pb2.ParallelismPlan(tp=2**32 - 1),
        common_pb2.ParallelismPlan(pp=2**32 - 1),
        common_pb2.ParallelismPlan(ep=2**32 - 1),
        common_pb2.ParallelismPlan(dp=2**32 - 1, dcp=2**32 - 1),
        common_pb2.ParallelismPlan(batch_size=2**32 - 1),
    ],
    ids=["tp", "pp", "ep", "dp-dcp", "batch"],
)
async def test_hostile_explain_plans(stubs: Stubs, plan: common_pb2.ParallelismPlan) -> None:
    req = cost_model_pb2.ExplainRequest(workload=_workload(LLAMA), plan=plan)
    await _refused(lambda: stubs.cost.Explain(req, timeout=60), OUT_OF_RANGE)


async def test_unknown_names_are_not_found_and_not_echoed_whole(stubs: Stubs) -> None:
    wl = _workload(LLAMA)
    wl.hardware.name = MEGABYTE
    plan = cost_model_pb2.PlanRequest(workload=wl)
    await _refused(lambda: stubs.cost.Plan(plan, timeout=30), grpc.StatusCode.NOT_FOUND)
    wl = _workload(LLAMA)
    wl.model.dtype = MEGABYTE
    plan = cost_model_pb2.PlanRequest(workload=wl)
    await _refused(lambda: stubs.cost.Plan(plan, timeout=30), INVALID)
    await _refused(lambda: stubs.compiler.Submit(_submit(wl), timeout=30), INVALID)


async def test_cost_model_health_answers_while_the_largest_plan_runs(stubs: Stubs) -> None:
    """The largest accepted request (65,536 devices, an MoE model, a big batch) answers within
    the planning deadline, and health checks answer promptly meanwhile."""
    wl = _workload(_config("qwen3-235b-a22b"), devices=65_536, batch_size=4096, context_len=8192)
    started = time.monotonic()
    plan = asyncio.ensure_future(stubs.cost.Plan(cost_model_pb2.PlanRequest(workload=wl)))
    checks: list[float] = []
    while not plan.done():
        t = time.monotonic()
        reply = await stubs.cost_health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        checks.append(time.monotonic() - t)
        await asyncio.sleep(0.05)
    took = time.monotonic() - started
    try:
        result = plan.result()
        assert len(result.plans) + len(result.pruned) > 0
    except grpc.aio.AioRpcError as err:  # planning ran out of its deadline: said so
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.code()
        assert len(err.details() or "") <= MAX_MESSAGE_CHARS
    from kiln.cost_model.service import PLAN_DEADLINE_S

    assert took < PLAN_DEADLINE_S + 5
    # Prompt, not instant: the planner's threads share the GIL with the server's loop, and CI's
    # two-core host runs two test workers (a 1.9 s outlier seen there with other load beside).
    assert checks and max(checks) < 2.5 and sorted(checks)[len(checks) // 2] < 0.5, checks


# --------------------------------------------------------------------------------------- #
# Compiler API                                                                             #
# --------------------------------------------------------------------------------------- #


@pytest.mark.parametrize("cid", [MEGABYTE, "a\x00b", "../../etc"], ids=["1mb", "nul", "path"])
async def test_compiler_ids(stubs: Stubs, cid: str) -> None:
    get = compiler_pb2.GetRequest(compilation_id=cid)
    await _refused(lambda: stubs.compiler.Get(get, timeout=30), INVALID)
    cancel = compiler_pb2.CancelRequest(compilation_id=cid)
    await _refused(lambda: stubs.compiler.Cancel(cancel, timeout=30), INVALID)
    submit = _submit(_workload(LLAMA), compilation_id=cid)
    await _refused(lambda: stubs.compiler.Submit(submit, timeout=30), INVALID)

    async def watch_one() -> None:
        async for _ in stubs.compiler.Watch(
            compiler_pb2.WatchRequest(compilation_id=cid), timeout=30
        ):
            return

    await _refused(watch_one, INVALID)


async def test_compiler_lists_and_names(stubs: Stubs) -> None:
    for req in (
        compiler_pb2.ListRequest(page_token=MEGABYTE),
        compiler_pb2.ListRequest(team=MEGABYTE),
        compiler_pb2.ListRequest(team="a\x00"),
    ):
        await _refused(partial(stubs.compiler.List, req, timeout=30), INVALID)
    for kw in (
        {"agents": [MEGABYTE]},
        {"agents": ["random"] * 100_000},
        {"baselines": [MEGABYTE]},
        {"baselines": ["a\x00"]},
    ):
        submit = _submit(_workload(LLAMA), **kw)
        await _refused(partial(stubs.compiler.Submit, submit, timeout=30), INVALID)


async def test_cancel_reason_is_bounded(stubs: Stubs) -> None:
    cancel = compiler_pb2.CancelRequest(compilation_id="no-such-one", reason=MEGABYTE)
    await _refused(lambda: stubs.compiler.Cancel(cancel, timeout=30), INVALID)
