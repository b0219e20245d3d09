"""The service's handle on one engine process (parent side of :mod:`kiln.engine_pool.worker`).

:class:`EngineProcess` spawns the worker (``spawn`` start method), waits for ready (the cold start)
and sends one experiment at a time without blocking the event loop. The process is the isolation
boundary: past the deadline it is SIGKILLed and restarted (TIMED_OUT); if it dies mid-experiment the
answer is CRASHED with the exit code or signal and ``engine_died`` set (the work queue runs it
again: code modules run in the sandbox, so the judge's death is the host's until it repeats) and it
is restarted; after a requested restart or a device fault (:func:`is_device_fault`) it is
restarted after the answer. Only a restart reloads weights; it spawns at once and the next
experiment waits for ready. A process may be pinned to a device (``env``, ``worker_device``;
:mod:`kiln.engine_pool.devices`). Start and restart must run on the event loop's thread (the
worker dies with its starting thread, ``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import multiprocessing
import os
import signal
import sys
import time
import types
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, Literal

import structlog

from kiln.engine_pool.worker import worker_main
from kiln.runtime.device_fault import is_device_fault
from kiln.runtime.measurement import Measurement, MemoryUsage
from kiln.runtime.request import FAILED, READY, RUN, STOP, RunRequest
from kiln.runtime.spec import EngineSpec

if TYPE_CHECKING:
    from kiln.runtime.engine import ExternalMeasure

log = structlog.get_logger("kiln.engine_pool")

EngineState = Literal["starting", "ready", "busy", "restarting", "dead"]

IPC_MARGIN_S = 1.0
"""Added to an experiment's deadline for the pipe round trip, seconds."""
POLL_SLICE_S = 0.25
"""Longest single wait on the pipe (keeps cancellation prompt), seconds."""

_TIMEOUT = object()
_EOF = object()


class EngineStartError(RuntimeError):
    """The engine could not be built; ``invalid``: the workload is at fault (unbuildable model,
    missing or mis-shaped weights), not the host.
    """

    def __init__(self, message: str, *, invalid: bool) -> None:
        super().__init__(message)
        self.message = message
        self.invalid = invalid


@contextlib.contextmanager
def _environ(env: Mapping[str, str]) -> Iterator[None]:
    """Set ``env`` in this process's environment while a child is spawned, then restore it (event
    loop's thread only).
    """
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _bare_main() -> Iterator[None]:
    """Hide ``__main__`` while spawning so the child does not re-import the parent's main module
    (and its gRPC, NATS, SQLAlchemy imports).
    """
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def describe_exit(code: int | None) -> str:
    """``exit code 3`` / ``killed by signal SIGSEGV (exit code -11)`` / ``exit code unknown``."""
    if code is None:
        return "exit code unknown"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by signal {signal.Signals(-code).name} (exit code {code})"
    return f"exit code {code}"


