"""Start-up failures and graceful shutdown of the service runtime (a server per test)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kiln.common.client import channel, team_channel, wait_healthy
from kiln.common.server import ServiceStartError, serve
from kiln.common.settings import KilnSettings
from kiln.v1 import compiler_pb2, compiler_pb2_grpc, cost_model_pb2, cost_model_pb2_grpc

from .runtime_app import SLOW, RuntimeTestApp, free_port

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def settings_for(tmp_path: Path, grace_s: float, metrics_port: int = 0) -> KilnSettings:
    return KilnSettings(metrics_port=metrics_port, grace_period_s=grace_s, state_dir=tmp_path)


async def start(
    app: RuntimeTestApp, settings: KilnSettings, *, signals: bool = False
) -> tuple[asyncio.Task[None], str]:
    addr = f"127.0.0.1:{free_port()}"
    started = asyncio.Event()
    task = asyncio.create_task(
        serve(
            app,
            settings,
            listen=addr,
            started=started,
            readiness_interval_s=0.05,
            handle_signals=signals,
        )
    )
    await asyncio.wait_for(started.wait(), 5)
    await wait_healthy(addr, 5, service="readiness")
    return task, addr


async def slow_plan(addr: str) -> str:
    async with team_channel(addr, "search") as ch:
        reply = await cost_model_pb2_grpc.CostModelStub(ch).Plan(
            cost_model_pb2.PlanRequest(max_plans=SLOW), timeout=10
        )
        return str(reply.hardware_source)


async def test_shutdown_drains_in_flight_rpc_and_goes_not_serving(tmp_path: Path) -> None:
    app = RuntimeTestApp(slow_s=0.5)
    task, addr = await start(app, settings_for(tmp_path, grace_s=5.0))
    async with channel(addr) as ch:
        watch = health_pb2_grpc.HealthStub(ch).Watch(
            health_pb2.HealthCheckRequest(service="readiness")
        )
        assert (await watch.read()).status == SERVING
        slow = asyncio.create_task(slow_plan(addr))
        await asyncio.wait_for(app.slow_started.wait(), 5)

        t0 = time.monotonic()
        task.cancel()  # what asyncio.run does on Ctrl-C; SIGTERM is tested below
        assert (await asyncio.wait_for(watch.read(), 2)).status == NOT_SERVING
        # The Watch stream then ends by itself rather than hold the drain to the grace end.
        assert await asyncio.wait_for(watch.read(), 2) is grpc.aio.EOF

        assert await asyncio.wait_for(slow, 3) == "search|"  # finished, not cut off
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 3)
    assert time.monotonic() - t0 < 3.0  # drained early, not at the 5 s grace end
    assert app.stopped_at is not None and app.slow_done_at is not None
    assert app.stopped_at >= app.slow_done_at  # app.stop() only after the drain
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await slow_plan(addr)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_draining_hook_ends_endless_streams_early(tmp_path: Path) -> None:
    app = RuntimeTestApp()
    task, addr = await start(app, settings_for(tmp_path, grace_s=5.0))
    async with team_channel(addr, "search") as ch:
        follow = compiler_pb2_grpc.CompilerStub(ch).Watch(
            compiler_pb2.WatchRequest(compilation_id="follow")
        )
        assert (await follow.read()).position == 1
        t0 = time.monotonic()
        task.cancel()
        assert await asyncio.wait_for(follow.read(), 3) is grpc.aio.EOF
        assert await follow.code() == grpc.StatusCode.OK
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 3)
    assert time.monotonic() - t0 < 3.0  # not held to the 5 s grace end


async def test_grace_period_bounds_a_slow_rpc(tmp_path: Path) -> None:
    app = RuntimeTestApp(slow_s=30.0)
    task, addr = await start(app, settings_for(tmp_path, grace_s=0.3))
    slow = asyncio.create_task(slow_plan(addr))
    await asyncio.wait_for(app.slow_started.wait(), 5)
    t0 = time.monotonic()
    task.cancel()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(slow, 5)
    assert err.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
    assert time.monotonic() - t0 < 3.0
    assert app.stopped_at is not None and app.slow_done_at is None


async def test_sigterm_stops_the_service(tmp_path: Path) -> None:
    app = RuntimeTestApp()
    task, addr = await start(app, settings_for(tmp_path, grace_s=2.0), signals=True)
    os.kill(os.getpid(), signal.SIGTERM)  # handled by serve's signal handler, not fatal
    await asyncio.wait_for(task, 5)  # returns normally
    assert app.stopped_at is not None
    with pytest.raises(TimeoutError, match=addr):
        await wait_healthy(addr, 0.3)
    # The handlers are removed again: SIGINT is Python's default once more.
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


async def test_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    app = RuntimeTestApp()
    with socket.socket() as held:
        # Held the way another grpc server holds it: with SO_REUSEPORT, which grpc also sets
        # by default and which would let a second server share the port silently.
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.bind(("127.0.0.1", 0))
        held.listen()
        addr = f"127.0.0.1:{held.getsockname()[1]}"
        with pytest.raises(ServiceStartError, match=f"cannot listen on {addr}"):
            await asyncio.wait_for(
                serve(app, settings_for(tmp_path, 1.0), listen=addr, handle_signals=False), 5
            )
    assert app.started and app.stopped_at is not None  # what start() connected is released


async def test_metrics_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    app = RuntimeTestApp()
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ServiceStartError, match=f"metrics on port {port}"):
            await asyncio.wait_for(
                serve(
                    app,
                    settings_for(tmp_path, 1.0, metrics_port=port),
                    listen=f"127.0.0.1:{free_port()}",
                    handle_signals=False,
                ),
                5,
            )
    assert not app.started


async def test_failed_start_still_stops_the_app_and_frees_the_port(tmp_path: Path) -> None:
    app = RuntimeTestApp(fail_start=True)
    addr = f"127.0.0.1:{free_port()}"
    with pytest.raises(RuntimeError, match="backing server unreachable"):
        await asyncio.wait_for(
            serve(app, settings_for(tmp_path, 1.0), listen=addr, handle_signals=False), 5
        )
    assert app.stopped_at is not None
    again = RuntimeTestApp()
    started = asyncio.Event()
    task = asyncio.create_task(
        serve(
            again, settings_for(tmp_path, 1.0), listen=addr, started=started, handle_signals=False
        )
    )
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
