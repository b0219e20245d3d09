"""The engine pool's Prometheus metrics (served on the service's metrics port with the
``kiln_rpc_*`` ones of :mod:`kiln.common.metrics`).

- ``kiln_engine_experiments_total{tier, status}``: experiments this pool measured, counted
  once the ledger took its answer, by tier (fast, full) and ``ExperimentCompleted`` status (ok,
  incorrect, crashed, rejected, ...); status ``answered_elsewhere`` when the experiment already
  had its answer (the agent runner closed it, e.g. ``cancelled`` at the end of a compilation,
  or ``timed_out``), so these counts add up to the ledger's;
- ``kiln_engine_experiment_device_seconds{tier}``: engine busy time per experiment, seconds
  (the event's ``device_ms``: from the request's arrival in the engine to its answer);
- ``kiln_engine_work_queued{tier}``: messages the work subjects this pool serves hold (queued
  or in flight), as of its last scan plus publishes seen since.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

ANSWERED_ELSEWHERE = "answered_elsewhere"
"""Status label of an experiment measured here whose answer the ledger already held."""

EXPERIMENTS = Counter(
    "kiln_engine_experiments_total",
    "Experiments measured and answered by this engine pool, by tier and status.",
    ["tier", "status"],
)
EXPERIMENT_DEVICE_SECONDS = Histogram(
    "kiln_engine_experiment_device_seconds",
    "Engine busy time per experiment, seconds.",
    ["tier"],
    buckets=(0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800),
)
WORK_QUEUED = Gauge(
    "kiln_engine_work_queued",
    "Messages on the work subjects this pool serves (queued or in flight).",
    ["tier"],
)


def record_experiment(tier: str, status: str, device_ms: float) -> None:
    """Count one answered experiment and its engine busy time (``device_ms``, ms)."""
    EXPERIMENTS.labels(tier=tier, status=status).inc()
    if device_ms > 0:
        EXPERIMENT_DEVICE_SECONDS.labels(tier=tier).observe(device_ms / 1e3)
