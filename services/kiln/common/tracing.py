"""OpenTelemetry traces of kiln's services: setup, spans, and the W3C trace context carried in
gRPC metadata and NATS headers.

Tracing is off unless configured: with neither ``OTEL_EXPORTER_OTLP_ENDPOINT`` nor
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` set (nor ``OTEL_TRACES_EXPORTER`` naming an exporter),
with ``OTEL_SDK_DISABLED=true``, or without the ``tracing`` extra installed, :func:`configure`
does nothing, :func:`span` yields None without touching OpenTelemetry, and no interceptor is
added. When on, each process exports over OTLP/gRPC (the exporter reads the standard
``OTEL_EXPORTER_OTLP_*`` variables, the sampler ``OTEL_TRACES_SAMPLER``) as ``OTEL_SERVICE_NAME``
or ``kiln-<service>``. The first :func:`configure` (or :func:`install`) of a process wins.

Trace context from outside (gRPC metadata, NATS headers) is untrusted: a malformed
``traceparent`` is ignored (the span starts a new trace) and never raises. kiln's spans carry
its ids (:data:`ID_ATTRIBUTES`) and outcomes; the gRPC spans the method, status and peer
address. Neither records metadata or payloads, so no credential reaches a span.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from kiln.common.logging import get_logger

try:
    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the `tracing` extra is not installed: tracing stays off
    trace = None  # type: ignore[assignment]

log = get_logger("kiln.tracing")

TRACER_NAME = "kiln"
ID_ATTRIBUTES = ("compilation_id", "experiment_id", "tier", "candidate_id", "team", "device")
"""The only attributes :func:`span` records, each as ``kiln.<name>``."""

Kind = Literal["internal", "producer", "consumer", "server", "client"]

_provider: Any = None
"""The TracerProvider kiln's spans and interceptors use; None = tracing off."""
_PROPAGATOR: Any = TraceContextTextMapPropagator() if trace is not None else None


class TracingSettings(BaseSettings):
    """The standard OpenTelemetry variables kiln reads to decide whether tracing is on."""

    model_config = SettingsConfigDict(env_prefix="OTEL_", extra="ignore")

    exporter_otlp_endpoint: str | None = Field(None, description="OTLP collector, all signals.")
    exporter_otlp_traces_endpoint: str | None = Field(None, description="OTLP collector, traces.")
    traces_exporter: str | None = Field(None, description="otlp, console or none.")
    service_name: str | None = Field(None, description="Overrides kiln-<service>.")
    sdk_disabled: bool = Field(False, description="true: tracing off whatever else is set.")

    def exporter(self) -> str | None:
        """``"otlp"``, ``"console"`` or None (off)."""
        if self.sdk_disabled:
            return None
        named = (self.traces_exporter or "").strip().lower()
        if named in ("otlp", "console"):
            return named
        if named == "none":
            return None
        endpoint = self.exporter_otlp_endpoint or self.exporter_otlp_traces_endpoint
        return "otlp" if endpoint else None


def read_settings() -> TracingSettings:
    """:class:`TracingSettings` from the environment."""
    values: dict[str, Any] = {}
    return TracingSettings(**values)


def enabled() -> bool:
    """Whether spans are recorded in this process."""
    return _provider is not None


def configure(service: str, settings: TracingSettings | None = None) -> bool:
    """Turn tracing on for this process as ``kiln-<service>`` when the environment asks for it
    (see the module docstring); True when on. Idempotent: a process already set up keeps its
    provider. Never raises: a broken setup is logged and tracing stays off."""
    if _provider is not None:
        return True
    try:
        found = settings or read_settings()
    except ValueError as exc:  # e.g. OTEL_SDK_DISABLED=maybe
        log.warning("tracing not configured", error=str(exc).splitlines()[0])
        return False
    chosen = found.exporter()
    if chosen is None or trace is None:
        return False
    name = found.service_name or f"kiln-{service}"
    try:
        provider = _sdk_provider(name, chosen)
    except Exception as exc:  # the SDK or exporter is missing or misconfigured
        log.warning("tracing not configured", error=f"{type(exc).__name__}: {exc}")
        return False
    install(provider)
    with contextlib.suppress(Exception):  # another library set one already: keep it
        trace.set_tracer_provider(provider)
    log.info("tracing on", service_name=name, exporter=chosen)
    return True


