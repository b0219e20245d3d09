"""Correctness of a candidate: its logits against the reference forward's on fresh inputs
(rationale: docs/design/engine.md, "Check").

Every output the gate reads must be exactly a ``torch.Tensor`` (:func:`not_plain`; else
:class:`NotPlainTensor`, the experiment INCORRECT); the trusted side copies and compares with
``__torch_function__`` disabled.

Tolerance, derived from the reference's own rounding error (:func:`compare_exact`): against the
same forward in float64 (:mod:`kiln.runtime.exact`), the candidate's RMS error over a
comparison's logits may be at most ``rms_factor`` times the reference's, each row's max |error|
at most ``max_factor`` times the reference's in that row, and the argmax must agree wherever the
top-2 margin exceeds twice that; factors per dtype in :data:`TOLERANCES`, the one table the gate
reads. Lossy candidates (opted in) are held to :data:`LOSSY_RTOL` x max |reference|
(:func:`compare`); MoE models are checked routing-aware (:mod:`kiln.runtime.moe_check`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kiln.ops.precision import widened

Tensor = torch.Tensor

DERIVED = "float64-derived tolerance"
"""In the reason whenever a candidate's error exceeds what :func:`compare_exact` allows."""


class Tolerance(NamedTuple):
    """One row of :data:`TOLERANCES`.

    Attributes:
        dtype: the model dtype.
        rms_factor: over one comparison's logits, RMS |candidate - exact| <= this x RMS
            |reference - exact|.
        max_factor: per row, max |candidate - exact| <= this x max |reference - exact|.
        rtol: the bound relative to max |reference| where no float64 forward is compared (the
            MoE per-layer check, baselines, exported artifacts).
    """

    dtype: torch.dtype
    rms_factor: float
    max_factor: float
    rtol: float


TOLERANCES: tuple[Tolerance, ...] = (
    Tolerance(torch.float32, 4.0, 10.0, 1e-3),
    Tolerance(torch.bfloat16, 1.75, 4.0, 5e-2),
    Tolerance(torch.float16, 1.75, 4.0, 1e-2),
)
"""The tolerance table (immutable; its content is watched: :mod:`kiln.runtime.state_guard`).
Measured on the tiny Llama of the red team (docs/design/engine.md, "Check"): honest
implementations reach RMS ratios of 1.2 (bfloat16) and 1.5 per row (float32); int8 products in
bfloat16 2.0, float16 in float32 350. The reduced-precision RMS factor sits between (1.75) with
room for GPU kernels not measured yet."""
LOSSY_RTOL = 1e-1
"""A candidate that opted into lossy implementations: max |error| <= this x max |reference|."""


def tolerance_for(dtype: torch.dtype) -> Tolerance:
    """The row of :data:`TOLERANCES` for ``dtype``; KeyError if none."""
    for row in TOLERANCES:
        if row.dtype == dtype:
            return row
    raise KeyError(f"no tolerance for {dtype}")


class EngineFault(RuntimeError):
    """The engine itself is broken (the reference produced non-finite logits): restart it."""


PLAIN = "not a plain torch.Tensor"
"""In the reason whenever an output is a tensor of another kind."""
_FOREIGN_KEYS = (
    torch._C.DispatchKey.Python,
    torch._C.DispatchKey.PythonTLSSnapshot,
    torch._C.DispatchKey.Functionalize,
    torch._C.DispatchKey.FuncTorchBatched,
    torch._C.DispatchKey.FuncTorchGradWrapper,
)
"""Dispatch keys through which reading a tensor would run code other than ATen's kernels (a
subclass's ``__torch_dispatch__`` survives assigning ``__class__ = torch.Tensor``)."""


class NotPlainTensor(TypeError):
    """An output the gate reads is not exactly a ``torch.Tensor`` (the experiment is
    INCORRECT)."""


