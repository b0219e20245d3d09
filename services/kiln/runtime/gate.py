"""The gate: one candidate through the phases of an experiment on a built engine, to a
:class:`~kiln.runtime.measurement.Measurement` (:meth:`Gate._gate`). Phases, timed in ms:

1. ``load``: its code modules in fresh namespaces;
2. ``bind``: what :func:`~kiln.runtime.support.support_for` refuses is REJECTED;
   ``OpBinding.from_recipe(candidate.ops)``, ``model.rebind`` (derived layouts from the weight
   store's cache), its transforms;
3. ``compile``: ``warmup`` (>= 1) untimed decode steps at the traffic shape; the first one's logits
   are kept for the check;
4. ``check``: the reference's traffic-shape step against them; then ``check_batch`` fresh prompts,
   prefill + ``check_steps`` decode steps (:mod:`~kiln.runtime.check`; MoE:
   :mod:`~kiln.runtime.moe_check`);
5. ``measure``: ``min_repeats`` to ``repeats`` timed decode steps within ``measure_budget_s`` at
   (batch_size, context_len): median, p10, p90, stdev, mean, max; tokens/s = batch_size / the
   decision step (the median, or the mean / 1.25 when work was front-loaded:
   :mod:`kiln.domain.step_time`); outputs poisoned, a random ``verify_timed_steps`` kept
   (:class:`~kiln.runtime.check.TimedOutputs`), no candidate thread may outlive a call (else
   INCORRECT);
6. ``verify``: the reference on each kept step's token at the same cache state, the kept steps
   stacked into as few forwards as fit in memory; ``verified_steps`` and ``escape_probability``
   recorded;
7. ``prefill`` (when asked): ``batch_size`` prompts of ``context_len`` tokens, timed; then the
   per-op profile (when asked).

Every output read (the checked steps', each timed step's, each timed prefill's) must be exactly a
``torch.Tensor`` (:func:`~kiln.runtime.check.not_plain`), else INCORRECT. An exception in any
phase makes it CRASHED (exception and traceback tail); an unknown or refused op, implementation or
transform REJECTED.
"""

from __future__ import annotations

import functools
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from kiln.domain.candidate import Candidate
from kiln.domain.step_time import FRONT_LOAD_SLACK
from kiln.ops.registry import OpLookupError
from kiln.runtime.attributes import AttributeSnapshot
from kiln.runtime.check import (
    LOSSY_RTOL,
    CheckResult,
    EngineFault,
    NotPlainTensor,
    OutputGuard,
    TimedOutputs,
    plain_tensor,
    run_steps,
)
from kiln.runtime.gate_check import GateChecks
from kiln.runtime.measurement import Measurement, MemoryUsage, Timing
from kiln.runtime.op_profile import OpProfile, profile_decode_step, profile_fields
from kiln.runtime.reload import load_code_modules
from kiln.runtime.request import RunRequest
from kiln.runtime.sandbox.host import CandidateRaised, SandboxFailure
from kiln.runtime.sandbox.model import SandboxModel
from kiln.runtime.state_guard import StateChanged, rtol_for
from kiln.runtime.support import support_for
from kiln.runtime.thread_watch import OutsideWork, ThreadWatch
from kiln.runtime.timed_verification import escape_probability
from kiln.runtime.timing import CpuTimer, CudaTimer, summarize, time_after_untimed
from kiln.runtime.transforms import AppliedTransforms, RejectedCandidate, apply_transforms
from kiln.workloads.models import OpBinding
from kiln.workloads.models.binding import BindError, LossyImplementationError

if TYPE_CHECKING:
    from kiln.runtime.sandbox.host import SandboxHost

Tensor = torch.Tensor
TRACEBACK_CHARS = 1500
JUDGED = "(judged outside the candidate's sandbox)"
"""Ends the error of a sandboxed candidate whose outputs differed from the reference's."""


@contextmanager
def _timed(phases: dict[str, float], name: str, sync: Callable[[], None]) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        sync()
        phases[name] = (time.perf_counter() - start) * 1e3


def _plain_prefill(out: object) -> None:
    """A timed prefill's output is never read, but must be a plain tensor too (a lazy one would
    defer its work past the timer)."""
    plain_tensor(out, "timed prefill")


