"""The judge's side of the process split (rationale: docs/design/engine.md, "Sandbox"): the
sandbox process's lifecycle (:class:`SandboxHost`); the stand-in the gate drives instead of an
in-process model is :class:`~kiln.runtime.sandbox.model.SandboxModel`.

The judge keeps the reference, the inputs and their seed, the choice of verified steps, the
comparison, the tolerances and the timer; the sandbox gets one call's inputs at a time and
answers through the shared output buffer. Every wait on the sandbox has the experiment's
deadline; a sandbox that dies or misses it makes the experiment CRASHED or TIMED_OUT
(:class:`SandboxFailure`) and is replaced, never the engine.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Literal

import torch

from kiln.runtime.check import NotPlainTensor
from kiln.runtime.sandbox import processes, tensors, wire
from kiln.runtime.sandbox.confine import sandbox_environment
from kiln.runtime.sandbox.memory import SharedBuffer, SharedWeights, written_kib
from kiln.runtime.sandbox.server import BOOT
from kiln.runtime.sandbox.user import SandboxUser, host_user
from kiln.runtime.spec import EngineSpec
from kiln.runtime.transforms import RejectedCandidate

Tensor = torch.Tensor

READY_TIMEOUT_S = 300.0
"""Longest a sandbox may take to start (import torch, map the weights, warm up), seconds."""
CALL_TIMEOUT_S = 600.0
"""Longest wait on one call when the experiment has no deadline, seconds."""
DISCARD_WAIT_S = 5.0
"""Longest wait for a killed sandbox's processes to be gone, seconds."""
CALIBRATION_CALLS = 30
"""Empty round trips timed when a sandbox starts (their median is subtracted from timed steps)."""


class SandboxFailure(Exception):
    """The sandbox did not answer: ``status`` ``crashed`` (it died; the message says how) or
    ``timed_out`` (the deadline passed; it was killed). It is replaced either way."""

    def __init__(self, status: Literal["crashed", "timed_out"], message: str) -> None:
        super().__init__(message)
        self.status: Literal["crashed", "timed_out"] = status
        self.message = message


class CandidateRaised(Exception):
    """The candidate's code raised in the sandbox; the message is its exception and traceback,
    ``phase`` the gate's phase it raised in when the sandbox says (loading: ``load``, ``bind``)."""

    def __init__(self, message: str, phase: str = "") -> None:
        super().__init__(message)
        self.phase = phase


def describe_exit(code: int | None) -> str:
    """``exit code 3`` / ``killed by signal SIGSEGV (exit code -11)`` / ``exit code unknown``."""
    if code is None:
        return "exit code unknown"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by signal {signal.Signals(-code).name} (exit code {code})"
    return f"exit code {code}"


def output_bytes(spec: EngineSpec, vocab: int) -> int:
    """The shared output buffer's size: the largest logits a call returns (float32 ``[max(batch,
    check_batch), vocab]``); larger outputs come back inline."""
    return max(spec.batch_size, spec.check_batch) * vocab * 4


@dataclass
class _Process:
    popen: subprocess.Popen[bytes]
    sock: socket.socket
    pid: int = 0
    """The server's pid (the started process's, or its grandchild's in a pid namespace)."""
    init: int = 0
    """A pidfd of the pid namespace's init (-1: none, the server is the started process)."""
    round_trip_ms: float = 0.0
    ready: bool = False
    used: bool = False