def _sdk_provider(service_name: str, exporter: str) -> Any:
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
    if exporter == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider


def install(provider: Any) -> None:
    """Use ``provider`` (an SDK TracerProvider) for kiln's spans; None turns tracing off again
    (for tests and embedding; services call :func:`configure`)."""
    global _provider
    _provider = provider if trace is not None else None


def shutdown() -> None:
    """Flush and stop the configured provider (at process exit); tracing is off afterwards."""
    provider = _provider
    install(None)
    if provider is not None:
        with contextlib.suppress(Exception):
            provider.shutdown()


def attributes(**ids: object) -> dict[str, str]:
    """``kiln.<name>`` attributes of the ids among :data:`ID_ATTRIBUTES` that are set."""
    return {
        f"kiln.{k}": str(v) for k, v in ids.items() if k in ID_ATTRIBUTES and v not in (None, "")
    }


@contextlib.contextmanager
def span(
    name: str,
    *,
    kind: Kind = "internal",
    parent: Any = None,
    **ids: object,
) -> Iterator[Any]:
    """A span named ``name``, current while the block runs (an exception is recorded on it and
    re-raised), child of ``parent`` (a context from :func:`extract` or :func:`capture`) or of
    the current span; attributes from ``ids`` (:func:`attributes`). Yields the span, or None
    when tracing is off."""
    if _provider is None:
        yield None
        return
    tracer = _provider.get_tracer(TRACER_NAME)
    with tracer.start_as_current_span(
        name,
        context=parent,
        kind=getattr(trace.SpanKind, kind.upper()),
        attributes=attributes(**ids),
    ) as current:
        yield current


def set_attributes(current: Any, values: Mapping[str, float | int | str | bool]) -> None:
    """Set ``values`` on the span :func:`span` yielded (nothing when it yielded None)."""
    if current is not None:
        current.set_attributes(dict(values))


def capture() -> Any:
    """The current trace context, to pass as ``parent`` from a task that does not inherit it;
    None when tracing is off."""
    return otel_context.get_current() if _provider is not None else None


def inject(headers: dict[str, str]) -> dict[str, str]:
    """``headers`` with the current span's ``traceparent`` (and ``tracestate``) added; unchanged
    when tracing is off or no span is current."""
    if _provider is not None:
        _PROPAGATOR.inject(headers)
    return headers


def extract(headers: Mapping[str, Any] | None) -> Any:
    """The trace context in ``headers`` (NATS message headers), or None: tracing off, no or a
    malformed ``traceparent`` (ignored, never raises)."""
    if _provider is None or not headers:
        return None
    try:
        carrier = {
            k.lower(): v
            for k, v in headers.items()
            if isinstance(k, str) and isinstance(v, str) and k.lower() in _FIELDS
        }
        found = _PROPAGATOR.extract(carrier) if carrier else None
    except Exception:  # untrusted input: whatever it is, no parent
        return None
    if found is None or not trace.get_current_span(found).get_span_context().is_valid:
        return None
    return found


_FIELDS = ("traceparent", "tracestate")


def server_interceptors() -> list[Any]:
    """The gRPC server interceptors that record a span per call (health and reflection
    excluded) continuing the caller's trace; [] when tracing is off."""
    if _provider is None:
        return []
    try:
        from opentelemetry.instrumentation.grpc import aio_server_interceptor, filters
    except ImportError:
        return []
    return [aio_server_interceptor(tracer_provider=_provider, filter_=_kiln_methods(filters))]


def client_interceptors() -> list[Any]:
    """The gRPC client interceptors that record a span per call and send the trace context;
    [] when tracing is off."""
    if _provider is None:
        return []
    try:
        from opentelemetry.instrumentation.grpc import aio_client_interceptors, filters
    except ImportError:
        return []
    return list(aio_client_interceptors(tracer_provider=_provider, filter_=_kiln_methods(filters)))


def _kiln_methods(filters: Any) -> Any:
    """Calls of kiln's own services (not health checks or reflection)."""
    return filters.service_prefix("kiln.")