def not_plain(out: object) -> str:
    """Why ``out`` is not an output the gate may read, or "": it must be exactly a
    ``torch.Tensor`` (``type(out) is torch.Tensor``: no subclass, no Parameter), strided, not
    nested or meta, and without Python or functorch dispatch."""
    if not isinstance(out, Tensor):
        return f"output is {type(out).__name__}, not a tensor"
    kind = type(out)
    if kind is not Tensor:
        return f"output is {kind.__module__}.{kind.__qualname__}, {PLAIN}"
    if out.layout != torch.strided or out.is_nested or out.is_meta:
        what = "nested" if out.is_nested else "meta" if out.is_meta else str(out.layout)
        return f"output is a {what} tensor, {PLAIN}"
    keys = torch._C._dispatch_keys(out)
    foreign = [str(k).rpartition(".")[2] for k in _FOREIGN_KEYS if keys.has(k)]
    if foreign:
        return f"output is a tensor with {', '.join(foreign)} dispatch, {PLAIN}"
    return ""


def plain_tensor(out: object, where: str = "") -> Tensor:
    """``out`` when :func:`not_plain` finds nothing; else :class:`NotPlainTensor` (its message
    prefixed by ``where``)."""
    why = not_plain(out)
    if why or not isinstance(out, Tensor):
        raise NotPlainTensor(f"{where}: {why}" if where else why)
    return out