class SandboxHost:
    """The sandbox process of one engine (module docstring): started on first use, kept while
    the candidates it runs leave it clean, replaced otherwise (:meth:`discard`; the next
    :meth:`ensure` starts a new one, or :meth:`prewarm` does so ahead).

    Args:
        spec: the engine's spec (after any batch fitting). weights: the judge's shared weights.
        vocab: logits per row. threads: intra-op threads of the sandbox.
        address_space: ``RLIMIT_AS`` of the sandbox, bytes (0: none; CPU engines only).
        user: the unprivileged user the sandbox becomes (default: ``KILN_SANDBOX_UID`` /
            ``KILN_SANDBOX_GID`` when this process is root, else none:
            :func:`~kiln.runtime.sandbox.user.host_user`); its directory is made that user's.

    Attributes:
        restarts: sandboxes replaced. confinement: what the host refused when confining the
            current one. last_report: the last ``unload`` reply (untrusted; tests read
            ``played``).
    """

    def __init__(
        self,
        spec: EngineSpec,
        weights: SharedWeights,
        vocab: int,
        threads: int,
        address_space: int = 0,
        user: SandboxUser | None = None,
    ) -> None:
        self.spec = spec
        self.weights = weights
        self.device = torch.device(spec.device)
        self.out = SharedBuffer(output_bytes(spec, vocab), self.device)
        self.threads = threads
        self.address_space = address_space
        self.home = tempfile.mkdtemp(prefix="kiln-sandbox-")
        self.user = user if user is not None else host_user()
        if self.user is not None:
            self.user.own(self.home)
        self.restarts = 0
        self.confinement: list[str] = []
        self.last_report: dict[str, Any] = {}
        self._proc: _Process | None = None
        self._deadline = 0.0
        self._pending = False
        self.replaced: list[str] = []
        """Why each replaced sandbox was replaced after its candidate (newest last)."""

    # ------------------------------------------------------------------ lifecycle
    def prewarm(self) -> None:
        """Start a sandbox if none is running (returns at once)."""
        self.settle()
        if self._proc is None:
            self._start()

    def _start(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fds = [child.fileno()] + [fd for fd in (self.weights.fd, self.out.fd) if fd >= 0]
        argv = [
            sys.executable,
            "-I",
            "-c",
            BOOT,
            str(child.fileno()),
            str(os.getpid()),
            self.home,
            json.dumps([p for p in sys.path if p]),
        ]
        with open(os.path.join(self.home, "stderr.log"), "wb") as log:
            popen = subprocess.Popen(
                argv,
                pass_fds=fds,
                env=sandbox_environment(self.home),
                cwd=self.home,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                close_fds=True,
                start_new_session=True,
            )
        child.close()
        self._proc = _Process(popen, parent)
        wire.send(
            parent,
            {
                "spec": self.spec.to_dict(),
                "threads": self.threads,
                "weights": self.weights.manifest,
                "weights_fd": self.weights.fd,
                "weights_bytes": self.weights.nbytes,
                "out": {"fd": self.out.fd, "nbytes": self.out.nbytes},
                "address_space": self.address_space,
                "user": None if self.user is None else {"uid": self.user.uid, "gid": self.user.gid},
                # CUDA may need the host's namespaces; TCP is still refused (Landlock)
                "unshare_network": self.device.type != "cuda",
            },
        )

    deadline_s = 0.0
    """The current experiment's deadline, seconds (for messages)."""

    def ensure(self, deadline: float) -> _Process:
        """A ready sandbox (started, and calibrated, if needed) for an experiment ending at
        ``deadline`` (``time.monotonic()``; 0: none).

        Raises:
            SandboxFailure: it could not start in time.
        """
        self._deadline = deadline
        self.settle()
        if self._proc is None:
            self._start()
        proc = self._proc
        assert proc is not None
        if proc.ready:
            return proc
        limit = time.monotonic() + READY_TIMEOUT_S
        header, _ = self._receive(proc, min(limit, deadline) if deadline else limit, "starting")
        if header.get("op") != "ready":
            self.discard()
            raise SandboxFailure("crashed", f"the sandbox failed to start: {header.get('error')}")
        proc.pid, proc.init = self._server_pid(proc, header.get("pid")), -1
        if proc.pid != proc.popen.pid:
            proc.init = os.pidfd_open(processes.parent_of(proc.pid))
        proc.ready = True
        self.confinement = [str(n) for n in header.get("confinement", [])]
        proc.round_trip_ms = self._calibrate(proc)
        return proc

    def _server_pid(self, proc: _Process, said: object) -> int:
        """The server's pid the sandbox said at ``ready``, checked against the kernel's process
        tree: the started process, or its grandchild under its pid namespace's init."""
        pid = said if isinstance(said, int) else 0
        if pid == proc.popen.pid:
            return pid
        init = processes.parent_of(pid) if pid > 0 else 0
        if init <= 0 or processes.parent_of(init) != proc.popen.pid:
            self.discard()
            raise SandboxFailure("crashed", f"the sandbox said it is process {said!r}: it is not")
        return pid

    def _calibrate(self, proc: _Process) -> float:
        tokens = torch.zeros((self.spec.batch_size, 1), dtype=torch.int64)
        header, payload = self._tokens_message("echo", tokens)
        samples = []
        for _ in range(CALIBRATION_CALLS):
            start = time.perf_counter()
            self.call(header, payload)
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)

    @property
    def round_trip_ms(self) -> float:
        """The current sandbox's median empty round trip (tokens in, [B, V] float32 out), ms."""
        return self._proc.round_trip_ms if self._proc else 0.0

    @property
    def pid(self) -> int:
        """The current sandbox server's process id (0: none; before it is ready, the started
        process's)."""
        if self._proc is None:
            return 0
        return self._proc.pid or self._proc.popen.pid

    def discard(self) -> None:
        """Kill the current sandbox (if any) with every process it started, and reap it; the
        next :meth:`ensure` starts anew. In a pid namespace killing its init kills them all;
        without one, its session and every descendant found in ``/proc`` (module
        :mod:`~kiln.runtime.sandbox.processes`)."""
        proc, self._proc = self._proc, None
        self._pending = False
        if proc is None:
            return
        if proc.init > 0:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(proc.init, signal.SIGKILL)
                # readable once init has exited: after the kernel killed the namespace's rest
                select.select([proc.init], [], [], DISCARD_WAIT_S)
            os.close(proc.init)
        else:
            for pid in processes.descendants(proc.popen.pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                os.killpg(proc.popen.pid, signal.SIGKILL)  # its session's group
        with contextlib.suppress(ProcessLookupError):
            proc.popen.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.popen.wait(DISCARD_WAIT_S)
        proc.sock.close()
        self.restarts += 1

    def strays(self) -> list[int]:
        """Processes the current sandbox's candidates started that are still there (the kernel's
        process tree: everything below the started process but the server and its init)."""
        proc = self._proc
        if proc is None or not proc.ready:
            return []
        init = processes.parent_of(proc.pid) if proc.pid != proc.popen.pid else 0
        return [p for p in processes.descendants(proc.popen.pid) if p not in (proc.pid, init)]

    def close(self) -> None:
        """Stop the sandbox and remove its directory."""
        self.discard()
        shutil.rmtree(self.home, ignore_errors=True)

    # ------------------------------------------------------------------ calls
    def _receive(
        self, proc: _Process, deadline: float, doing: str
    ) -> tuple[dict[str, Any], bytearray]:
        remaining = deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise TimeoutError
            proc.sock.settimeout(remaining)
            return wire.receive(proc.sock)
        except TimeoutError:
            self.discard()
            raise SandboxFailure(
                "timed_out", f"no result within the deadline of {self.deadline_s:g} s (the "
                f"sandbox was {doing}); sandbox restarted"
            ) from None  # fmt: skip
        except (wire.WireError, OSError):
            code = proc.popen.poll()
            if code is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    code = proc.popen.wait(2.0)
            self.discard()
            raise SandboxFailure(
                "crashed", f"candidate sandbox died: {describe_exit(code)}; sandbox restarted"
            ) from None

    def call(
        self, header: dict[str, Any], payload: bytes = b""
    ) -> tuple[dict[str, Any], bytearray]:
        """Send one command and wait for its reply (up to the experiment's deadline).

        Raises:
            SandboxFailure: it died or did not answer in time (it is discarded).
            CandidateRaised: the candidate's code raised there.
        """
        proc = self._proc
        if proc is None or not proc.ready:
            raise SandboxFailure("crashed", "no sandbox is running")
        proc.used = True
        deadline = self._deadline or time.monotonic() + CALL_TIMEOUT_S
        try:
            wire.send(proc.sock, header, payload)
        except OSError:
            pass  # it died: the receive says how
        reply, data = self._receive(proc, deadline, str(header.get("op")))
        if "raised" in reply:
            raise CandidateRaised(str(reply["raised"]), str(reply.get("phase") or ""))
        return reply, data

    def _tokens_message(
        self, op: str, tokens: Tensor, **more: Tensor
    ) -> tuple[dict[str, Any], bytes]:
        header: dict[str, Any] = {"op": op}
        parts = []
        for key, t in {"tokens": tokens, **more}.items():
            data = tensors.tensor_bytes(t)
            header[key] = {**tensors.tensor_header(t), "nbytes": len(data)}
            parts.append(data)
        return header, b"".join(parts)

    def output(self, reply: dict[str, Any], data: bytearray) -> Tensor:
        """The tensor a call returned: a view of the shared buffer, or the inline bytes.

        Raises:
            NotPlainTensor: the sandbox refused the candidate's output as not a plain tensor.
            SandboxFailure: a reply that is not an output (the sandbox is discarded).
        """
        if "not_plain" in reply:
            raise NotPlainTensor(str(reply["not_plain"]))
        meta = reply.get("out")
        try:
            if not isinstance(meta, dict):
                raise wire.WireError(f"no output in {str(reply)[:120]}")
            if reply.get("inline"):
                return tensors.from_bytes(meta, data).to(self.device)
            dtype = tensors.DTYPES.get(str(meta.get("dtype")))
            if dtype is None:
                raise wire.WireError(f"unknown dtype {meta.get('dtype')!r}")
            return self.out.view(dtype, [int(s) for s in meta["shape"]])
        except (wire.WireError, ValueError, TypeError, KeyError) as exc:
            self.discard()
            raise SandboxFailure("crashed", f"the sandbox answered nonsense: {exc}") from None

    # ------------------------------------------------------------------ one experiment
    def load(self, canonical: dict[str, Any], phases: dict[str, float], notes: list[str]) -> None:
        """Load, bind and transform a candidate in the sandbox; its phases and notes added.

        From this call on the sandbox counts as having run candidate code, whatever the
        outcome: it is put back and checked (:meth:`settle`) or replaced.

        Raises:
            RejectedCandidate: refused there (unknown op, support, a bad transform).
            CandidateRaised, SandboxFailure: see :meth:`call`.
        """
        self._pending = self._proc is not None  # a load that raises leaves residue too
        reply, _ = self.call({"op": "load", "candidate": canonical})
        for name, ms in dict(reply.get("phases") or {}).items():
            phases[str(name)] = float(ms)
        if "rejected" in reply:
            raise RejectedCandidate(str(reply["rejected"]).partition(": ")[2])
        notes.extend(str(n) for n in reply.get("notes") or [])

    def loaded(self) -> bool:
        """Whether a candidate was sent to the current sandbox and it has not been put back
        (:meth:`settle`) or replaced yet."""
        return self._pending and self._proc is not None

    def settle(self) -> str:
        """Put the sandbox back after its candidate, if one is pending; replace it when it is not
        clean. Returns why it was replaced ("" if it was not)."""
        if not self._pending or self._proc is None:
            self._pending = False
            return ""
        self._pending = False
        deadline, self._deadline = self._deadline, time.monotonic() + CALL_TIMEOUT_S
        try:
            reply, _ = self.call({"op": "unload"})
            self.last_report = reply
            why = "" if reply.get("clean") else "; ".join(map(str, reply.get("changes") or ["?"]))
        except (SandboxFailure, CandidateRaised) as exc:
            why = str(exc)
        finally:
            self._deadline = deadline
        left = self.strays()
        if left:
            pids = ", ".join(map(str, left[:8]))
            why = "; ".join(filter(None, [why, f"left {len(left)} process(es) running ({pids})"]))
        if why:
            self.discard()
            self.replaced.append(why)
        return why

    def weights_written(self) -> str:
        """Why the judge must treat the sandbox's weights as changed ("" if unchanged): on CPU, the
        kernel's count of pages the sandbox copied from its private mapping of the weights."""
        proc = self._proc
        if proc is None or self.weights.cuda:  # CUDA: mapped read-only there
            return ""
        kib, problem = written_kib(proc.pid or proc.popen.pid, self.weights.name)
        if problem:
            return problem
        if kib:
            return (
                f"the candidate wrote {kib} KiB of its copy of the weights (the judge's are "
                "sealed against writes and unchanged)"
            )
        return ""

    def used(self) -> bool:
        """Whether candidate code ran in the current sandbox."""
        return bool(self._proc and self._proc.used)
