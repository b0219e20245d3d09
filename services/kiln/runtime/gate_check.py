"""The gate's comparisons against the engine's reference models: the first step at the traffic
shape plus a fresh prefill/decode check (:meth:`GateChecks._check`), and the kept timed steps
(:meth:`GateChecks._verify`, stacked into as few reference forwards as
:data:`VERIFY_CHUNK_BYTES` allows). The reference always gets its own copy of every input, and
every comparison a float64 forward of the same steps: the tolerance is derived from the
reference's error against it (:func:`~kiln.runtime.check.compare_exact`), or for a candidate
that opted into lossy implementations, :data:`~kiln.runtime.check.LOSSY_RTOL` with the same
ratio reported.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kiln.runtime.check import (
    LOSSY_RTOL,
    MIN_RMS_ROWS,
    CheckInputs,
    CheckResult,
    ErrorSums,
    OutputGuard,
    TimedOutputs,
    compare,
    compare_exact,
    rms_failure,
    run_steps,
    tolerance_for,
)
from kiln.runtime.exact import exact_model, exact_step, stacked, step_bytes
from kiln.runtime.moe_check import RoutedCheck
from kiln.runtime.spec import EngineSpec
from kiln.runtime.state_guard import StateGuard
from kiln.workloads.models import DecoderModel

Tensor = torch.Tensor

VERIFY_CHUNK_BYTES = 256 << 20
"""Transient memory one stacked verify forward may add (copies of a layer's K/V rows and the
logits, :func:`~kiln.runtime.exact.step_bytes`); a step that needs more is verified alone, as
one step always was."""


def _part(stacked_out: list[Tensor], i: int, copies: int) -> Tensor:
    """Copy ``i`` of a stacked forward's one output ``[copies x B, ...]``: ``[B, ...]``."""
    (out,) = stacked_out
    return out.unflatten(0, (copies, -1))[i]