@dataclass(frozen=True)
class CheckInputs:
    """Fresh inputs of one check: ``tokens [B, P]`` int64 right-padded prompts, ``seq_lens [B]``
    int64 in ``[ceil(P/2), P]`` (row 0 is P), ``decode [steps, B, 1]`` int64.
    """

    tokens: Tensor
    seq_lens: Tensor
    decode: Tensor

    @staticmethod
    def draw(
        seed: int, *, batch: int, prompt_len: int, steps: int, vocab: int, device: torch.device
    ) -> CheckInputs:
        """Random inputs from ``seed`` (drawn on CPU, moved to ``device``)."""
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(vocab, (batch, prompt_len), generator=g)
        lo = max(1, (prompt_len + 1) // 2)
        seq_lens = torch.randint(lo, prompt_len + 1, (batch,), generator=g)
        seq_lens[0] = prompt_len
        decode = torch.randint(vocab, (steps, batch, 1), generator=g)
        return CheckInputs(tokens.to(device), seq_lens.to(device), decode.to(device))


@dataclass(frozen=True)
class CheckResult:
    """Verdict of one comparison: ``correct`` (within tolerance, same decisive argmax, shapes
    equal, finite), ``max_abs_error`` (inf for non-finite or mismatched outputs), ``tolerance``
    (the absolute bound applied), ``reason`` ("" when correct) and ``errors`` (the compared
    logits' errors against the float64 forward, when one was given).
    """

    correct: bool
    max_abs_error: float
    tolerance: float
    reason: str = ""
    errors: ErrorSums = field(default_factory=lambda: ErrorSums())

    @property
    def rms_ratio(self) -> float:
        """The candidate's RMS error over the reference's (:meth:`ErrorSums.ratio`)."""
        return self.errors.ratio()


@dataclass(frozen=True)
class ErrorSums:
    """Sums over compared logits against the float64 forward: ``candidate`` and ``reference``
    squared errors, ``exact`` squared values, ``logits`` and ``rows`` counted; ``unit`` the
    dtype's unit roundoff (0: unknown). Added across comparisons (:func:`rms_failure`)."""

    candidate: float = 0.0
    reference: float = 0.0
    exact: float = 0.0
    logits: int = 0
    rows: int = 0
    unit: float = 0.0

    def __add__(self, other: ErrorSums) -> ErrorSums:
        return ErrorSums(
            self.candidate + other.candidate,
            self.reference + other.reference,
            self.exact + other.exact,
            self.logits + other.logits,
            self.rows + other.rows,
            max(self.unit, other.unit),
        )

    def own(self) -> float:
        """The reference's RMS error, at least ``unit`` x the RMS exact logit (0 if none)."""
        if not self.logits:
            return 0.0
        return max(self.reference, self.unit**2 * self.exact) ** 0.5 / self.logits**0.5

    def ratio(self) -> float:
        """RMS candidate error over :meth:`own` (0 when nothing was compared, inf when the
        reference has no error and the candidate has)."""
        own, err = self.own(), (self.candidate / max(1, self.logits)) ** 0.5
        if own > 0:
            return err / own
        return float("inf") if err > 0 else 0.0


class OutputGuard:
    """Holds the logits a model returned and poisons them (NaN) before its next call; never
    poisons storage at the ``protected`` addresses (weights, KV caches).
    """

    def __init__(self, protected: set[int]) -> None:
        self._protected = protected
        self._held: list[Tensor] = []

    def hold(self, out: object) -> None:
        """Remember ``out`` (a plain floating tensor not aliasing engine state) for poisoning."""
        if isinstance(out, Tensor) and not not_plain(out) and out.is_floating_point():
            if out.untyped_storage().data_ptr() not in self._protected:
                self._held.append(out)

    def poison(self) -> None:
        """Fill every held output with NaN."""
        with torch.no_grad(), torch._C.DisableTorchFunction():
            for t in self._held:
                t.fill_(float("nan"))

    def release(self) -> None:
        """Forget the held outputs."""
        self._held.clear()


def _copy(out: object) -> Tensor:
    """A float32 (float64 if it is) copy of a plain tensor, made with ``__torch_function__``
    disabled."""
    plain = plain_tensor(out)
    with torch._C.DisableTorchFunction():
        return widened(plain.detach()).clone()


def run_steps(calls: Sequence[Callable[[], object]], guard: OutputGuard) -> list[Tensor]:
    """Run each call with poisoning; float32 copies of the outputs. :class:`NotPlainTensor` if
    one is not exactly a tensor.
    """
    outs: list[Tensor] = []
    for call in calls:
        guard.poison()
        out = call()
        outs.append(_copy(out))
        guard.hold(out)
    return outs


@dataclass(frozen=True)
class _Noise:
    """Per compared row of one step: the exact forward's logits ``e [R, V]``, the reference's
    error ``noise [R]`` (max |reference - exact|, at least one unit roundoff of max |e|)."""

    e: Tensor
    noise: Tensor


def _finite(tensors: Sequence[Tensor]) -> None:
    for t in tensors:
        if not bool(torch.isfinite(t).all()):
            raise EngineFault("the reference forward produced non-finite logits")


def _shape_or_finite(step: int, c: Tensor, r: Tensor, tol: float) -> CheckResult | None:
    """The failure when ``c`` is not comparable with ``r`` (shape, non-finite), else None."""
    if c.shape != r.shape:
        why = f"step {step}: logits {list(c.shape)}, expected {list(r.shape)}"
        return CheckResult(False, float("inf"), tol, why)
    if not bool(torch.isfinite(c).all()):
        return CheckResult(False, float("inf"), tol, f"step {step}: non-finite logits")
    return None


def _flipped(step: int, c: Tensor, target: Tensor, margin: Tensor) -> str:
    """Why ``c``'s argmax differs from ``target``'s in a row whose top-2 margin exceeds
    ``margin`` (per row, or one value), or ""."""
    top = target.topk(2, dim=-1).values
    decisive = (top[..., 0] - top[..., 1]) > margin
    flipped = (c.argmax(-1) != target.argmax(-1)) & decisive
    if not bool(flipped.any()):
        return ""
    which = flipped.nonzero().flatten().tolist()
    return f"step {step}: a different next token for rows {which[:8]}"


def compare(
    candidate: Sequence[Tensor],
    reference: Sequence[Tensor],
    rtol: float,
    rows: Sequence[Tensor] | None = None,
    exact: Sequence[Tensor] | None = None,
) -> CheckResult:
    """The fixed bound (lossy candidates, baselines, exported artifacts), step by step (each
    ``[B, V]`` float32 or float64): ``max |candidate - target| <= rtol x max |reference| +
    noise`` over every step and compared row, the argmax equal where the target's top-2 margin
    exceeds twice that.

    Args:
        rows: per step, ``[B]`` bool rows to compare (the rest need only be finite); None: all.
        exact: the same steps in float64 arithmetic: then the target, and ``noise`` = max
            |reference - exact| over the compared rows (else the target is the reference, noise
            0); the result's ``rms_ratio`` is the candidate's RMS error over the reference's.

    Raises:
        EngineFault: the reference's (or the exact) logits are not finite.
    """
    with torch._C.DisableTorchFunction():
        _finite([*reference, *(exact or [])])
        scale = max(float(r.abs().max()) for r in reference)
        target, noise = reference, 0.0
        if exact is not None:
            target = exact
            for step, (r, e) in enumerate(zip(reference, exact, strict=True)):
                if rows is not None:
                    r, e = r[rows[step]], e[rows[step]]
                if r.numel():
                    noise = max(noise, float((r.double() - e.double()).abs().max()))
        tol = rtol * scale + noise
        worst = 0.0
        for step, (c, t) in enumerate(zip(candidate, target, strict=True)):
            failed = _shape_or_finite(step, c, t, tol)
            if failed is not None:
                return failed
            if rows is not None:
                c, t = c[rows[step]], t[rows[step]]
                if not t.shape[0]:
                    continue
            c, t = c.double(), t.double()
            worst = max(worst, float((c - t).abs().max()))
            flipped = _flipped(step, c, t, torch.tensor(2 * tol, dtype=torch.float64))
            if flipped:
                return CheckResult(False, worst, tol, flipped)
        sums = _sums(candidate, reference, exact, rows) if exact is not None else ErrorSums()
    if worst > tol:
        why = f"{rtol:g} x max |reference| = {rtol * scale:.3g}"
        if exact is not None:
            why = f"{why} plus the reference's own error {noise:.3g} (against the float64 forward)"
        return CheckResult(False, worst, tol, f"max |error| {worst:.3g} exceeds {why}", sums)
    return CheckResult(True, worst, tol, "", sums)


def _sums(
    candidate: Sequence[Tensor],
    reference: Sequence[Tensor],
    exact: Sequence[Tensor],
    rows: Sequence[Tensor] | None,
    unit: float = 0.0,
) -> ErrorSums:
    """:class:`ErrorSums` of the compared rows."""
    out = ErrorSums(unit=unit)
    for step, (c, r, e) in enumerate(zip(candidate, reference, exact, strict=True)):
        if rows is not None:
            c, r, e = c[rows[step]], r[rows[step]], e[rows[step]]
        e = e.double()
        out += ErrorSums(
            float((c.double() - e).square().sum()),
            float((r.double() - e).square().sum()),
            float(e.square().sum()),
            e.numel(),
            e.shape[0] if e.dim() > 1 else 1,
        )
    return out


MIN_RMS_ROWS = 4
"""Fewer compared rows than this: :func:`rms_failure` does not judge (one row's RMS error is a
projection of one hidden-state error, whose ratio to the reference's varies by half on small
models; MoE checks may compare a single row)."""


def rms_failure(errors: ErrorSums, tolerance: Tolerance) -> str:
    """Why the pooled RMS error exceeds ``rms_factor`` x the reference's own (naming
    :data:`DERIVED`), or "" (also when fewer than :data:`MIN_RMS_ROWS` rows were compared)."""
    if errors.rows < MIN_RMS_ROWS:
        return ""
    ratio = errors.ratio()
    if ratio <= tolerance.rms_factor:
        return ""
    err = (errors.candidate / errors.logits) ** 0.5
    dtype = str(tolerance.dtype).removeprefix("torch.")
    return (
        f"RMS error {err:.3g} over {errors.rows} rows is {ratio:.2f} x the reference's own "
        f"{errors.own():.3g}, above {tolerance.rms_factor:g} x ({DERIVED}, float64 forward: "
        f"arithmetic less precise than {dtype}, not declared lossy)"
    )


def compare_exact(
    candidate: Sequence[Tensor],
    reference: Sequence[Tensor],
    exact: Sequence[Tensor],
    tolerance: Tolerance,
    rows: Sequence[Tensor] | None = None,
    *,
    pooled: bool = True,
) -> CheckResult:
    """The derived tolerance, step by step (each ``[B, V]``; ``exact`` the same steps in
    float64 arithmetic). With ``u`` the unit roundoff of ``tolerance.dtype`` and every error
    measured against ``exact`` on the compared rows:

    - per row, max |candidate error| <= ``max_factor`` x max(max |reference error|, u x max
      |exact|), and the same argmax where the exact top-2 margin exceeds twice that bound;
    - with ``pooled`` (the default), over all compared logits, :func:`rms_failure`: RMS
      candidate error <= ``rms_factor`` x max(RMS reference error, u x RMS exact). Callers that
      pool several comparisons pass False and call :func:`rms_failure` on the sum of their
      ``errors``.

    Args:
        rows: per step, ``[B]`` bool rows to compare (the rest need only be finite); None: all.

    Returns:
        the verdict; ``tolerance`` is the largest row bound, ``errors`` the sums of the compared
        logits. A failure's reason names :data:`DERIVED`.

    Raises:
        EngineFault: the reference's or the exact logits are not finite.
    """
    with torch._C.DisableTorchFunction():
        verdict = _compare_exact(candidate, reference, exact, tolerance, rows)
        if not verdict.correct or not pooled:
            return verdict
        why = rms_failure(verdict.errors, tolerance)
        if why:
            return CheckResult(False, verdict.max_abs_error, verdict.tolerance, why, verdict.errors)
        return verdict


def _compare_exact(
    candidate: Sequence[Tensor],
    reference: Sequence[Tensor],
    exact: Sequence[Tensor],
    tolerance: Tolerance,
    rows: Sequence[Tensor] | None,
) -> CheckResult:
    _finite([*reference, *exact])
    unit = torch.finfo(tolerance.dtype).eps / 2
    worst = bound = 0.0
    for step, (c, r, e) in enumerate(zip(candidate, reference, exact, strict=True)):
        failed = _shape_or_finite(step, c, e, bound)
        if failed is not None:
            return failed
        if rows is not None:
            c, r, e = c[rows[step]], r[rows[step]], e[rows[step]]
            if not e.shape[0]:
                continue
        c, r, e = c.double(), r.double(), e.double()
        err = (c - e).abs()
        noise = torch.maximum((r - e).abs().amax(-1), unit * e.abs().amax(-1))
        row_bound = tolerance.max_factor * noise
        worst, bound = max(worst, float(err.max())), max(bound, float(row_bound.max()))
        over = err.amax(-1) > row_bound
        if bool(over.any()):
            i = int(over.nonzero()[0])
            why = (
                f"step {step}: max |error| {float(err[i].max()):.3g} in row {i} exceeds "
                f"{tolerance.max_factor:g} x the reference's own error {float(noise[i]):.3g}"
            )
            return CheckResult(False, worst, bound, f"{why} ({DERIVED}, float64 forward)")
        flipped = _flipped(step, c, e, 2 * row_bound)
        if flipped:
            return CheckResult(False, worst, bound, flipped)
    return CheckResult(True, worst, bound, "", _sums(candidate, reference, exact, rows, unit))


class TimedOutputs:
    """float32 ``[B, V]`` copies of the outputs of ``k`` timed steps chosen uniformly among
    however many run (reservoir sampling), each choice drawn from ``random.SystemRandom`` after
    the step returned. At most ``k`` held at once.
    """

    def __init__(self, k: int) -> None:
        self.k = max(0, k)
        self.seen = 0
        self._slots: list[tuple[int, Tensor]] = []
        self._rng = random.SystemRandom()

    def offer(self, step: int, out: object) -> Callable[[], None] | None:
        """The copy to make of timed step ``step``'s output (outside the timed interval), or
        None. :class:`NotPlainTensor` if ``out`` (whether kept or not) is not exactly a tensor.
        """
        out = plain_tensor(out, f"timed step {step + 1}")
        self.seen += 1
        if len(self._slots) < self.k:
            slot = len(self._slots)
            self._slots.append((step, out))  # replaced by its copy when the copy runs
        else:
            slot = self._rng.randrange(self.seen)
            if slot >= self.k:
                return None

        def copy() -> None:
            self._slots[slot] = (step, _copy(out))

        return copy

    def kept(self) -> list[tuple[int, Tensor]]:
        """``(step, float32 copy of its logits)`` for the steps kept, in step order."""
        return sorted(self._slots, key=lambda s: s[0])
