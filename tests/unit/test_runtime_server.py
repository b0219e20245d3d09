"""The service runtime over real gRPC on loopback: health, reflection, identity, errors,
streaming and metrics (one server for the module)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from kiln.common.client import channel, team_channel, wait_healthy
from kiln.common.identity import TEAM_RULE, CallIdentity, use_call
from kiln.common.server import serve
from kiln.common.settings import KilnSettings
from kiln.v1 import compiler_pb2, compiler_pb2_grpc, cost_model_pb2, cost_model_pb2_grpc

from ..pki import service_tls  # the session's PKI also holds the test app's service
from .runtime_app import ABORT, CRASH, ECHO_SERVICE, NOT_FOUND, RuntimeTestApp, free_port

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
PLAN = "/kiln.v1.CostModel/Plan"


@dataclass
class Running:
    app: RuntimeTestApp
    addr: str
    metrics_port: int


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def running(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Running]:
    app = RuntimeTestApp()
    addr, metrics_port = f"127.0.0.1:{free_port()}", free_port()
    state = tmp_path_factory.mktemp("rt")
    policy = state / "policy.toml"  # the test app's own service, allowed to teams
    policy.write_text(
        f'[rpc]\n"{ECHO_SERVICE}/ClientStream" = ["team"]\n"{ECHO_SERVICE}/BidiStream" = ["team"]\n'
    )
    settings = KilnSettings(
        metrics_port=metrics_port, grace_period_s=1.0, state_dir=state, policy_file=policy
    )
    started = asyncio.Event()
    task = asyncio.create_task(
        serve(
            app,
            settings,
            listen=addr,
            started=started,
            readiness_interval_s=0.05,
            handle_signals=False,
        )
    )
    await asyncio.wait_for(started.wait(), 5)
    await wait_healthy(addr, 5)
    yield Running(app, addr, metrics_port)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def health_of(addr: str, service: str) -> int:
    async with channel(addr) as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=2
        )
        return int(reply.status)


async def until_health(addr: str, service: str, status: int, timeout_s: float = 3.0) -> None:
    async with asyncio.timeout(timeout_s):
        while True:
            if await health_of(addr, service) == status:
                return
            await asyncio.sleep(0.02)


async def plan(addr: str, behaviour: int, team: str = "search", **kw: str) -> str:
    async with team_channel(addr, team, **kw) as ch:
        reply = await cost_model_pb2_grpc.CostModelStub(ch).Plan(
            cost_model_pb2.PlanRequest(max_plans=behaviour), timeout=5
        )
        return str(reply.hardware_source)


async def test_liveness_is_serving(running: Running) -> None:
    assert await health_of(running.addr, "liveness") == SERVING


async def test_readiness_follows_is_ready(running: Running) -> None:
    readiness_names = ["", "readiness", "kiln.v1.CostModel", "kiln.v1.Compiler"]
    try:
        running.app.ready = False
        for name in readiness_names:
            await until_health(running.addr, name, NOT_SERVING)
        assert await health_of(running.addr, "liveness") == SERVING
        running.app.ready = True
        for name in readiness_names:
            await until_health(running.addr, name, SERVING)
    finally:
        running.app.ready = True


async def test_reflection_lists_services(running: Running) -> None:
    async with channel(running.addr) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        replies = [r async for r in stub.ServerReflectionInfo(iter([request]), timeout=5)]
    names = {s.name for s in replies[0].list_services_response.service}
    assert {"kiln.v1.CostModel", "kiln.v1.Compiler", "grpc.health.v1.Health"} <= names
    assert "grpc.reflection.v1alpha.ServerReflection" in names


async def test_service_call_without_team_is_unauthenticated(running: Running) -> None:
    calls_before = running.app.calls
    async with channel(running.addr, tls=service_tls("agent-runner")) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await cost_model_pb2_grpc.CostModelStub(ch).Plan(cost_model_pb2.PlanRequest())
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert err.value.details() == (
        "service principal spiffe://kiln/service/agent-runner must name the team it acts for "
        "in gRPC metadata 'kiln-team'"
    )
    assert running.app.calls == calls_before  # the handler never ran


async def test_a_team_certificate_names_the_team(running: Running) -> None:
    async with channel(running.addr, team="search") as ch:  # search's certificate, no header
        reply = await cost_model_pb2_grpc.CostModelStub(ch).Plan(cost_model_pb2.PlanRequest())
    assert reply.hardware_source == "search|"


async def test_malformed_team_is_invalid_argument(running: Running) -> None:
    async with channel(running.addr, tls=service_tls("agent-runner")) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await cost_model_pb2_grpc.CostModelStub(ch).Plan(
                cost_model_pb2.PlanRequest(), metadata=(("kiln-team", "Search Team!"),)
            )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert TEAM_RULE in (err.value.details() or "")


async def test_kiln_error_becomes_its_status(running: Running) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await plan(running.addr, NOT_FOUND)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert err.value.details() == "no such hardware: x"


async def test_handler_abort_passes_through(running: Running) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await plan(running.addr, ABORT)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.details() == "aborted by the handler"


async def test_unexpected_error_is_internal_without_traceback(
    running: Running, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await plan(running.addr, CRASH, team="infra")
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert err.value.details() == "internal error (see service log): RuntimeError"
    # The traceback goes to the service log, as JSON carrying the caller's identity.
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line]
    crash = next(line for line in lines if line["event"] == "unhandled error in rpc handler")
    assert crash["team"] == "infra" and crash["method"] == PLAN
    assert crash["service"] == "runtime-test" and crash["level"] == "error"
    assert crash["exception"][0]["exc_value"] == "secret detail of the crash"


async def test_unary_handler_sees_team_and_correlation(running: Running) -> None:
    assert await plan(running.addr, 0, team="search", correlation_id="corr-7") == "search|corr-7"
    assert await plan(running.addr, 0, team="ads.ranking") == "ads.ranking|"


async def test_calls_made_while_handling_a_call_forward_its_correlation_id(
    running: Running,
) -> None:
    with use_call(CallIdentity(team="agents", correlation_id="outer-1")):
        assert await plan(running.addr, 0, team="search") == "search|outer-1"


async def test_server_stream_handler_sees_team(running: Running) -> None:
    async with team_channel(running.addr, "search", correlation_id="c-9") as ch:
        stub = compiler_pb2_grpc.CompilerStub(ch)
        events = [e async for e in stub.Watch(compiler_pb2.WatchRequest(), timeout=5)]
    assert [e.position for e in events] == [1, 2, 3]
    assert {e.compilation_id for e in events} == {"search|c-9"}


async def test_server_stream_error_after_some_messages(running: Running) -> None:
    got: list[int] = []
    async with team_channel(running.addr, "search") as ch:
        call = compiler_pb2_grpc.CompilerStub(ch).Watch(
            compiler_pb2.WatchRequest(compilation_id="fail-after-2"), timeout=5
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for event in call:
                got.append(event.position)
    assert got == [1, 2]
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert err.value.details() == "compilation vanished"


async def test_client_streaming_kinds_carry_team(running: Running) -> None:
    async def three() -> AsyncIterator[bytes]:
        for _ in range(3):
            yield b"m"

    async with team_channel(running.addr, "search", correlation_id="c1") as ch:
        summed = await ch.stream_unary(f"/{ECHO_SERVICE}/ClientStream")(three(), timeout=5)
        echoed = [m async for m in ch.stream_stream(f"/{ECHO_SERVICE}/BidiStream")(three())]
    assert summed == b"search|c1|3"
    assert echoed == [b"m|search|c1"] * 3


async def test_unimplemented_default_method_is_unimplemented(running: Running) -> None:
    async with team_channel(running.addr, "search") as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await compiler_pb2_grpc.CompilerStub(ch).Get(compiler_pb2.GetRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def _requests_total(port: int) -> dict[tuple[str, str], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    counts: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kiln_rpc_requests_total":
                if sample.labels["service"] == "runtime-test":
                    counts[(sample.labels["method"], sample.labels["code"])] = sample.value
    return counts


async def test_metrics_count_calls_by_method_and_code(running: Running) -> None:
    before = await asyncio.to_thread(_requests_total, running.metrics_port)
    await plan(running.addr, 0)
    with pytest.raises(grpc.aio.AioRpcError):
        await plan(running.addr, NOT_FOUND)
    with pytest.raises(grpc.aio.AioRpcError):
        await plan(running.addr, ABORT)
    async with channel(running.addr, tls=service_tls("agent-runner")) as ch:  # no team
        with pytest.raises(grpc.aio.AioRpcError):
            await cost_model_pb2_grpc.CostModelStub(ch).Plan(cost_model_pb2.PlanRequest())
    after = await asyncio.to_thread(_requests_total, running.metrics_port)

    def delta(code: str) -> float:
        return after.get((PLAN, code), 0) - before.get((PLAN, code), 0)

    codes = ("OK", "NOT_FOUND", "FAILED_PRECONDITION", "UNAUTHENTICATED")
    assert [delta(code) for code in codes] == [1, 1, 1, 1]
    assert not any(method.startswith("/grpc.health") for method, _ in after)
