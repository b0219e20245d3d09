"""A tiny ServiceApp for the runtime tests: real servicers with handlers that succeed, fail
in kiln's and in unexpected ways, stream, and take their time."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from kiln.common.errors import NotFound
from kiln.common.identity import current_call
from kiln.v1 import compiler_pb2, compiler_pb2_grpc, cost_model_pb2, cost_model_pb2_grpc

# PlanRequest.max_plans picks the behaviour of the test CostModel.Plan handler.
OK, NOT_FOUND, CRASH, SLOW, ABORT = 0, 1, 2, 3, 4
SLOW_S = 0.5

ECHO_SERVICE = "kiln.test.Echo"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _who() -> str:
    call = current_call()
    return f"{call.team}|{call.correlation_id or ''}"


class PlanServicer(cost_model_pb2_grpc.CostModelServicer):
    """CostModel.Plan answers with the caller's identity, or fails as the request asks."""

    def __init__(self, app: RuntimeTestApp) -> None:
        self.app = app

    async def Plan(self, request: Any, context: Any) -> cost_model_pb2.PlanResponse:
        self.app.calls += 1
        if request.max_plans == NOT_FOUND:
            raise NotFound("no such hardware: x")
        if request.max_plans == CRASH:
            raise RuntimeError("secret detail of the crash")
        if request.max_plans == ABORT:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "aborted by the handler")
        if request.max_plans == SLOW:
            self.app.slow_started.set()
            await asyncio.sleep(self.app.slow_s)
            self.app.slow_done_at = time.monotonic()
        return cost_model_pb2.PlanResponse(hardware_source=_who())


class WatchServicer(compiler_pb2_grpc.CompilerServicer):
    """Compiler.Watch streams three events naming the caller, or two and then NOT_FOUND, or
    (``follow``) one and then waits until shutdown begins."""

    def __init__(self, app: RuntimeTestApp) -> None:
        self.app = app

    async def Watch(self, request: Any, context: Any) -> AsyncIterator[Any]:
        if request.compilation_id == "follow":  # endless until the app drains
            yield compiler_pb2.CompilationEvent(position=1, compilation_id=_who())
            await self.app.draining_started.wait()
            return
        for i in range(3):
            if request.compilation_id == "fail-after-2" and i == 2:
                raise NotFound("compilation vanished")
            yield compiler_pb2.CompilationEvent(position=i + 1, compilation_id=_who())


async def _client_stream(requests: AsyncIterator[bytes], context: Any) -> bytes:
    count = 0
    async for _ in requests:
        count += 1
    return f"{_who()}|{count}".encode()


async def _bidi_stream(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
    async for request in requests:
        yield request + b"|" + _who().encode()


ECHO_HANDLER = grpc.method_handlers_generic_handler(
    ECHO_SERVICE,
    {
        "ClientStream": grpc.stream_unary_rpc_method_handler(_client_stream),
        "BidiStream": grpc.stream_stream_rpc_method_handler(_bidi_stream),
    },
)
"""Raw-bytes methods covering the two client-streaming RPC kinds."""


class RuntimeTestApp:
    """A ServiceApp hosting the test servicers; readiness is the ``ready`` attribute."""

    name = "runtime-test"
    grpc_service_names = ("kiln.v1.CostModel", "kiln.v1.Compiler", ECHO_SERVICE)

    def __init__(self, *, fail_start: bool = False, slow_s: float = SLOW_S) -> None:
        self.ready = True
        self.fail_start = fail_start
        self.slow_s = slow_s
        self.calls = 0
        self.started = False
        self.stopped_at: float | None = None
        self.slow_done_at: float | None = None
        self.slow_started = asyncio.Event()
        self.draining_started = asyncio.Event()

    async def start(self, server: grpc.aio.Server) -> None:
        self.started = True
        if self.fail_start:
            raise RuntimeError("backing server unreachable")
        cost_model_pb2_grpc.add_CostModelServicer_to_server(PlanServicer(self), server)
        compiler_pb2_grpc.add_CompilerServicer_to_server(WatchServicer(self), server)
        server.add_generic_rpc_handlers((ECHO_HANDLER,))

    async def is_ready(self) -> bool:
        return self.ready

    async def draining(self) -> None:
        self.draining_started.set()

    async def stop(self) -> None:
        self.stopped_at = time.monotonic()
