"""Correctness of a candidate: its logits against the reference forward's on fresh inputs
(rationale: docs/design/engine.md, "Check").

Every output the gate reads must be exactly a ``torch.Tensor`` (:func:`not_plain`; else
:class:`NotPlainTensor`, the experiment INCORRECT); the trusted side copies and compares with
``__torch_function__`` disabled.

Tolerance: ``max |candidate - reference| <= rtol x max |reference|`` over all checked logits,
with the same argmax wherever the reference's top-2 margin exceeds twice that; rtol float32 1e-3,
bfloat16 5e-2, float16 1e-2. In reduced precision a candidate may also be :data:`NOISE_FACTOR`
times as far from a float32 forward as the reference is. Lossy candidates (opted in) are held to
:data:`LOSSY_RTOL`; MoE models are checked routing-aware (:mod:`kiln.runtime.moe_check`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

Tensor = torch.Tensor

RTOL: dict[torch.dtype, float] = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 1e-2}
LOSSY_RTOL = 1e-1
NOISE_FACTOR = 2.0
"""A reduced-precision candidate may be this many times as far from the float32 exact forward as the
reference is (the criterion of FlashAttention's tests).
"""


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
    (the absolute bound applied) and ``reason`` ("" when correct).
    """

    correct: bool
    max_abs_error: float
    tolerance: float
    reason: str = ""


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
    """A float32 copy of a plain tensor, made with ``__torch_function__`` disabled."""
    plain = plain_tensor(out)
    with torch._C.DisableTorchFunction():
        return plain.detach().float().clone()


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


def compare(
    candidate: Sequence[Tensor],
    reference: Sequence[Tensor],
    rtol: float,
    rows: Sequence[Tensor] | None = None,
    exact: Sequence[Tensor] | None = None,
) -> CheckResult:
    """Compare step by step (each ``[B, V]`` float32).

    Args:
        rtol: the tolerance is ``rtol x max |reference|`` over every step and row.
        rows: per step, ``[B]`` bool rows to compare (the rest need only be finite); None: all.
        exact: the same steps in float32 arithmetic; then the candidate must be within
            ``max(NOISE_FACTOR x noise, rtol x max |reference| + noise)`` of it, ``noise`` = max
            |reference - exact| over the compared rows.

    Raises:
        EngineFault: the reference's (or the exact) logits are not finite.
    """
    with torch._C.DisableTorchFunction():
        return _compare(candidate, reference, rtol, rows, exact)


def _compare(
    candidate: Sequence[Tensor],
    reference: Sequence[Tensor],
    rtol: float,
    rows: Sequence[Tensor] | None,
    exact: Sequence[Tensor] | None,
) -> CheckResult:
    for r in [*reference, *(exact or [])]:
        if not bool(torch.isfinite(r).all()):
            raise EngineFault("the reference forward produced non-finite logits")
    scale = max(float(r.abs().max()) for r in reference)
    tol = rtol * scale
    target, noise = reference, 0.0
    if exact is not None:
        for step, (r, e) in enumerate(zip(reference, exact, strict=True)):
            if rows is not None:
                r, e = r[rows[step]], e[rows[step]]
            if r.numel():
                noise = max(noise, float((r - e).abs().max()))
        target, tol = exact, max(NOISE_FACTOR * noise, tol + noise)
    worst = 0.0
    for step, (c, r) in enumerate(zip(candidate, target, strict=True)):
        if c.shape != r.shape:
            return CheckResult(
                False,
                float("inf"),
                tol,
                f"step {step}: logits {list(c.shape)}, expected {list(r.shape)}",
            )
        if not bool(torch.isfinite(c).all()):
            return CheckResult(False, float("inf"), tol, f"step {step}: non-finite logits")
        if rows is not None:
            c, r = c[rows[step]], r[rows[step]]
            if not r.shape[0]:
                continue
        worst = max(worst, float((c - r).abs().max()))
        top = r.topk(2, dim=-1).values
        decisive = (top[..., 0] - top[..., 1]) > 2 * tol
        flipped = (c.argmax(-1) != r.argmax(-1)) & decisive
        if bool(flipped.any()):
            which = flipped.nonzero().flatten().tolist()
            return CheckResult(
                False, worst, tol, f"step {step}: a different next token for rows {which[:8]}"
            )
    if worst > tol:
        if exact is None:
            why = f"{rtol:g} x max |reference| = {tol:.3g}"
        else:
            why = (
                f"max({NOISE_FACTOR:g} x the reference's own error {noise:.3g}, {rtol:g} x max "
                f"|reference| + it) = {tol:.3g} (against the float32 exact forward)"
            )
        return CheckResult(False, worst, tol, f"max |error| {worst:.3g} exceeds {why}")
    return CheckResult(True, worst, tol)


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
