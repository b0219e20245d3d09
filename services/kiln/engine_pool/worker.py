"""The engine process: build an :class:`~kiln.runtime.engine.Engine` once, then serve runs
from a pipe until told to stop or the parent goes away.

Started by :class:`kiln.engine_pool.process.EngineProcess` with the ``spawn`` start method, so
the process begins from a fresh interpreter: it imports torch, ``kiln.workloads`` and
``kiln.ops`` (through :mod:`kiln.runtime.engine`) and never gRPC, NATS or SQLAlchemy.
The pipe protocol is in :mod:`kiln.runtime.request`.

The process exits when:

- it receives ``{"type": "stop"}``, or the parent's end of the pipe closes (EOF);
- a measurement asks for a restart (``restart_engine``): it replies, then exits;
- on Linux, its parent dies (``PR_SET_PDEATHSIG`` = SIGKILL), even mid-experiment.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from kiln.runtime.measurement import Measurement
from kiln.runtime.request import FAILED, READY, RESULT, RUN, STOP, RunRequest
from kiln.runtime.spec import EngineSpec

if TYPE_CHECKING:
    from kiln.runtime.engine import ExternalMeasure

_PR_SET_PDEATHSIG = 1
_INVALID_BUILD_ERRORS = ("UnbuildableModelError", "UnsupportedModelError", "WeightError")
"""Build failures caused by the workload itself (reported as ``invalid``)."""
SERVICE_MODULES = ("grpc", "nats", "sqlalchemy", "psycopg")
"""Modules an engine process must not import; the ready message lists any that are loaded."""


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent exits (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def cpu_threads(setting: str, cores: int | None = None) -> int:
    """Intra-op threads of a CPU engine (``KILN_ENGINE_THREADS``): a positive number, or
    ``auto``/empty = one fewer than the host's cores (at least 1), so the services, PostgreSQL
    and NATS that share the host keep a core and do not preempt the timed steps' threads (on a
    2-core host two engine threads beside busy services made decode steps 3-6x slower and
    erratic; one thread gave stable timings).

    Raises:
        ValueError: not ``auto``, empty or a positive integer.
    """
    n = cores or os.cpu_count() or 1
    if setting.strip().lower() in ("", "auto"):
        return max(1, n - 1)
    value = int(setting)
    if value < 1:
        raise ValueError(f"KILN_ENGINE_THREADS={setting!r}: expected a positive integer or auto")
    return value


def worker_main(
    conn: Connection,
    spec: dict[str, Any],
    engine_id: str,
    external_measure: ExternalMeasure | None = None,
) -> None:
    """Entry point of the engine process.

    Args:
        conn: this process's end of the pipe.
        spec: ``EngineSpec.to_dict()``.
        engine_id: reported with every measurement.
        external_measure: what measures a request that names a baseline (a module-level
            function: it is pickled by name); None: such requests are rejected.
    """
    # Inductor compiles in this process (no worker pool in a daemonic process).
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent owns Ctrl-C; it stops us
    try:
        import torch

        from kiln.runtime.engine import Engine

        torch.set_num_threads(cpu_threads(os.environ.get("KILN_ENGINE_THREADS", "")))
        engine = Engine(EngineSpec.from_dict(spec), engine_id)
    except Exception as exc:
        conn.send(
            {
                "type": FAILED,
                "error": f"{type(exc).__name__}: {exc}",
                "invalid": type(exc).__name__ in _INVALID_BUILD_ERRORS,
            }
        )
        return
    loaded = sorted(m for m in SERVICE_MODULES if m in sys.modules)
    conn.send({"type": READY, **engine.info(), "service_modules": loaded})
    engine.prewarm()  # the sandbox for code modules starts while the first request travels
    try:
        serve(conn, engine, external_measure)
    finally:
        engine.close()


def run_request(
    engine: Any, request: RunRequest, external_measure: ExternalMeasure | None = None
) -> Measurement:
    """One request on ``engine``: when it names a baseline, ``external_measure`` through
    :meth:`kiln.runtime.engine.Engine.run_external` (REJECTED when there is none), else its
    candidate (:meth:`kiln.runtime.engine.Engine.run`)."""
    if request.baseline:
        if external_measure is None:
            return Measurement.failed(
                "rejected",
                f"baseline {request.baseline!r}: this engine measures no baselines "
                "(started without an external measure)",
                engine_id=engine.engine_id,
                tier=engine.spec.tier,
            )
        result: Measurement = engine.run_external(request, external_measure)
        return result
    measured: Measurement = engine.run(request)
    return measured


def serve(conn: Connection, engine: Any, external_measure: ExternalMeasure | None = None) -> None:
    """Answer run requests until stop, EOF, or a measurement that asks for a restart."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        kind = msg.get("type") if isinstance(msg, dict) else None
        if kind == STOP:
            return
        if kind != RUN:
            continue
        measurement = run_request(engine, RunRequest.from_dict(msg["request"]), external_measure)
        try:
            conn.send({"type": RESULT, "result": measurement.to_dict()})
        except (BrokenPipeError, OSError):
            return
        if measurement.restart_engine:
            return
        problem = engine.after_reply()
        if problem:  # the pool starts a new engine for the next request
            print(f"engine restarts: {problem}", file=sys.stderr, flush=True)
            return
