"""Client side of the runtime: channels that present the process's certificate and carry the
team identity, and a health wait.

Which certificate a channel presents is the *client identity* of the context that creates it:
the one :func:`use_client_identity` set (the service runtime sets its service's around the app),
else the process default (:func:`set_default_client_identity`), else, on first use, the CLI's
role from the environment (``teams/<KILN_TEAM>``, or ``operators/<KILN_OPERATOR>``; see
:mod:`kiln.common.tls`). A channel's ``tls`` argument overrides all of these.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kiln.common import tracing
from kiln.common.errors import NotFound
from kiln.common.identity import (
    CORRELATION_METADATA_KEY,
    TEAM_METADATA_KEY,
    Principal,
    current_call_or_none,
    validate_team,
)
from kiln.common.settings import KilnSettings, load_settings
from kiln.common.tls import TlsMaterial, client_principal, material_for, warn_if_insecure

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


class ClientIdentity(Protocol):
    """What a process presents when it calls: the material for a channel acting for ``team``
    (None: the channel's team is unknown), or None for plaintext."""

    def material(self, team: str | None) -> TlsMaterial | None:
        """The certificate to present; raises TlsUnavailable when there is none."""
        ...


@dataclass(frozen=True)
class FixedIdentity:
    """One certificate whatever the team (a service, the CLI); None: plaintext (TLS off)."""

    tls: TlsMaterial | None

    def material(self, team: str | None) -> TlsMaterial | None:
        """``tls``, for every team."""
        return self.tls


class RoleIdentity:
    """The material of ``principal`` by ``settings`` (:func:`kiln.common.tls.material_for`),
    read on first use (so it may be issued after this is made) and kept."""

    def __init__(self, settings: KilnSettings, principal: Principal) -> None:
        self.settings = settings
        self.principal = principal
        self._found: FixedIdentity | None = None

    def material(self, team: str | None) -> TlsMaterial | None:
        """The role's material; raises TlsUnavailable (not kept) when it is missing."""
        if self._found is None:
            warn_if_insecure(self.settings, "client")
            self._found = FixedIdentity(material_for(self.settings, self.principal))
        return self._found.tls


_CURRENT: ContextVar[ClientIdentity | None] = ContextVar("kiln_client_identity", default=None)
_default: ClientIdentity | None = None


def set_default_client_identity(identity: ClientIdentity | None) -> None:
    """Make ``identity`` the process's client identity where no context sets one (None: resolve
    from the environment again on next use)."""
    global _default
    _default = identity


@contextmanager
def use_client_identity(identity: ClientIdentity) -> Iterator[ClientIdentity]:
    """Channels created in the block (and in tasks it starts) present ``identity``."""
    token = _CURRENT.set(identity)
    try:
        yield identity
    finally:
        # An abandoned async generator (a server stream) is finalized in another context.
        with suppress(ValueError):
            _CURRENT.reset(token)


def current_client_identity() -> ClientIdentity:
    """The client identity of this context (see the module docs).

    Raises:
        TlsUnavailable: resolving the CLI's role from the environment found no material.
    """
    found = _CURRENT.get() or _default
    if found is None:
        settings = load_settings()
        found = RoleIdentity(settings, client_principal(settings))
        set_default_client_identity(found)
    return found


def channel(
    addr: str,
    *,
    interceptors: list[Any] | None = None,
    tls: TlsMaterial | Literal["current"] | None = "current",
    team: str | None = None,
) -> grpc.aio.Channel:
    """A lazily connecting ``grpc.aio`` channel to ``addr`` with kiln's keepalive options,
    presenting ``tls`` ("current": the :func:`current_client_identity`'s for ``team``; None:
    plaintext); with tracing on, its calls record client spans and send the trace context
    (:mod:`kiln.common.tracing`).

    Raises:
        TlsUnavailable: no certificate for this process's role (the message names the fix).
    """
    material = current_client_identity().material(team) if tls == "current" else tls
    interceptors = [*tracing.client_interceptors(), *(interceptors or [])] or None
    if material is None:
        return grpc.aio.insecure_channel(addr, options=CHANNEL_OPTIONS, interceptors=interceptors)
    return grpc.aio.secure_channel(
        addr, material.channel_credentials(), options=CHANNEL_OPTIONS, interceptors=interceptors
    )


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


def team_channel(
    addr: str,
    team: str,
    correlation_id: str | None = None,
    *,
    tls: TlsMaterial | Literal["current"] | None = "current",
) -> grpc.aio.Channel:
    """A :func:`channel` whose every call carries ``team``; raises as :func:`team_interceptors`
    and :func:`channel`."""
    return channel(addr, interceptors=team_interceptors(team, correlation_id), tls=tls, team=team)


async def wait_healthy(
    addr: str,
    timeout_s: float,
    service: str = "",
    *,
    unknown_is_final: bool = False,
    tls: TlsMaterial | Literal["current"] | None = "current",
) -> None:
    """Poll gRPC health ``Check`` at ``addr`` until ``service`` ("" overall, "liveness",
    "readiness" or a gRPC service) is SERVING; over TLS it presents ``tls`` (see
    :func:`channel`), since every port requires a client certificate.

    Raises:
        TimeoutError: not SERVING within ``timeout_s`` (names the last status seen).
        NotFound: ``unknown_is_final`` and the server has no status for ``service``.
        TlsUnavailable: no certificate to present.
    """
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    async with channel(addr, tls=tls) as ch:
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