@dataclass
class EngineSnapshot:
    """What ListEngines reports about one engine (units: seconds, bytes).

    Attributes:
        spec_key: :attr:`EngineSpec.key`. model_key: the model's work-subject key.
        pid: the current process's id (0 when none runs).
    """

    engine_id: str
    device: str
    model_name: str
    tier: str
    state: EngineState
    memory: MemoryUsage
    experiments_run: int
    started_at: datetime | None
    cold_start_s: float
    restarts: int
    notes: list[str] = field(default_factory=list)
    spec_key: str = ""
    model_key: str = ""
    pid: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-compatible form (the registry record)."""
        out = asdict(self)
        out["started_at"] = self.started_at.isoformat() if self.started_at else None
        return out

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> EngineSnapshot:
        """Inverse of :meth:`to_dict`; unknown keys are ignored (records of newer pools).

        Raises:
            KeyError, TypeError, ValueError: not a snapshot.
        """
        known = {f.name for f in fields(EngineSnapshot)}
        values = {k: v for k, v in data.items() if k in known}
        values["memory"] = MemoryUsage(**(values.get("memory") or {}))
        started = values.get("started_at")
        values["started_at"] = datetime.fromisoformat(started) if started else None
        return EngineSnapshot(**values)


class EngineProcess:
    """One engine worker process and its pipe.

    Args:
        spec: what the worker builds. engine_id: its name in measurements and ListEngines.
        ready_timeout_s: longest build before the start fails, seconds.
        env: environment of the worker (its device pin).
        worker_device: the spec's device as the worker sees it; None = ``spec.device``.
        model_key: the model's work-subject key, for ListEngines.
        external_measure: what the worker measures baseline requests with (a module-level
            function, pickled by name into the spawned process); None: it rejects them.

    Attributes:
        lock: held by whoever runs an experiment (one at a time).
        state: starting / ready / busy / restarting / dead.
        cold_start_s, build_s: process start to ready, and the worker's build, seconds (current
            process).
        experiments_run: answers received; restarts: processes replaced (all processes of this
            engine).
        closed: stopped for good (evicted or shut down).
    """

    def __init__(
        self,
        spec: EngineSpec,
        engine_id: str,
        *,
        ready_timeout_s: float = 600.0,
        env: Mapping[str, str] | None = None,
        worker_device: str | None = None,
        model_key: str = "",
        external_measure: ExternalMeasure | None = None,
    ):
        self.spec = spec
        self.engine_id = engine_id
        self.ready_timeout_s = ready_timeout_s
        self.env = dict(env or {})
        self.worker_device = worker_device or spec.device
        self.model_key = model_key
        self.external_measure = external_measure
        self.lock = asyncio.Lock()
        self.state: EngineState = "starting"
        self.cold_start_s = 0.0
        self.build_s = 0.0
        self.info: dict[str, Any] = {}
        self.experiments_run = 0
        self.restarts = 0
        self.closed = False
        self.started_at: datetime | None = None
        self._process: BaseProcess | None = None
        self._conn: Connection | None = None
        self._ready: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Spawn the worker and begin waiting for it in the background (returns at once;
        :meth:`wait_ready` waits). Call on the event loop's thread.
        """
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        spec = {**self.spec.to_dict(), "device": self.worker_device}
        process = ctx.Process(
            target=worker_main,
            args=(child, spec, self.engine_id, self.external_measure),
            name=f"kiln-engine-{self.spec.key[:8]}",
            daemon=True,
        )
        started = time.monotonic()
        with _bare_main(), _environ(self.env):
            process.start()
        child.close()
        self._process, self._conn = process, parent
        self.started_at = datetime.now(UTC)
        self.state = "starting" if self.restarts == 0 else "restarting"
        self._ready = asyncio.get_running_loop().create_task(self._await_ready(started))
        self._ready.add_done_callback(lambda t: t.cancelled() or t.exception())
        log.info("engine.starting", engine_id=self.engine_id, pid=process.pid, env=self.env)

    async def _await_ready(self, started: float) -> None:
        msg = await self._receive(self.ready_timeout_s)
        if msg is _TIMEOUT:
            self._kill()
            self.state = "dead"
            raise EngineStartError(
                f"engine build took longer than {self.ready_timeout_s:g} s", invalid=False
            )
        if msg is _EOF:
            code = await self._exit_code()
            self.state = "dead"
            raise EngineStartError(
                f"engine process died while building: {describe_exit(code)}", invalid=False
            )
        assert isinstance(msg, dict)
        if msg.get("type") == FAILED:
            await self._exit_code()
            self.state = "dead"
            raise EngineStartError(
                f"engine build failed: {msg.get('error')}", invalid=bool(msg.get("invalid"))
            )
        if msg.get("type") != READY:
            self._kill()
            self.state = "dead"
            raise EngineStartError(f"unexpected first message {msg.get('type')!r}", invalid=False)
        self.cold_start_s = time.monotonic() - started
        self.build_s = float(msg.get("build_s", 0.0))
        self.info = msg
        self.state = "ready"
        log.info(
            "engine.ready",
            engine_id=self.engine_id,
            cold_start_s=round(self.cold_start_s, 3),
            build_s=round(self.build_s, 3),
        )

    async def wait_ready(self) -> None:
        """Wait until the current process is built.

        Raises:
            EngineStartError: the build failed, timed out, or the process died building.
        """
        if self._ready is None:
            raise EngineStartError("engine not started", invalid=False)
        await asyncio.shield(self._ready)

    @property
    def pid(self) -> int:
        """The current worker process's id; 0 when none is running."""
        process = self._process
        if process is None or process.pid is None or not process.is_alive():
            return 0
        return process.pid

    def _kill(self) -> None:
        if self._process is not None and self._process.is_alive():
            self._process.kill()

    async def _exit_code(self) -> int | None:
        if self._process is None:
            return None
        await asyncio.to_thread(self._process.join, 5.0)
        return self._process.exitcode

    async def _restart(self, why: str) -> None:
        """Kill the process (if alive), reap it, and spawn a new one (not waited for)."""
        log.warning("engine.restarting", engine_id=self.engine_id, why=why)
        if self._ready is not None and not self._ready.done():
            self._ready.cancel()
        self._kill()
        await self._exit_code()
        if self._conn is not None:
            self._conn.close()
        self.restarts += 1
        if not self.closed:
            self.start()

    async def stop(self) -> None:
        """Ask the worker to exit (SIGKILL after 2 s) and mark this engine closed."""
        self.closed = True
        self.state = "dead"
        if self._ready is not None and not self._ready.done():
            self._ready.cancel()
        if self._conn is not None:
            with contextlib.suppress(OSError, ValueError):
                self._conn.send({"type": STOP})
        if self._process is not None:
            await asyncio.to_thread(self._process.join, 2.0)
            self._kill()
            await self._exit_code()
        if self._conn is not None:
            self._conn.close()
        log.info("engine.stopped", engine_id=self.engine_id)

    def kill_now(self) -> None:
        """SIGKILL the worker without waiting (last-resort cleanup)."""
        self.closed = True
        self.state = "dead"
        self._kill()

    # ------------------------------------------------------------------ experiments
    async def _receive(self, timeout_s: float) -> object:
        """The next message, ``_TIMEOUT`` after ``timeout_s``, or ``_EOF`` if the worker died."""
        conn = self._conn
        assert conn is not None
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return _TIMEOUT
            try:
                if await asyncio.to_thread(conn.poll, min(POLL_SLICE_S, remaining)):
                    return conn.recv()
            except (EOFError, OSError):
                return _EOF

    async def run(self, request: RunRequest, deadline_s: float) -> Measurement:
        """Run one experiment; the caller holds :attr:`lock`.

        Args:
            request: the experiment (its candidate's id is reported on failures the worker cannot
                report itself).
            deadline_s: seconds the worker may take from receiving it to answering.

        Returns:
            The worker's measurement, or TIMED_OUT / CRASHED when the process did not answer.

        Raises:
            EngineStartError: the engine could not be built.
        """
        await self.wait_ready()
        request = dataclasses.replace(request, deadline_s=deadline_s)
        base = {
            "engine_id": self.engine_id,
            "tier": self.spec.tier,
            "candidate_id": request.candidate.id,
        }
        self.state = "busy"
        assert self._conn is not None
        try:
            try:
                self._conn.send({"type": RUN, "request": request.to_dict()})
                msg = await self._receive(deadline_s + IPC_MARGIN_S)
            except (BrokenPipeError, OSError):
                msg = _EOF
        except asyncio.CancelledError:
            # The answer would arrive for nobody and confuse the next run: start afresh.
            self._kill()
            with contextlib.suppress(Exception):
                await self._restart("experiment cancelled")
            raise
        if msg is _TIMEOUT:
            await self._restart("deadline passed")
            return Measurement.failed(
                "timed_out",
                f"no result within the deadline of {deadline_s:g} s; engine restarted",
                **base,
            )
        if msg is _EOF:
            code = await self._exit_code()
            await self._restart(f"process died: {describe_exit(code)}")
            return Measurement.failed(
                "crashed",
                f"engine process died: {describe_exit(code)}; engine restarted",
                engine_died=True,
                **base,
            )
        assert isinstance(msg, dict)
        self.experiments_run += 1
        measurement = Measurement.from_dict(msg["result"])
        if measurement.restart_engine:
            measurement.restart_engine = False
            await self._restart("requested by the engine")
        elif measurement.status == "crashed" and is_device_fault(measurement.error):
            measurement.notes.append("device fault: engine restarted")
            await self._restart("device fault")
        else:
            self.state = "ready"
        return measurement

    def snapshot(self) -> EngineSnapshot:
        """The engine's current state for ListEngines."""
        memory = self.info.get("memory") or {}
        return EngineSnapshot(
            engine_id=self.engine_id,
            device=self.spec.device,
            model_name=self.spec.model_name,
            tier=self.spec.tier,
            state=self.state,
            memory=MemoryUsage(**memory),
            experiments_run=self.experiments_run,
            started_at=self.started_at,
            cold_start_s=self.cold_start_s,
            restarts=self.restarts,
            notes=list(self.spec.notes),
            spec_key=self.spec.key,
            model_key=self.model_key,
            pid=self.pid,
        )
