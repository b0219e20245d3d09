"""Prometheus metrics: the ``/metrics`` HTTP endpoint and the RPC metrics every service shares.

Other modules define their own metrics with :mod:`prometheus_client` directly (they land in the
same default registry, so the same endpoint serves them). Metric names start with ``kiln_``.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from kiln.common.settings import split_host_port

RPC_REQUESTS = Counter(
    "kiln_rpc_requests",
    "RPCs handled, by final status code.",
    ["service", "method", "code"],
)
"""``kiln_rpc_requests_total{service,method,code}``: method is the full gRPC path
(``/kiln.v1.Ledger/Append``), code the status name (``OK``, ``NOT_FOUND``, ...)."""

RPC_LATENCY = Histogram(
    "kiln_rpc_latency_seconds",
    "Time from a handler's start to its end, seconds (for streams, the whole stream).",
    ["service", "method"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
"""``kiln_rpc_latency_seconds{service,method}``."""

RPC_IN_FLIGHT = Gauge("kiln_rpc_in_flight", "RPCs being handled now.", ["service"])
"""``kiln_rpc_in_flight{service}``."""

_servers: dict[int, Any] = {}
_lock = threading.Lock()


def metrics_host(listen_addr: str) -> str:
    """The interface the metrics endpoint binds for a service listening on ``listen_addr``:
    the same host (``127.0.0.1:50051`` -> ``127.0.0.1``, ``0.0.0.0:50051`` -> ``0.0.0.0``,
    ``[::]:50051`` -> ``::``), so it is exactly as reachable as the gRPC port. Addresses without
    a TCP host (``unix:...``) or that do not parse give ``127.0.0.1``."""
    try:
        host, _port = split_host_port(listen_addr, allow_zero=True)
    except ValueError:
        return "127.0.0.1"
    return host


def start_metrics_server(port: int, addr: str = "127.0.0.1") -> int:
    """Serve the default registry at ``http://addr:port/metrics`` from a daemon thread.

    Args:
        port: TCP port; 0 disables the endpoint.
        addr: interface to bind (services pass :func:`metrics_host` of their listen address).

    Returns:
        The port bound, or 0 when disabled.

    Raises:
        OSError: the port cannot be bound (e.g. already in use).
    """
    if port == 0:
        return 0
    httpd, _thread = start_http_server(port, addr=addr)
    bound = int(httpd.server_port)
    with _lock:
        _servers[bound] = httpd
    return bound


def stop_metrics_server(port: int) -> None:
    """Stop the endpoint :func:`start_metrics_server` started on ``port`` (no-op for 0 or an
    unknown port), releasing the port."""
    with _lock:
        httpd = _servers.pop(port, None)
    if httpd is not None:
        httpd.shutdown()
        httpd.server_close()