def _crash_text(phase: str, exc: BaseException) -> str:
    tail = "".join(traceback.format_exception(exc))[-TRACEBACK_CHARS:]
    return f"{phase}: {type(exc).__name__}: {exc}\n{tail}"


class Gate(GateChecks):
    """The phases of one experiment, as methods of :class:`~kiln.runtime.engine.Engine`
    (a base class of it; the attributes below are the engine's)."""

    timer: CpuTimer | CudaTimer
    _measured: Any
    """What the candidate's calls go to this experiment: the measured model, or a
    :class:`~kiln.runtime.sandbox.host.SandboxModel`."""

    if TYPE_CHECKING:

        def memory(self) -> MemoryUsage: ...

        def _sandbox_for(self, candidate: Candidate, request: RunRequest) -> SandboxHost | None: ...

        def _sandbox_load(
            self, candidate: Candidate, phases: dict[str, float], notes: list[str]
        ) -> SandboxModel: ...

    def _step_timer(self) -> tuple[CpuTimer | CudaTimer, float]:
        """The timer of a candidate's step and the ms to subtract from each sample: the engine's
        timer and 0 in this process; for the sandbox, the wall clock around the round trip and
        the sandbox's calibrated empty round trip."""
        if isinstance(self._measured, SandboxModel):
            return CpuTimer(), self._measured.host.round_trip_ms
        return self.timer, 0.0

    def _judged(self) -> str:
        """What an INCORRECT comparison's error ends with: where the candidate ran."""
        if isinstance(self._measured, SandboxModel):
            return f" {JUDGED}"
        return ""

    def _check_state(self, when: str) -> None:
        """The state guard's check (:class:`~kiln.runtime.state_guard.StateChanged` names what
        changed), except for a sandboxed candidate on CPU: the judge's weights are in a memfd
        sealed against writes from any mapping but the judge's, and no candidate code runs
        here."""
        if isinstance(self._measured, SandboxModel) and self.device.type == "cpu":
            return
        self._state.check(when)

    def _profile(self, token: Tensor) -> OpProfile:
        if isinstance(self._measured, SandboxModel):
            return self._measured.profile(token)
        return profile_decode_step(self.model, token, self._at_context, self.dtype)

    def _gate(
        self,
        candidate: Candidate,
        request: RunRequest,
        phases: dict[str, float],
        notes: list[str],
        applied: AppliedTransforms,
        base: dict[str, Any],
        model: AttributeSnapshot,
        tampered: list[str],
    ) -> Measurement:
        """Load, bind, compile (first step at the shape kept), check, time, verify timed steps
        (phases in the module docstring). ``model`` is the measured model's attributes before
        loading: changes found after loading go to ``tampered`` and are put back; it is
        re-taken once the transforms are applied (they may install a forward)."""
        sync = self.timer.sync
        spec = self.spec
        rtol = LOSSY_RTOL if candidate.lossy else rtol_for(self.dtype)
        g = torch.Generator().manual_seed(request.seed + 1)
        tokens = torch.randint(
            self.vocab, (request.warmup + request.repeats, spec.batch_size, 1), generator=g
        )
        steps = tokens.to(self.device, copy=True)  # the candidate's; ``tokens`` stays ours
        phase = "load"
        try:
            if self._sandbox_for(candidate, request) is not None:
                self._measured = self._sandbox_load(candidate, phases, notes)
            else:
                self._measured = self.model
                self._load_here(candidate, phases, model, tampered)
                phase = "bind"
                self._bind_here(candidate, phases, notes, applied, model)
            if candidate.lossy:
                notes.append(f"lossy: checked to {LOSSY_RTOL:g} x max |reference|")
            phase = "compile"
            guard = OutputGuard(self._protected)
            measured = self._measured
            with _timed(phases, "compile", sync):
                # The first step at the traffic shape is checked (in the check phase); the
                # candidate cannot tell it from the timed steps that follow.
                token = self._shape_token(request.seed)
                self._fill_cache()
                first = run_steps([functools.partial(measured.decode_step, token)], guard)
                for i in range(1, request.warmup):
                    self._at_context()
                    measured.decode_step(steps[i])
            phase = "check"
            with _timed(phases, "check", sync):
                verdict = self._check(request.seed, rtol, first, guard, notes)
            if not verdict.correct:
                return self._incorrect(verdict, phases, notes, base)
            phase = "measure"
            kept = TimedOutputs(request.verify_timed_steps)
            with _timed(phases, "measure", sync):
                samples = self._time(request, steps[request.warmup :], guard, kept)
            phase = "verify"
            with _timed(phases, "verify", sync):
                verified = self._verify(kept, tokens[request.warmup :], rtol, len(samples), notes)
            chosen = ", ".join(str(step + 1) for step, _ in kept.kept())
            notes.append(
                f"verified timed step(s) {chosen or 'none'} of {len(samples)} against the "
                "reference (chosen after each call returned)"
            )
            timing = summarize(samples, request.warmup)
            if not verified.correct:
                notes.append(f"timed median {timing.median_ms:.4g} ms (not reported: incorrect)")
                return self._incorrect(verified, phases, notes, base)
            if timing.mean_decides:
                notes.append(
                    f"tokens/s from the mean: mean step {timing.mean_ms:.4g} ms / "
                    f"{FRONT_LOAD_SLACK:g} is above the median {timing.median_ms:.4g} ms "
                    f"(slowest {timing.max_ms:.4g} ms): work front-loaded into few steps"
                )
            prefill: Timing | None = None
            if request.prefill_repeats > 0:
                phase = "prefill"
                with _timed(phases, "prefill", sync):
                    prefill_ms = self._time_prefill(request.prefill_repeats, request.seed)
                    prefill = summarize(prefill_ms, 1)
                notes.append(
                    f"prefill timed: {spec.batch_size} prompts of {spec.context_len} tokens, "
                    f"{request.prefill_repeats} times after one untimed"
                )
            profiled = profile_fields(  # after the timed steps: it cannot change them
                request.profile,
                lambda: self._profile(self._shape_token(request.seed)),
                notes,
                phases,
            )
        except RejectedCandidate as exc:
            return Measurement.failed("rejected", f"{phase}: {exc}", phases_ms=phases, **base)
        except SandboxFailure as exc:
            return Measurement.failed(
                exc.status, f"{phase}: {exc.message}", phases_ms=phases, notes=notes, **base
            )
        except CandidateRaised as exc:
            return Measurement.failed(
                "crashed", f"{exc.phase or phase}: {exc}", phases_ms=phases, notes=notes, **base
            )
        except NotPlainTensor as exc:
            return Measurement.failed(
                "incorrect",
                f"incorrect: {phase}: {exc} (outputs must be exactly torch.Tensor)",
                phases_ms=phases,
                notes=notes,
                **base,
            )
        except OutsideWork as exc:
            return Measurement.failed(
                "incorrect",
                f"incorrect: work outside the timed call: {exc}",
                phases_ms=phases,
                notes=notes,
                restart_engine=True,
                **base,
            )
        except StateChanged as exc:
            return Measurement.failed(
                "incorrect",
                f"incorrect: {exc}",
                phases_ms=phases,
                notes=notes,
                restart_engine=True,
                **base,
            )
        except EngineFault as exc:
            return Measurement.failed(
                "crashed", f"{phase}: {exc}", phases_ms=phases, restart_engine=True, **base
            )
        except (Exception, SystemExit) as exc:
            return Measurement.failed(
                "crashed", _crash_text(phase, exc), phases_ms=phases, notes=notes, **base
            )
        return Measurement(
            status="ok",
            correct=True,
            max_abs_error=max(verdict.max_abs_error, verified.max_abs_error),
            timing=timing,
            tokens_per_s=timing.per_second(spec.batch_size),
            prefill=prefill,
            prefill_tokens_per_s=(
                prefill.per_second(spec.batch_size * spec.context_len) if prefill else 0.0
            ),
            memory=self.memory(),
            phases_ms=phases,
            notes=notes,
            verified_steps=len(kept.kept()),
            escape_probability=escape_probability(len(kept.kept())),
            **profiled,
            **base,
        )

    def _load_here(
        self,
        candidate: Candidate,
        phases: dict[str, float],
        model: AttributeSnapshot,
        tampered: list[str],
    ) -> None:
        """Load ``candidate``'s code modules in this process (trusted code only). ``model`` and
        ``tampered`` as in :meth:`_gate`.

        Raises:
            whatever loading the code modules raises.
        """
        with _timed(phases, "load", self.timer.sync):
            load_code_modules(candidate.code_modules)
        loaded = list(model.changes())
        if loaded:
            tampered += loaded
            model.restore()

    def _bind_here(
        self,
        candidate: Candidate,
        phases: dict[str, float],
        notes: list[str],
        applied: AppliedTransforms,
        model: AttributeSnapshot,
    ) -> None:
        """Bind ``candidate``'s recipe and apply its transforms to the measured model.

        Raises:
            RejectedCandidate: refused (support, an unknown op or implementation, lossy without
                opting in, a bad transform).
        """
        with _timed(phases, "bind", self.timer.sync):
            # what this engine runs for the model (after the code modules registered
            # theirs): the statement the agents' search space is restricted to
            support = support_for(self.spec.model_config(), self.device.type)
            refusal = support.refusal(candidate)
            if refusal is not None:
                raise RejectedCandidate(refusal)
            try:
                binding = OpBinding.from_recipe(dict(candidate.ops), allow_lossy=candidate.lossy)
                self.model.rebind(binding)
            except (OpLookupError, LossyImplementationError, BindError) as exc:
                raise RejectedCandidate(str(exc)) from exc
            more = apply_transforms(self.model, candidate.transforms, support)
            applied.undo += more.undo
            applied.compiled = more.compiled
            notes += more.notes
        model.take()
        for name, ms in more.phases_ms.items():  # graph_capture: its own phase
            phases["bind"] -= ms
            phases[name] = ms

    def _time_prefill(self, repeats: int, seed: int) -> list[float]:
        """Prefill of ``batch_size`` random prompts of ``context_len`` tokens on the measured
        model (the candidate's ops): one untimed, then ``repeats`` timed, ms each. The cache is
        put back at the operating point afterwards (its first slots now hold real K/V).

        Raises:
            NotPlainTensor: a timed prefill returned something other than a plain tensor.
            whatever the candidate's prefill raises (the experiment is then CRASHED).
        """
        spec = self.spec
        g = torch.Generator().manual_seed(seed + 3)
        prompts = torch.randint(self.vocab, (spec.batch_size, spec.context_len), generator=g)
        prompts = prompts.to(self.device)
        call = functools.partial(self._measured.prefill, prompts)
        timer, overhead = self._step_timer()
        try:
            ms = time_after_untimed(timer, call, repeats, _plain_prefill)
            return [t - overhead for t in ms]
        finally:
            self._at_context()

    def _incorrect(
        self,
        verdict: CheckResult,
        phases: dict[str, float],
        notes: list[str],
        base: dict[str, Any],
    ) -> Measurement:
        return Measurement(
            status="incorrect",
            max_abs_error=verdict.max_abs_error,
            error=f"incorrect: {verdict.reason}{self._judged()}",
            memory=self.memory(),
            phases_ms=phases,
            notes=notes,
            **base,
        )

    def _time(
        self, request: RunRequest, steps: Tensor, guard: OutputGuard, kept: TimedOutputs
    ) -> list[float]:
        """Timed decode steps at the operating point, ms each: ``min_repeats`` to ``repeats``,
        stopping once ``measure_budget_s`` of timed steps have run.

        Args:
            request: the experiment (repeats, budget).
            steps: ``[repeats, batch_size, 1]`` int64 tokens, one step each.
            guard: poisons the previous output before each call (outside the timed interval).
            kept: offered each step's output right after its call returns, outside the timed
                interval (CUDA: on the current stream, before the device-wide sync).

        Raises:
            OutsideWork: a thread still ran candidate code, or one started during the call was
                alive, after a call returned.
            NotPlainTensor: a step returned something other than a plain tensor.
        """
        samples: list[float] = []
        timer, overhead = self._step_timer()
        budget_ms = request.measure_budget_s * 1e3
        threads = ThreadWatch()

        def keep(step: int, out: object) -> Callable[[], None] | None:
            copy = kept.offer(step, out)  # first: it refuses anything but a plain tensor
            guard.hold(out)
            return copy

        for i in range(request.repeats):
            self._at_context()
            guard.poison()
            guard.release()
            step = functools.partial(self._measured.decode_step, steps[i])
            samples.append(timer.time_ms(step, functools.partial(keep, i)) - overhead)
            strays = threads.strays()
            if strays:
                raise OutsideWork(f"after timed step {i + 1} returned: {'; '.join(strays[:4])}")
            enough = len(samples) >= request.min_repeats
            if enough and budget_ms > 0 and sum(samples) >= budget_ms:
                break
        guard.poison()
        guard.release()
        return samples
