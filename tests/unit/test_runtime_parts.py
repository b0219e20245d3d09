"""The runtime's parts on their own: team identity, logging, health waiting, the app registry
and every service answering a bad request."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog

from kiln.common.apps import app_factory
from kiln.common.client import team_channel, wait_healthy
from kiln.common.errors import InvalidArgument, Unauthenticated
from kiln.common.identity import (
    CallIdentity,
    current_call,
    identity_from_metadata,
    use_call,
    validate_team,
)
from kiln.common.logging import configure_logging, get_logger
from kiln.common.server import serve
from kiln.common.settings import KilnSettings
from kiln.v1 import (
    compiler_pb2,
    compiler_pb2_grpc,
    cost_model_pb2,
    cost_model_pb2_grpc,
    engine_pool_pb2,
    engine_pool_pb2_grpc,
)

from ..pki import operator_tls
from .runtime_app import free_port


@pytest.mark.parametrize("name", ["a", "search", "ads.ranking-2", "team_7", "0x", "x" * 64])
def test_valid_team_names(name: str) -> None:
    assert validate_team(name) == name


@pytest.mark.parametrize("name", ["A", "Search", "-x", ".x", "a b", "x" * 65, "équipe", "a/b"])
def test_malformed_team_names(name: str) -> None:
    with pytest.raises(InvalidArgument, match="must match"):
        validate_team(name)


@pytest.mark.parametrize("name", ["", None])
def test_missing_team_is_unauthenticated(name: str | None) -> None:
    with pytest.raises(Unauthenticated, match="missing team identity"):
        validate_team(name)


def test_identity_from_metadata() -> None:
    md = [("kiln-team", "search"), ("kiln-correlation-id", "c1"), ("other", "x")]
    assert identity_from_metadata(md) == CallIdentity("search", "c1", None)
    with pytest.raises(InvalidArgument, match="conflicting"):
        identity_from_metadata([("kiln-team", "a"), ("kiln-team", "b")])
    with pytest.raises(InvalidArgument, match="kiln-causation-id"):
        identity_from_metadata([("kiln-team", "a"), ("kiln-causation-id", "x" * 200)])
    with pytest.raises(Unauthenticated):
        identity_from_metadata(None)


def test_current_call_only_inside_a_call() -> None:
    with pytest.raises(RuntimeError, match="outside an RPC handler"):
        current_call()
    with use_call(CallIdentity("search")):
        assert current_call().team == "search"
    with pytest.raises(RuntimeError):
        current_call()


def _json_lines(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_json_logs_carry_context_and_stdlib_records(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("info", "json", "ledger")
    with structlog.contextvars.bound_contextvars(compilation_id="cmp-1", event_id="ev-1"):
        get_logger("kiln.test").info("appended", stream="s-1")
        get_logger("kiln.test").debug("below the level")
        logging.getLogger("alembic.runtime").warning("from %s", "stdlib")
    lines = _json_lines(capsys.readouterr().err)
    assert [line["event"] for line in lines] == ["appended", "from stdlib"]
    for line in lines:
        assert line["service"] == "ledger"
        assert line["compilation_id"] == "cmp-1" and line["event_id"] == "ev-1"
        assert str(line["timestamp"]).endswith("Z")
    assert lines[0]["level"] == "info" and lines[0]["stream"] == "s-1"
    assert lines[1]["level"] == "warning" and lines[1]["logger"] == "alembic.runtime"


def test_console_logs_and_reconfiguration(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("debug", "console", "cost-model")
    get_logger("kiln.test").debug("hello console")
    configure_logging("info", "json", "cost-model")  # replaces the handler, not adds one
    get_logger("kiln.test").info("hello json")
    err = capsys.readouterr().err
    assert "hello console" in err and not _json_lines(err.split("hello console")[0])
    assert [line["event"] for line in _json_lines(err)] == ["hello json"]
    with pytest.raises(ValueError, match="unknown log level"):
        configure_logging("loud", "json", "x")


async def test_wait_healthy_times_out_naming_the_address() -> None:
    addr = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=rf"{addr}.*last status: UNAVAILABLE"):
        await wait_healthy(addr, 0.5)
    assert time.monotonic() - t0 < 2.0


def test_app_factory_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="unknown service 'nope'"):
        app_factory("nope")
    assert callable(app_factory("ledger"))  # imported lazily, only when called


async def _start_service(
    name: str, tmp_path: Path, base: KilnSettings | None = None
) -> tuple[asyncio.Task[None], str]:
    settings = (base or KilnSettings()).model_copy(
        update={"metrics_port": 0, "grace_period_s": 1.0, "state_dir": tmp_path}
    )
    app = app_factory(name)(settings)
    addr, started = f"127.0.0.1:{free_port()}", asyncio.Event()
    task = asyncio.create_task(
        serve(
            app,
            settings,
            listen=addr,
            started=started,
            handle_signals=False,
            readiness_interval_s=0.05,
        )
    )
    await asyncio.wait_for(started.wait(), 30)
    await wait_healthy(addr, 10, service=app.grpc_service_names[0])
    return task, addr


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _run_experiment(ch: grpc.aio.Channel) -> Any:
    stub = engine_pool_pb2_grpc.EnginePoolStub(ch)
    return stub.RunExperiment(engine_pool_pb2.RunExperimentRequest(), timeout=5)


def _plan(ch: grpc.aio.Channel) -> Any:
    return cost_model_pb2_grpc.CostModelStub(ch).Plan(cost_model_pb2.PlanRequest(), timeout=5)


def _submit(ch: grpc.aio.Channel) -> Any:
    return compiler_pb2_grpc.CompilerStub(ch).Submit(compiler_pb2.SubmitRequest(), timeout=5)


@pytest.mark.parametrize(
    ("name", "call", "message"),
    [  # RunExperiment is for services and operators (kiln.common.policy)
        ("engine-pool", _run_experiment, "experiment is missing"),
        ("cost-model", _plan, "config_json is empty"),
        ("agent-runner", _submit, "workload is missing"),
    ],
)
async def test_every_service_answers_an_empty_request_with_invalid_argument(
    name: str,
    call: Callable[[grpc.aio.Channel], Any],
    message: str,
    tmp_path: Path,
    settings: KilnSettings,
) -> None:
    task, addr = await _start_service(name, tmp_path, settings)
    tls = operator_tls() if name == "engine-pool" else "current"
    try:
        async with team_channel(addr, "search", tls=tls) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(ch)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in (err.value.details() or "")
    finally:
        await _stop(task)


def test_run_builds_the_app_inside_the_serving_loop(tmp_path: Path) -> None:
    """Apps create gRPC aio channels and asyncio primitives in their constructors; those bind
    to the loop running at that moment, so ``run`` must build the app inside its own loop."""
    from kiln.common.server import run

    seen: list[asyncio.AbstractEventLoop] = []

    class Halt(Exception):
        pass

    class App:
        name = "cost-model"
        grpc_service_names = ("kiln.v1.CostModel",)

        def __init__(self) -> None:
            seen.append(asyncio.get_running_loop())  # raises outside a running loop

        async def start(self, server: Any) -> None:
            assert asyncio.get_running_loop() is seen[0]
            raise Halt

        async def is_ready(self) -> bool:
            return True

        async def stop(self) -> None:
            pass

    settings = KilnSettings(
        metrics_port=0, state_dir=tmp_path, listen_addr=f"127.0.0.1:{free_port()}"
    )
    with pytest.raises(Halt):
        run(lambda _: App(), settings)  # type: ignore[arg-type,return-value]
    assert len(seen) == 1
