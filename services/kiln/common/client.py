"""Client side of the runtime: channels that carry the team identity, and a health wait."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kiln.common.errors import NotFound
from kiln.common.identity import (
    CORRELATION_METADATA_KEY,
    TEAM_METADATA_KEY,
    current_call_or_none,
    validate_team,
)

CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    # Ping an idle connection every 30 s so long server streams (Watch, ReadAll follow)
    # notice a dead peer within ~40 s and are not cut by NAT/proxy idle timeouts.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
)
"""Options of every kiln channel (the server permits these pings: kiln.common.server)."""


def channel(addr: str, *, interceptors: list[Any] | None = None) -> grpc.aio.Channel:
    """A lazily connecting insecure ``grpc.aio`` channel to ``addr`` with kiln's keepalive
    options.
    """
    return grpc.aio.insecure_channel(addr, options=CHANNEL_OPTIONS, interceptors=interceptors)


class _TeamMetadata:
    """Adds ``kiln-team`` and the correlation id (the current RPC's unless fixed) to a call's
    metadata; explicit metadata wins.
    """

    def __init__(self, team: str, correlation_id: str | None = None) -> None:
        self._team = validate_team(team)
        self._correlation_id = correlation_id

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        if TEAM_METADATA_KEY not in metadata:
            metadata.add(TEAM_METADATA_KEY, self._team)
        correlation = self._correlation_id
        if correlation is None:
            outer = current_call_or_none()
            correlation = outer.correlation_id if outer else None
        if correlation and CORRELATION_METADATA_KEY not in metadata:
            metadata.add(CORRELATION_METADATA_KEY, correlation)
        return grpc.aio.ClientCallDetails(
            method=details.method,
            timeout=details.timeout,
            metadata=metadata,
            credentials=details.credentials,
            wait_for_ready=details.wait_for_ready,
        )


# grpc.aio files each interceptor under the FIRST of the four kinds it is an instance of
# (an if/elif chain in grpc/aio/_channel.py), so one class implementing all four would only
# ever see unary-unary calls: one class per kind it is.


class _UnaryUnary(_TeamMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(
        self, continuation: Any, client_call_details: Any, request: Any
    ) -> Any:
        return await continuation(self._details(client_call_details), request)


class _UnaryStream(_TeamMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(
        self, continuation: Any, client_call_details: Any, request: Any
    ) -> Any:
        return await continuation(self._details(client_call_details), request)


class _StreamUnary(_TeamMetadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(
        self, continuation: Any, client_call_details: Any, request_iterator: Any
    ) -> Any:
        return await continuation(self._details(client_call_details), request_iterator)


class _StreamStream(_TeamMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(
        self, continuation: Any, client_call_details: Any, request_iterator: Any
    ) -> Any:
        return await continuation(self._details(client_call_details), request_iterator)


def team_interceptors(team: str, correlation_id: str | None = None) -> list[Any]:
    """Client interceptors adding ``kiln-team`` and the correlation id to every call.
    Unauthenticated for an empty team, InvalidArgument for an invalid one.
    """
    kinds = (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)
    return [kind(team, correlation_id) for kind in kinds]


def team_channel(addr: str, team: str, correlation_id: str | None = None) -> grpc.aio.Channel:
    """A :func:`channel` whose every call carries ``team``; raises as :func:`team_interceptors`."""
    return channel(addr, interceptors=team_interceptors(team, correlation_id))


async def wait_healthy(
    addr: str, timeout_s: float, service: str = "", *, unknown_is_final: bool = False
) -> None:
    """Poll gRPC health ``Check`` at ``addr`` until ``service`` ("" overall, "liveness",
    "readiness" or a gRPC service) is SERVING.

    Raises:
        TimeoutError: not SERVING within ``timeout_s`` (names the last status seen).
        NotFound: ``unknown_is_final`` and the server has no status for ``service``.
    """
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    async with channel(addr) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"{addr} is not healthy (health service {service!r}) after {timeout_s:g} s; "
                    f"last status: {last}"
                )
            try:
                reply = await stub.Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=min(remaining, 1.0)
                )
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.aio.AioRpcError as err:
                if unknown_is_final and err.code() == grpc.StatusCode.NOT_FOUND:
                    raise NotFound(f"no health status for service {service!r} at {addr}") from None
                details = (err.details() or "").strip()
                last = err.code().name + (f": {details}" if details else "")
            await asyncio.sleep(min(0.1, max(deadline - time.monotonic(), 0)))
