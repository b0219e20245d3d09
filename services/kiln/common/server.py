"""The gRPC service runtime every kiln service runs in: :func:`serve` hosts a :class:`ServiceApp`
with health (``"liveness"`` SERVING while the process runs; ``""``, ``"readiness"`` and the app's
services follow ``app.is_ready()``), reflection (v1 and v1alpha, :mod:`kiln.common.reflection`),
:class:`RuntimeInterceptor` on every kiln method, a Prometheus endpoint and graceful shutdown.

Every port serves TLS requiring a client certificate of the deployment's CA (the handshake
refuses any other), the service presenting ``services/<name>`` (:mod:`kiln.common.tls`); the
calls the app makes present the same identity. The interceptor takes the caller's principal from
its certificate and applies the policy (:mod:`kiln.common.policy`) before the handler runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, cast, runtime_checkable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio  # type: ignore[attr-defined]

from kiln.common import tracing
from kiln.common.client import (
    FixedIdentity,
    set_default_client_identity,
    use_client_identity,
)
from kiln.common.identity import Principal
from kiln.common.interceptor import RuntimeInterceptor
from kiln.common.logging import configure_logging, get_logger
from kiln.common.metrics import (
    metrics_host,
    start_metrics_server,
    stop_metrics_server,
)
from kiln.common.policy import Policy, PolicyError, policy_for
from kiln.common.reflection import enable_server_reflection
from kiln.common.settings import KilnSettings, ServiceName
from kiln.common.tls import TlsMaterial, TlsUnavailable, material_for, warn_if_insecure

log = get_logger("kiln.server")

LIVENESS = "liveness"
READINESS = "readiness"
HEALTH_SERVICE_NAME: str = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name

SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    # grpc enables SO_REUSEPORT by default, which lets a second server "bind" a port in use
    # and silently share its traffic; kiln wants the bind to fail instead.
    ("grpc.so_reuseport", 0),
    # Accept the clients' keepalive pings (kiln.common.client pings every 30 s).
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
)


@runtime_checkable
class ServiceApp(Protocol):
    """What a service plugs into :func:`serve`. An optional ``async def draining(self)`` runs
    when shutdown begins, before in-flight RPCs drain: end endless server streams there.
    """

    @property
    def name(self) -> str:
        """The service name: "ledger", "engine-pool", "agent-runner" or "cost-model"."""

    @property
    def grpc_service_names(self) -> Sequence[str]:
        """Full names of the gRPC services it adds, e.g. ``["kiln.v1.Ledger"]``."""

    async def start(self, server: grpc.aio.Server) -> None:
        """Add servicers, connect backing servers, start background tasks (before listening)."""

    async def is_ready(self) -> bool:
        """Readiness: True when calls can be served (backing servers reachable, ...)."""

    async def stop(self) -> None:
        """Stop background tasks and close connections; also called after a failed (partial)
        ``start``.
        """


class ServiceStartError(RuntimeError):
    """The service could not start (address or metrics port unavailable)."""


# --------------------------------------------------------------------------------------- #
# serve                                                                                    #
# --------------------------------------------------------------------------------------- #


_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthServicer(health_aio.HealthServicer):
    """grpcio-health-checking's asyncio servicer whose ``Watch`` streams end (after NOT_SERVING)
    once graceful shutdown begins.
    """

    def __init__(self) -> None:
        super().__init__()
        self._closing = asyncio.Event()

    async def Watch(self, request: Any, context: Any) -> None:
        """Stream status changes of one service until shutdown or until the client leaves."""
        watch = asyncio.ensure_future(super().Watch(request, context))
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            await asyncio.wait({watch, closing}, return_when=asyncio.FIRST_COMPLETED)
            if not watch.done():  # shutting down: let it send NOT_SERVING, then end the stream
                await asyncio.wait({watch}, timeout=0.2)
        finally:
            for task in (watch, closing):
                task.cancel()
            outcome = await asyncio.gather(watch, closing, return_exceptions=True)
        if isinstance(outcome[0], Exception):
            raise outcome[0]

    async def enter_graceful_shutdown(self) -> None:
        """Set every status NOT_SERVING for good and end the Watch streams."""
        await super().enter_graceful_shutdown()
        self._closing.set()


async def _set_readiness(health: HealthServicer, app: ServiceApp, status: Any) -> None:
    for name in ("", READINESS, *app.grpc_service_names):
        await health.set(name, status)


async def _poll_readiness(health: HealthServicer, app: ServiceApp, interval_s: float) -> None:
    """Keep the readiness statuses equal to ``app.is_ready()``, checked every ``interval_s``."""
    last: bool | None = None
    while True:
        try:
            ready = bool(await asyncio.wait_for(app.is_ready(), timeout=max(interval_s, 5.0)))
            reason = None
        except Exception as exc:
            ready, reason = False, f"{type(exc).__name__}: {exc}"
        if ready != last:
            await _set_readiness(health, app, _SERVING if ready else _NOT_SERVING)
            log.info("readiness changed", ready=ready, reason=reason)
            last = ready
        await asyncio.sleep(interval_s)


def _bind(
    server: grpc.aio.Server, address: str, service: str, tls: TlsMaterial | None = None
) -> str:
    try:
        if tls is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, tls.server_credentials())
    except RuntimeError as exc:
        port, cause = 0, str(exc)
    else:
        cause = "bind returned port 0"
    if not port:
        raise ServiceStartError(
            f"{service}: cannot listen on {address}: the port is in use or the address is not "
            f"available here (set KILN_LISTEN_ADDR or --listen to another one) [{cause}]"
        )
    host = address.rsplit(":", 1)[0]
    return f"{host}:{port}"


def _start_metrics(port: int, host: str, service: str) -> int:
    try:
        return start_metrics_server(port, host)
    except OSError as exc:
        raise ServiceStartError(
            f"{service}: cannot serve metrics on port {port} of {host}: {exc} "
            "(set KILN_METRICS_PORT to another port, or 0 to turn the endpoint off)"
        ) from exc


@contextlib.contextmanager
def _signals_set(event: asyncio.Event, enabled: bool) -> Iterator[None]:
    """While in the block, SIGTERM and SIGINT set ``event`` (main thread only)."""
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []

    def on_signal(sig: signal.Signals) -> None:
        if event.is_set():
            log.warning("shutdown already in progress", signal=sig.name)
        else:
            log.info("signal received", signal=sig.name)
        event.set()

    if enabled:
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, on_signal, sig)
                installed.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
                pass
    try:
        yield
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


async def serve(
    app: ServiceApp,
    settings: KilnSettings,
    *,
    listen: str | None = None,
    started: asyncio.Event | None = None,
    readiness_interval_s: float = 1.0,
    handle_signals: bool = True,
) -> None:
    """Run ``app`` until SIGTERM/SIGINT (returns) or cancellation (re-raises after shutting
    down).

    Shutdown: every health status NOT_SERVING, ``app.draining()`` if defined,
    ``server.stop(grace_period_s)``, then ``app.stop()``. ``listen`` defaults to
    ``settings.listen_addr``, else the service's address; ``started`` is set once calls are
    accepted.

    Raises:
        ServiceStartError: the address or the metrics port cannot be bound, TLS is on and the
            service has no certificate, or the policy file is invalid.
        Exception: whatever ``app.start`` raises (``app.stop`` is still called).
    """
    configure_logging(settings.log_level, settings.log_format, app.name)
    tracing.configure(app.name)  # off unless OTEL_* asks for it
    tls, policy = _security(app.name, settings)
    with use_client_identity(FixedIdentity(tls)):  # the app's own calls present its identity
        await _serve(
            app, settings, tls, policy, listen, started, readiness_interval_s, handle_signals
        )


def _security(service: str, settings: KilnSettings) -> tuple[TlsMaterial | None, Policy | None]:
    """The service's certificate and the policy; (None, None) with TLS off (warned).

    Raises:
        ServiceStartError: TLS on and no certificate, or an invalid policy file (one line).
    """
    warn_if_insecure(settings, service)
    try:
        tls = material_for(settings, Principal("service", service))
        policy = policy_for(settings) if tls is not None else None
    except (TlsUnavailable, PolicyError) as exc:
        message = exc.message if isinstance(exc, TlsUnavailable) else str(exc)
        raise ServiceStartError(f"{service}: {message}") from None
    return tls, policy


async def _serve(
    app: ServiceApp,
    settings: KilnSettings,
    tls: TlsMaterial | None,
    policy: Policy | None,
    listen: str | None,
    started: asyncio.Event | None,
    readiness_interval_s: float,
    handle_signals: bool,
) -> None:
    interceptor = RuntimeInterceptor(app.name, policy, FixedIdentity(tls))
    server = grpc.aio.server(
        interceptors=[*tracing.server_interceptors(), interceptor], options=SERVER_OPTIONS
    )
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    enable_server_reflection((HEALTH_SERVICE_NAME, *app.grpc_service_names), server)  # v1, v1alpha
    await health.set(LIVENESS, _SERVING)
    await _set_readiness(health, app, _NOT_SERVING)

    name = cast(ServiceName, app.name)
    address = listen or settings.listen_addr or settings.service_addr(name)
    metrics_port = _start_metrics(
        settings.service_metrics_port(name), metrics_host(address), app.name
    )  # on the gRPC address's host: a loopback service keeps its metrics on loopback too
    stop = asyncio.Event()
    poller: asyncio.Task[None] | None = None
    with _signals_set(stop, handle_signals):
        try:
            await app.start(server)
            # Bind only now: a grpc server that bound a port but never started cannot release
            # it (stop() is a no-op), so a failed app.start() would hold the port until exit.
            address = _bind(server, address, app.name, tls)
            await server.start()
            poller = asyncio.create_task(
                _poll_readiness(health, app, readiness_interval_s), name="kiln-readiness"
            )
            if started is not None:
                started.set()
            log.info(
                "service started",
                address=address,
                metrics_port=metrics_port,
                tls=tls is not None,
                principal=None if tls is None else tls.principal.uri,
            )
            await stop.wait()
            log.info("shutting down", grace_period_s=settings.grace_period_s)
        finally:
            await _shut_down(app, server, health, settings.grace_period_s, poller)
            stop_metrics_server(metrics_port)
            log.info("service stopped")


async def _shut_down(
    app: ServiceApp,
    server: grpc.aio.Server,
    health: HealthServicer,
    grace_s: float,
    poller: asyncio.Task[None] | None,
) -> None:
    if poller is not None:
        poller.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await poller
    await health.enter_graceful_shutdown()
    draining = getattr(app, "draining", None)
    if draining is not None:
        try:
            await draining()
        except Exception:
            log.exception("app.draining() failed; draining anyway")
    try:
        await server.stop(grace_s)
    finally:
        await app.stop()


def run(app_factory: Callable[[KilnSettings], ServiceApp], settings: KilnSettings) -> None:
    """Build the app inside the event loop that serves it and serve it until SIGTERM/SIGINT
    (CLI).
    """

    async def main() -> None:
        app = app_factory(settings)
        tls, _ = _security(app.name, settings)
        set_default_client_identity(FixedIdentity(tls))  # work outside serve's context too
        await serve(app, settings)

    asyncio.run(main())