class GateChecks:
    """The comparison phases of :class:`~kiln.runtime.engine.Engine` (a base class of it)."""

    spec: EngineSpec
    device: torch.device
    dtype: torch.dtype
    vocab: int
    model: DecoderModel
    reference: DecoderModel
    shape_reference: DecoderModel
    _protected: set[int]
    _state: StateGuard
    _measured: Any  # the model the candidate's calls go to (in process, or the sandbox's stand-in)

    if TYPE_CHECKING:

        def _at_context(self) -> None: ...

        def _fill_cache(self) -> None: ...

        def _check_state(self, when: str) -> None: ...

    def _compare(
        self,
        got: list[Tensor],
        want: list[Tensor],
        rtol: float,
        rows: list[Tensor] | None,
        exact: list[Tensor],
    ) -> CheckResult:
        """:func:`~kiln.runtime.check.compare_exact` with this dtype's row of the table, its
        RMS rule left to :meth:`_rms` over the phase; or for ``rtol``
        :data:`~kiln.runtime.check.LOSSY_RTOL` (a lossy candidate) the fixed bound."""
        if rtol == LOSSY_RTOL:
            return compare(got, want, rtol, rows, exact)
        return compare_exact(got, want, exact, tolerance_for(self.dtype), rows, pooled=False)

    def _rms(self, rtol: float, errors: ErrorSums) -> str:
        """:func:`~kiln.runtime.check.rms_failure` of a phase's pooled errors ("" for a lossy
        candidate)."""
        return "" if rtol == LOSSY_RTOL else rms_failure(errors, tolerance_for(self.dtype))

    def _verify(
        self, kept: TimedOutputs, tokens: Tensor, rtol: float, timed: int, notes: list[str]
    ) -> CheckResult:
        """The reference's decode step on each kept timed step's token at the same cache state,
        against the kept logits, each step compared on its own; ``tokens [repeats, batch_size,
        1]`` int64 is the engine's own copy. Kept steps are stacked, ``c`` of them into one
        forward over ``c x batch_size`` rows (:func:`~kiln.runtime.exact.stacked`; and one
        float64 forward), with ``c`` as large as :data:`VERIFY_CHUNK_BYTES` allows.
        """
        ref_guard = OutputGuard(self._protected)
        worst, tolerance = 0.0, 0.0
        moe = RoutedCheck(self.shape_reference, rtol, lossy=rtol == LOSSY_RTOL)
        steps = kept.kept()
        per_forward = max(1, VERIFY_CHUNK_BYTES // max(1, step_bytes(self.shape_reference)))
        forwards, errors = 0, ErrorSums()
        self._fill_cache()  # the timed steps' cache content, whatever the candidate wrote there
        for first in range(0, len(steps), per_forward):
            chunk = steps[first : first + per_forward]
            self._at_context()
            token = torch.cat([tokens[step] for step, _ in chunk]).to(self.device)
            exact = self._exact([functools.partial(exact_step, self.shape_reference, token)])
            ref = moe.record(stacked(self.shape_reference, len(chunk)), "timed step")
            want = run_steps([functools.partial(ref.decode_step, token)], ref_guard)
            rows = moe.rows(ref)
            forwards, n = forwards + 1, len(chunk)
            for i, (step, got) in enumerate(chunk):
                verdict = self._compare(
                    [got],
                    [_part(want, i, n)],
                    rtol,
                    None if rows is None else [_part(rows, i, n)],
                    [_part(exact, i, n)],
                )
                if not verdict.correct:
                    reason = verdict.reason.removeprefix("step 0: ")
                    return CheckResult(
                        False,
                        verdict.max_abs_error,
                        verdict.tolerance,
                        f"timed step {step + 1} of {timed} (verified after timing): {reason}",
                    )
                worst, tolerance = max(worst, verdict.max_abs_error), verdict.tolerance
                errors += verdict.errors
        why = self._rms(rtol, errors)
        if why:
            shown = ", ".join(str(step + 1) for step, _ in steps[:8])
            where = f"timed steps {shown} of {timed} (verified after timing)"
            return CheckResult(False, worst, tolerance, f"{where}: {why}", errors)
        ref_guard.poison()
        self._at_context()
        self._check_state("by the end of verification")  # StateChanged: the reference read it
        if forwards:
            notes.append(f"{len(steps)} kept timed step(s) verified in {forwards} forward(s)")
        if moe.applies and steps:
            notes.append(f"moe, verified timed steps: {moe.rows_note()}")
        return CheckResult(True, worst, tolerance)

    def _exact(self, calls: list[Callable[[], object]]) -> list[Tensor]:
        """The float64 exact forward's logits of ``calls`` (float64 copies)."""
        return run_steps(calls, OutputGuard(self._protected))

    def _accuracy(self, rtol: float, errors: ErrorSums) -> str:
        """The note of a passed check: the candidate's RMS error against the float64 forward in
        units of the reference's own, over the traffic-shape step and the fresh prompts (for a
        lossy candidate, its accuracy report)."""
        tolerance = tolerance_for(self.dtype)
        ratio = f"RMS error {errors.ratio():.2f} x the reference's own over {errors.rows} rows"
        if rtol == LOSSY_RTOL:
            return (
                f"lossy accuracy against the float64 forward: {ratio} (undeclared, at most "
                f"{tolerance.rms_factor:g} x would pass)"
            )
        return (
            f"{str(self.dtype).removeprefix('torch.')} check against the float64 forward: "
            f"{ratio} (at most {tolerance.rms_factor:g} x from {MIN_RMS_ROWS} rows; each row's "
            f"max |error| at most {tolerance.max_factor:g} x the reference's)"
        )

    def _shape_token(self, seed: int) -> Tensor:
        """``[batch_size, 1]`` int64: the token of the step checked at the traffic shape."""
        g = torch.Generator().manual_seed(seed + 2)
        return torch.randint(self.vocab, (self.spec.batch_size, 1), generator=g).to(self.device)

    def _check(
        self,
        seed: int,
        rtol: float,
        at_shape: list[Tensor],
        guard: OutputGuard,
        notes: list[str],
    ) -> CheckResult:
        """Compare the candidate with the reference: the step at the traffic shape (``at_shape``,
        taken right before with nothing run since), then a prefill of ``check_batch`` fresh
        prompts and ``check_steps`` decode steps each. The reference's inputs are drawn again
        from ``seed``.
        """
        spec = self.spec
        ref_guard = OutputGuard(self._protected)
        self._fill_cache()  # what the candidate's first step read, whatever it wrote since
        token = self._shape_token(seed)
        moe = RoutedCheck(self.reference, rtol, lossy=rtol == LOSSY_RTOL)
        exact = self._exact([functools.partial(exact_step, self.shape_reference, token)])
        ref = moe.record(self.shape_reference, "at the traffic shape")
        want = run_steps([functools.partial(ref.decode_step, token)], ref_guard)
        shape_verdict = self._compare(at_shape, want, rtol, moe.rows(ref), exact)
        if not shape_verdict.correct:
            where = f"batch {spec.batch_size}, context {spec.context_len}"
            return CheckResult(
                False,
                shape_verdict.max_abs_error,
                shape_verdict.tolerance,
                f"at {where}: {shape_verdict.reason}",
            )

        def calls(model: DecoderModel) -> list[Callable[[], object]]:
            inputs = CheckInputs.draw(
                seed,
                batch=spec.check_batch,
                prompt_len=spec.prompt_len,
                steps=spec.check_steps,
                vocab=self.vocab,
                device=self.device,
            )
            out: list[Callable[[], object]] = [
                functools.partial(model.prefill, inputs.tokens, inputs.seq_lens)
            ]
            out += [functools.partial(model.decode_step, step) for step in inputs.decode]
            return out

        got = run_steps(calls(self._measured), guard)
        cache = self.reference.cache
        fresh = exact_model(self.reference, max_batch=cache.max_batch, max_len=cache.max_len)
        exact = self._exact(calls(fresh))
        ref = moe.record(self.reference, "check prefill/decode")
        want = run_steps(calls(ref), ref_guard)
        self._check_state("by the end of the check")  # before any candidate code runs again
        guard.poison()
        ref_guard.poison()
        self._fill_cache()  # the candidate's prefill wrote the first slots: timed steps start clean
        verdict = self._compare(got, want, rtol, moe.rows(ref), exact)
        if not verdict.correct:
            return verdict
        errors = shape_verdict.errors + verdict.errors
        why = self._rms(rtol, errors)
        if why:
            why = f"the traffic-shape step and fresh prompts: {why}"
            return CheckResult(False, verdict.max_abs_error, verdict.tolerance, why, errors)
        notes.append(self._accuracy(rtol, errors))
        if moe.applies:
            layers = moe.check_layers(self._measured)
            if not layers.correct:
                return layers
            notes.append(moe.note())
        worst = max(verdict.max_abs_error, shape_verdict.max_abs_error)
        return CheckResult(True, worst, verdict.tolerance)
