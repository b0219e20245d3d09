"""The server interceptor of every kiln method: the caller's principal from its verified
certificate (:func:`peer_principal`), the team rule and the policy (:mod:`kiln.common.policy`)
before the handler runs, the call's identity for the handler
(:func:`kiln.common.identity.current_call`), the handler's own client identity for the calls it
makes, KilnError to gRPC status, log context and metrics. Health and reflection are not
intercepted.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from kiln.common.client import ClientIdentity, use_client_identity
from kiln.common.errors import KilnError, Unauthenticated
from kiln.common.identity import CallIdentity, Principal, identity_for, parse_principal, use_call
from kiln.common.logging import get_logger
from kiln.common.metrics import RPC_IN_FLIGHT, RPC_LATENCY, RPC_REQUESTS
from kiln.common.policy import Policy

log = get_logger("kiln.server")

_UNINTERCEPTED = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1.ServerReflection/",
    "/grpc.reflection.v1alpha.ServerReflection/",
)
"""Methods served without identity or policy (health checks, reflection v1 and v1alpha)."""


def peer_principal(context: grpc.aio.ServicerContext) -> Principal:
    """The principal of the caller's verified certificate: its one ``spiffe://kiln/`` SAN URI.

    Raises:
        Unauthenticated: no peer certificate, or not exactly one kiln SAN URI in it.
    """
    auth = context.auth_context()
    values = [*auth.get("peer_spiffe_id", ()), *auth.get("x509_subject_alternative_name", ())]
    found: set[Principal] = set()
    for raw in values:
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        try:
            found.add(parse_principal(text))
        except ValueError:
            continue
    if len(found) != 1:
        what = "no client certificate" if not auth.get("x509_pem_cert") else "a certificate"
        raise Unauthenticated(
            f"{what} naming {len(found)} kiln principals (spiffe://kiln/<kind>/<name> SAN URIs) "
            "where one is required: get credentials with `kiln credentials issue`"
        )
    return found.pop()


class _Rpc:
    """One RPC in flight: identity, policy, log context, error mapping and metrics."""

    def __init__(
        self,
        service: str,
        method: str,
        context: grpc.aio.ServicerContext,
        policy: Policy | None,
    ) -> None:
        self.service = service
        self.method = method
        self.context = context
        self.policy = policy
        self.started = time.perf_counter()
        self.code = grpc.StatusCode.OK
        self._log_tokens: dict[str, Any] = {}
        RPC_IN_FLIGHT.labels(service).inc()

    def enter(self) -> CallIdentity:
        """Verify the caller's identity, apply the policy to the method and bind the identity to
        the log context (raises KilnError). ``policy`` None: TLS off, the team header as sent."""
        principal = peer_principal(self.context) if self.policy is not None else None
        identity = identity_for(principal, self.context.invocation_metadata())
        bound: dict[str, Any] = {"team": identity.team, "method": self.method}
        if principal is not None:
            bound["principal"] = principal.uri
        if identity.correlation_id:
            bound["correlation_id"] = identity.correlation_id
        self._log_tokens = dict(structlog.contextvars.bind_contextvars(**bound))
        if self.policy is not None:
            self.policy.check_call(self.method, identity)
        return identity

    async def fail(self, exc: BaseException) -> None:
        """Turn ``exc`` into the RPC's status; always raises."""
        if isinstance(exc, asyncio.CancelledError):
            self.code = grpc.StatusCode.CANCELLED
            raise exc
        if isinstance(exc, grpc.aio.AbortError):  # the handler aborted the call itself
            self.code = _status(self.context, grpc.StatusCode.UNKNOWN)
            raise exc
        if isinstance(exc, KilnError):
            self.code = exc.code
            log.info("rpc failed", method=self.method, code=exc.code.name, error=exc.message)
            await self.context.abort(exc.code, exc.message)
        if not isinstance(exc, Exception):
            raise exc
        if isinstance(exc, NotImplementedError):  # e.g. a generated servicer's default method
            self.code = grpc.StatusCode.UNIMPLEMENTED
            await self.context.abort(self.code, f"{self.method} is not implemented")
        self.code = grpc.StatusCode.INTERNAL
        log.error("unhandled error in rpc handler", method=self.method, exc_info=exc)
        await self.context.abort(
            grpc.StatusCode.INTERNAL, f"internal error (see service log): {type(exc).__name__}"
        )

    def finish(self) -> None:
        """Record metrics and unbind the log context."""
        if self.code == grpc.StatusCode.OK:
            self.code = _status(self.context, grpc.StatusCode.OK)
        RPC_IN_FLIGHT.labels(self.service).dec()
        RPC_REQUESTS.labels(self.service, self.method, self.code.name).inc()
        RPC_LATENCY.labels(self.service, self.method).observe(time.perf_counter() - self.started)
        with contextlib.suppress(ValueError):  # an abandoned generator, finalized elsewhere
            structlog.contextvars.reset_contextvars(**self._log_tokens)


