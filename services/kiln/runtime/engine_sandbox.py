"""The engine's side of the process split (design: docs/design/engine.md, "Sandbox"): which
candidates run in the sandbox, the sandbox host made on first use over the shared weights, the
candidate loaded there, and what a sandboxed outcome means for the engine afterwards. A base
class of :class:`~kiln.runtime.engine.Engine`; the attributes below are the engine's.
"""

from __future__ import annotations

import time
from typing import Any

from kiln.domain.candidate import Candidate
from kiln.runtime.device_fault import SANDBOX_FAULT, is_device_fault
from kiln.runtime.gate import Gate
from kiln.runtime.measurement import Measurement
from kiln.runtime.request import RunRequest
from kiln.runtime.sandbox.host import SandboxHost
from kiln.runtime.sandbox.memory import SharedWeights
from kiln.runtime.sandbox.model import SandboxModel
from kiln.workloads.weights import WeightStore

WRITTEN_IN_SANDBOX = "incorrect: state changed in the sandbox: "
"""How an INCORRECT verdict for weights the candidate wrote in its sandbox begins."""


class EngineSandbox(Gate):
    """Sandbox methods of the engine (module docstring)."""

    weights: WeightStore
    _sandboxed: bool
    _share_error: str
    _shared: SharedWeights | None
    _sandbox: SandboxHost | None
    _threads: int
    _deadline: float
    _deadline_s: float

    def _sandbox_for(self, candidate: Candidate, request: RunRequest) -> SandboxHost | None:
        """The sandbox a candidate runs in: every candidate with code modules, whatever path it
        came by (agents, an LLM, RunExperiment, the work queue); None for a recipe (trusted
        registry code, run in this process) or an engine built without one."""
        if not candidate.code_modules:
            return None
        return self._host()

    def _host(self) -> SandboxHost | None:
        """The engine's sandbox host, made on first use; None when built without one or when
        the weights cannot be shared with one (``_share_error`` says why)."""
        if not self._sandboxed or self._share_error:
            return None
        if self._shared is None:
            try:
                self._shared = SharedWeights(self.weights)
            except (ValueError, RuntimeError) as exc:
                self._share_error = f"{type(exc).__name__}: {exc}"
                return None
        if self._sandbox is None:
            self._sandbox = SandboxHost(
                self.spec, self._shared, self.vocab, self._threads, self._address_space()
            )
        return self._sandbox

    def _address_space(self) -> int:
        """The sandbox's ``RLIMIT_AS`` on CPU: its weights mapping, two caches and output, plus
        16 GiB for torch, compilers and workspace; 0 (none) on CUDA (the driver reserves far
        more address space than it uses)."""
        if self.device.type != "cpu" or self._shared is None:
            return 0
        return self._shared.nbytes + 2 * self.model.cache.nbytes() + (16 << 30)

    def _sandbox_load(
        self, candidate: Candidate, phases: dict[str, float], notes: list[str]
    ) -> SandboxModel:
        """Start the sandbox if needed, then load, bind and transform ``candidate`` there.

        Raises:
            RejectedCandidate, CandidateRaised, SandboxFailure: see :meth:`SandboxHost.load`.
        """
        host = self._sandbox
        assert host is not None
        host.deadline_s = self._deadline_s
        t = time.perf_counter()
        host.ensure(self._deadline)
        phases["sandbox_start"] = (time.perf_counter() - t) * 1e3
        host.load(candidate.canonical(), phases, notes)
        notes.append(
            f"code modules run in the sandbox process {host.pid} (trusted here: reference, "
            "inputs and seed, verified steps, comparison, tolerances, timer); timed steps are "
            f"the wall clock around each round trip less its calibrated empty round trip "
            f"({host.round_trip_ms:.3g} ms)"
        )
        if host.confinement:
            notes.append(f"sandbox confinement the host refused: {'; '.join(host.confinement)}")
        return SandboxModel(host, len(self.model.ops.layers))

    def _end_sandbox(
        self, result: Measurement, base: dict[str, Any], host: SandboxHost | None
    ) -> Measurement:
        """After a sandboxed candidate, whatever its outcome (a load that raised, a bind refusal,
        incorrect, ok; one that crashed or timed out has replaced its sandbox already): weights
        written there make it INCORRECT and the sandbox is replaced; otherwise it is put back
        after the reply (:meth:`SandboxHost.settle`: replaced unless clean)."""
        if host is None:
            return result
        if result.status == "crashed" and is_device_fault(result.error):
            # the fault is in the sandbox's own CUDA context (sticky there), not the judge's
            host.discard()
            result.error = f"{SANDBOX_FAULT}: {result.error}"
            result.notes.append("device fault in the candidate's sandbox: sandbox replaced")
            return result
        if not host.loaded():
            return result
        written = host.weights_written()
        if written:
            result = Measurement.failed(
                "incorrect",
                f"{WRITTEN_IN_SANDBOX}{written}",
                phases_ms=result.phases_ms,
                notes=result.notes,
                **base,
            )
            host.discard()
            result.notes.append("sandbox replaced after this experiment")
        # else it is put back after the reply: after_reply, or the next experiment's start
        return result

    def prewarm(self) -> None:
        """Start the sandbox ahead of the first code-module candidate (returns at once); CPU
        engines only (a CUDA sandbox holds its own context: it starts on first use)."""
        if self.device.type != "cpu":
            return
        host = self._host()
        if host is not None:
            host.prewarm()

    def close(self) -> None:
        """Stop the sandbox (the engine process's exit does too)."""
        if self._sandbox is not None:
            self._sandbox.close()
