"""Correctness of a candidate: its logits against the reference forward's on fresh inputs.

Every experiment draws new random prompts (right-padded, lengths varying across the batch) and
decode tokens from its own seed, runs the candidate first and the reference second on the same
inputs, and compares every step's logits. Before each call the outputs already returned are
poisoned (filled with NaN), so a candidate that hands back a stale tensor fails instead of
passing with the previous answer.

Tolerance (``max |candidate - reference| <= rtol x max |reference|`` over all checked logits,
and the same argmax wherever the reference's top-2 margin exceeds twice that):

=========  ======  ==========================================================================
dtype      rtol    why
=========  ======  ==========================================================================
float32    1e-3    summation order only (observed <= 1e-6)
bfloat16   5e-2    ``attention=sdpa`` vs the float32-accumulating reference drifts 3.3e-2 on
                   Llama-3.2-1B at full depth (16 layers, batch 8, context 512; 2.6e-2 on
                   short prompts); the fused projections and norms match exactly
float16    1e-2    10 mantissa bits (8x finer than bfloat16)
=========  ======  ==========================================================================

Lossy candidates (opted in) are held to :data:`LOSSY_RTOL` and labelled as such.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

Tensor = torch.Tensor

RTOL: dict[torch.dtype, float] = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 1e-2}
LOSSY_RTOL = 1e-1


class EngineFault(RuntimeError):
    """The engine itself is broken (the reference produced non-finite logits): restart it."""


@dataclass(frozen=True)
class CheckInputs:
    """Fresh inputs of one check.

    Attributes:
        tokens: ``[B, P]`` int64 prompts, right-padded.
        seq_lens: ``[B]`` int64 prompt lengths in ``[ceil(P/2), P]`` (row 0 is P).
        decode: ``[steps, B, 1]`` int64 tokens fed to the decode steps.
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
    """Verdict of one comparison.

    Attributes:
        correct: within tolerance, same decisive argmax, shapes equal, all finite.
        max_abs_error: largest ``|candidate - reference|`` (``inf`` for non-finite outputs or
            mismatched shapes).
        tolerance: the absolute bound applied (``rtol x max |reference|``).
        reason: why not correct (empty when correct).
    """

    correct: bool
    max_abs_error: float
    tolerance: float
    reason: str = ""


class OutputGuard:
    """Holds the logits a model returned and poisons them (NaN) before its next call.

    Args:
        protected: storage addresses never to poison (weights, KV caches): a candidate that
            returns a view of engine state must not get the engine's state overwritten.
    """

    def __init__(self, protected: set[int]) -> None:
        self._protected = protected
        self._held: list[Tensor] = []

    def hold(self, out: object) -> None:
        """Remember ``out`` (a floating tensor not aliasing engine state) for poisoning."""
        if isinstance(out, Tensor) and out.is_floating_point():
            if out.untyped_storage().data_ptr() not in self._protected:
                self._held.append(out)

    def poison(self) -> None:
        """Fill every held output with NaN."""
        with torch.no_grad():
            for t in self._held:
                t.fill_(float("nan"))

    def release(self) -> None:
        """Forget the held outputs."""
        self._held.clear()


def _copy(out: object) -> Tensor:
    if not isinstance(out, Tensor):
        raise TypeError(f"the forward returned {type(out).__name__}, not a tensor of logits")
    return out.detach().float().clone()


def run_steps(calls: Sequence[Callable[[], object]], guard: OutputGuard) -> list[Tensor]:
    """Run each call (prefill, then decode steps) with poisoning; float32 copies of the outputs.

    Raises:
        TypeError: a call returned something other than a tensor.
    """
    outs: list[Tensor] = []
    for call in calls:
        guard.poison()
        out = call()
        outs.append(_copy(out))
        guard.hold(out)
    return outs


def compare(candidate: Sequence[Tensor], reference: Sequence[Tensor], rtol: float) -> CheckResult:
    """Compare step by step (each ``[B, V]`` float32).

    Raises:
        EngineFault: the reference's logits are not finite.
    """
    for r in reference:
        if not bool(torch.isfinite(r).all()):
            raise EngineFault("the reference forward produced non-finite logits")
    scale = max(float(r.abs().max()) for r in reference)
    tol = rtol * scale
    worst = 0.0
    for step, (c, r) in enumerate(zip(candidate, reference, strict=True)):
        if c.shape != r.shape:
            return CheckResult(
                False,
                float("inf"),
                tol,
                f"step {step}: logits {list(c.shape)}, expected {list(r.shape)}",
            )
        if not bool(torch.isfinite(c).all()):
            return CheckResult(False, float("inf"), tol, f"step {step}: non-finite logits")
        worst = max(worst, float((c - r).abs().max()))
        top = r.topk(2, dim=-1).values
        decisive = (top[..., 0] - top[..., 1]) > 2 * tol
        flipped = (c.argmax(-1) != r.argmax(-1)) & decisive
        if bool(flipped.any()):
            rows = flipped.nonzero().flatten().tolist()
            return CheckResult(
                False, worst, tol, f"step {step}: a different next token for rows {rows[:8]}"
            )
    if worst > tol:
        return CheckResult(
            False,
            worst,
            tol,
            f"max |error| {worst:.3g} exceeds {rtol:g} x max |reference| = {tol:.3g}",
        )
    return CheckResult(True, worst, tol)