def _status(context: grpc.aio.ServicerContext, default: grpc.StatusCode) -> grpc.StatusCode:
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    if isinstance(code, int):
        return next((c for c in grpc.StatusCode if c.value[0] == code), default)
    return default


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


@dataclass(frozen=True)
class _Security:
    policy: Policy | None
    client: ClientIdentity | None

    @contextlib.contextmanager
    def calls_out(self) -> Iterator[None]:
        if self.client is None:
            yield
        else:
            with use_client_identity(self.client):
                yield


def _wrap_unary_response(
    service: str, method: str, behavior: Callable[..., Any], sec: _Security
) -> Any:
    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        rpc = _Rpc(service, method, context, sec.policy)
        try:
            with use_call(rpc.enter()), sec.calls_out():
                return await _maybe_await(behavior(request, context))
        except BaseException as exc:
            await rpc.fail(exc)
        finally:
            rpc.finish()

    return handle


def _wrap_stream_response(
    service: str, method: str, behavior: Callable[..., Any], sec: _Security
) -> Any:
    if inspect.iscoroutinefunction(behavior):  # writes with context.write() and returns None
        return _wrap_unary_response(service, method, behavior, sec)

    async def handle(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        rpc = _Rpc(service, method, context, sec.policy)
        try:
            with use_call(rpc.enter()), sec.calls_out():
                responses = behavior(request, context)
                if hasattr(responses, "__aiter__"):
                    async for response in responses:
                        yield response
                else:  # a plain generator: fine for quick ones, it runs on the event loop
                    for response in responses:
                        yield response
        except BaseException as exc:
            await rpc.fail(exc)
        finally:
            rpc.finish()

    return handle


def wrap_handler(
    handler: grpc.RpcMethodHandler,
    service: str,
    method: str,
    policy: Policy | None = None,
    client: ClientIdentity | None = None,
) -> grpc.RpcMethodHandler:
    """The same handler with kiln's identity, policy, error and metrics behaviour around it;
    the calls it makes present ``client`` (default: the context's client identity)."""
    des, ser = handler.request_deserializer, handler.response_serializer
    h: Any = handler
    sec = _Security(policy, client)
    if not handler.request_streaming and not handler.response_streaming:
        return grpc.unary_unary_rpc_method_handler(
            _wrap_unary_response(service, method, h.unary_unary, sec), des, ser
        )
    if not handler.request_streaming:
        return grpc.unary_stream_rpc_method_handler(
            _wrap_stream_response(service, method, h.unary_stream, sec), des, ser
        )
    if not handler.response_streaming:
        return grpc.stream_unary_rpc_method_handler(
            _wrap_unary_response(service, method, h.stream_unary, sec), des, ser
        )
    return grpc.stream_stream_rpc_method_handler(
        _wrap_stream_response(service, method, h.stream_stream, sec), des, ser
    )


class RuntimeInterceptor(grpc.aio.ServerInterceptor):
    """Server interceptor for every kiln method (health and reflection pass untouched).

    With a ``policy`` (TLS on): the principal comes from the client certificate
    (UNAUTHENTICATED without one kiln SAN URI), the team from it and ``kiln-team``
    (:func:`kiln.common.identity.identity_for`), and the policy must allow the method
    (PERMISSION_DENIED). Without (TLS off): ``kiln-team`` is required (UNAUTHENTICATED when
    missing, INVALID_ARGUMENT when malformed). A :class:`KilnError` becomes its status, anything
    else INTERNAL without details (logged); RPC metrics recorded. Handlers must be ``async``.
    """

    def __init__(
        self, service: str, policy: Policy | None = None, client: ClientIdentity | None = None
    ) -> None:
        self._service = service
        self._policy = policy
        self._client = client

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler: grpc.RpcMethodHandler | None = await continuation(handler_call_details)
        method = str(handler_call_details.method)
        if handler is None or method.startswith(_UNINTERCEPTED):
            return handler
        return wrap_handler(handler, self._service, method, self._policy, self._client)
