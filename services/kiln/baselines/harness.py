"""What every baseline shares: the operating point, kiln's weights and reference logits, the
check, the timed decode loop, freeing device memory, and each baseline module's ``run``.

One run (:func:`measure`): kiln's seeded (or given) weights; a seeded prompt ``[batch,
context]``; kiln's reference prefills and decodes one step (``[batch, V]`` float32 logits kept,
its model dropped); the baseline builds, prefills and runs its first decode step untimed,
compared by the fixed bound (``kiln.runtime.check.compare`` with the dtype's ``rtol``, plus the
reference's own error in reduced precision; candidates get the tighter float64-derived
tolerance); ``warmup`` untimed and ``steps`` timed decode steps; then
one untimed and ``prefill_repeats`` timed prefills.
"""

from __future__ import annotations

import functools
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.baselines.result import BaselineResult
from kiln.runtime import check
from kiln.runtime.exact import exact_model
from kiln.runtime.measurement import Timing
from kiln.runtime.state_guard import rtol_for
from kiln.runtime.timing import CpuTimer, CudaTimer, summarize, time_after_untimed, timer_for
from kiln.workloads.config import ModelConfig
from kiln.workloads.models import DecoderModel, build_model
from kiln.workloads.weights import WeightStore, seeded_random

Tensor = torch.Tensor
COMPILE_MODE = "reduce-overhead"
"""The default ``torch.compile`` mode of the compiled baselines (CUDA graphs on CUDA)."""
PREFILL_REPEATS = 3
"""Timed prefills of a baseline unless told (the CUDA engines' ``prefill_repeats``)."""


class SkipBaseline(Exception):
    """The baseline cannot run here; the message is its ``skipped_reason``."""


@dataclass
class BaselineSetup:
    """Where a baseline is measured and on what.

    Attributes:
        batch, context: sequences decoded together; prompt tokens prefilled first.
        seed: of the weights (when drawn here), prompt and decode tokens.
        steps, warmup: timed and untimed decode steps after the checked one.
        prefill_repeats: timed prefills after the decode timing (<= 0: none).
        prompt: ``[batch, context]`` int64; tokens: ``[1 + warmup + steps, batch, 1]`` int64
            (checked step first); both on ``device``.
    """

    config: ModelConfig
    batch: int
    context: int
    device: torch.device
    dtype: torch.dtype
    seed: int
    steps: int
    warmup: int
    weights: WeightStore
    prefill_repeats: int = PREFILL_REPEATS
    prompt: Tensor = field(init=False)
    tokens: Tensor = field(init=False)

    def __post_init__(self) -> None:
        if self.batch < 1 or self.context < 1 or self.steps < 1 or self.warmup < 0:
            raise ValueError(
                f"batch {self.batch}, context {self.context}, steps {self.steps}: expected "
                f"positive numbers and warmup >= 0 (got {self.warmup})"
            )
        g = torch.Generator().manual_seed(self.seed + 11)
        vocab = self.config.vocab_size
        self.prompt = torch.randint(vocab, (self.batch, self.context), generator=g).to(self.device)
        n = 1 + self.warmup + self.steps
        self.tokens = torch.randint(vocab, (n, self.batch, 1), generator=g).to(self.device)

    @property
    def cache_len(self) -> int:
        """KV slots per sequence a baseline needs: the prompt plus every decode step."""
        return self.context + 1 + self.warmup + self.steps

    def position(self, step: int) -> int:
        """``context + step`` (step 0 is the checked one)."""
        return self.context + step


def baseline_setup(
    config: ModelConfig,
    *,
    batch: int,
    context: int,
    device: torch.device | str,
    dtype: torch.dtype,
    seed: int,
    steps: int,
    warmup: int,
    weights: WeightStore | None = None,
    prefill_repeats: int = PREFILL_REPEATS,
) -> BaselineSetup:
    """A :class:`BaselineSetup`, drawing kiln's seeded weights when none are given.

    Raises:
        ValueError: non-positive batch, context or steps, or negative warmup.
        kiln.workloads.weights.WeightError: a layout kiln cannot draw.
    """
    dev = torch.device(device)
    store = weights if weights is not None else seeded_random(config, dtype, dev, seed)
    return BaselineSetup(
        config, batch, context, dev, dtype, seed, steps, warmup, store, prefill_repeats
    )


def reference_model(point: BaselineSetup, max_seq_len: int) -> DecoderModel:
    """kiln's reference ``DecoderModel`` over the point's weights, with ``max_seq_len`` cache
    slots.
    """
    return build_model(
        point.config,
        weights=point.weights,
        dtype=point.dtype,
        device=point.device,
        max_batch=point.batch,
        max_seq_len=max_seq_len,
    )


def reference_logits(point: BaselineSetup) -> tuple[Tensor, Tensor | None]:
    """kiln's reference prefill and first decode step: ``[batch, V]`` float32 logits, and in
    reduced precision the float64-arithmetic ones (else None).
    """
    model = reference_model(point, point.context + 1)
    model.prefill(point.prompt)
    logits = model.decode_step(point.tokens[0]).float().clone()
    exact = None
    if point.dtype in (torch.bfloat16, torch.float16):
        batch = point.prompt.shape[0]
        view = exact_model(model, max_batch=batch, max_len=point.context + 1)
        view.prefill(point.prompt)
        exact = view.decode_step(point.tokens[0]).clone()
        del view
    del model
    return logits, exact


def compare(
    got: Tensor, want: Tensor, dtype: torch.dtype, exact: Tensor | None = None
) -> tuple[bool, float, float]:
    """``(correct, max_abs_error, tolerance)`` of ``got`` vs ``want`` (``[batch, V]``) by the
    fixed bound; non-finite values are an error of ``inf``. ValueError when the shapes differ.
    """
    if got.shape != want.shape:
        raise ValueError(f"logits of shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    verdict = check.compare(
        [got.float()], [want], rtol_for(dtype), exact=None if exact is None else [exact]
    )
    return verdict.correct, verdict.max_abs_error, verdict.tolerance


def free(device: torch.device) -> None:
    """Collect garbage and give cached device memory back."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass
class Runner:
    """What a baseline supplies to :func:`measure`: ``prefill(prompt [batch, context])``,
    ``step(token [batch, 1], position) -> logits [batch, V]`` (any float dtype) and notes in
    words.
    """

    prefill: Callable[[Tensor], None]
    step: Callable[[Tensor, int], Tensor]
    notes: list[str] = field(default_factory=list)


Build = Callable[[BaselineSetup], Runner]
"""A baseline's build function: makes its model and caches for the point."""


def compiled(
    fn: Callable[..., Any], compile_mode: str | None, label: str, purpose: str = ""
) -> tuple[Callable[..., Any], str]:
    """``(fn compiled with fullgraph, how in words)``, or ``(fn, "eager (no compile)")`` when
    ``compile_mode`` is empty.
    """
    if not compile_mode:
        return fn, "eager (no compile)"
    how = f"torch.compile({label}, mode={compile_mode!r}, fullgraph=True){purpose}"
    return torch.compile(fn, mode=compile_mode, fullgraph=True), how


def time_prefill(
    point: BaselineSetup, runner: Runner, timer: CpuTimer | CudaTimer
) -> tuple[Timing | None, str]:
    """``(timing in ms, note)`` of one untimed and ``prefill_repeats`` timed prefills; ``(None,
    "")`` with no repeats, ``(None, why)`` when it raised.
    """
    if point.prefill_repeats <= 0:
        return None, ""
    call = functools.partial(runner.prefill, point.prompt)
    try:
        samples = time_after_untimed(timer, call, point.prefill_repeats)
    except Exception as exc:
        return None, f"prefill not timed: {type(exc).__name__}: {exc}"
    timing = summarize(samples, 1)
    return timing, (
        f"prefill timed: {point.batch} prompts of {point.context} tokens, "
        f"{point.prefill_repeats} times after one untimed: median {timing.median_ms:.4g} ms"
    )


def measure(name: str, point: BaselineSetup, build: Build) -> BaselineResult:
    """Run one baseline (see the module docstring); ``build`` is called after the reference is
    dropped.

    :class:`SkipBaseline` makes the result skipped; any other exception goes to ``error``. Device
    memory is freed either way.
    """
    batch, context = point.batch, point.context
    notes = [
        f"operating point: batch {point.batch}, context {point.context} tokens, "
        f"{point.config.num_hidden_layers} layers, {str(point.dtype).removeprefix('torch.')} "
        f"on {point.device}"
    ]
    runner: Runner | None = None
    try:
        want, exact = reference_logits(point)
        free(point.device)
        t0 = time.perf_counter()
        runner = build(point)
        notes += runner.notes
        with torch.no_grad():
            runner.prefill(point.prompt)
            first = runner.step(point.tokens[0], point.position(0)).float().clone()
            correct, err, tol = compare(first, want, point.dtype, exact)
            for i in range(1, 1 + point.warmup):
                runner.step(point.tokens[i], point.position(i))
            timer = timer_for(point.device)
            timer.sync()
            notes.append(
                f"build, prefill, checked step and {point.warmup} warm-up step(s): "
                f"{time.perf_counter() - t0:.1f} s"
            )
            samples = []
            step = runner.step
            for i in range(1 + point.warmup, 1 + point.warmup + point.steps):
                call = functools.partial(step, point.tokens[i], point.position(i))
                samples.append(timer.time_ms(call))
            del step, call
            prefill, prefill_note = time_prefill(point, runner, timer)
            if prefill_note:
                notes.append(prefill_note)
    except SkipBaseline as exc:
        return BaselineResult.skipped(name, str(exc), notes=notes, batch=batch, context=context)
    except Exception as exc:
        return BaselineResult(
            name=name,
            error=f"{type(exc).__name__}: {exc}",
            notes=notes,
            batch=batch,
            context=context,
        )
    finally:
        runner = None  # drop the baseline's model and caches before freeing
        free(point.device)
    timing = summarize(samples, point.warmup)
    if not correct:
        notes.append(
            f"INCORRECT: first decode step differs from kiln's reference by {err:.4g} "
            f"(tolerance {tol:.4g})"
        )
    return BaselineResult(
        name=name,
        tokens_per_s=timing.per_second(point.batch),
        median_ms=timing.median_ms,
        p10_ms=timing.p10_ms,
        p90_ms=timing.p90_ms,
        mean_ms=timing.mean_ms,
        max_ms=timing.max_ms,
        steps=len(samples),
        notes=notes,
        correct=correct,
        max_abs_error=err,
        tolerance=tol,
        batch=batch,
        context=context,
        prefill_median_ms=prefill.median_ms if prefill else 0.0,
        prefill_p10_ms=prefill.p10_ms if prefill else 0.0,
        prefill_p90_ms=prefill.p90_ms if prefill else 0.0,
    )


def run_baseline(
    name: str,
    build: Build,
    config: ModelConfig,
    *,
    batch: int,
    context: int,
    device: torch.device | str,
    dtype: torch.dtype,
    seed: int,
    steps: int,
    warmup: int,
    weights: WeightStore | None = None,
    precheck: Callable[[ModelConfig], None] | None = None,
    prefill_repeats: int = PREFILL_REPEATS,
) -> BaselineResult:
    """:func:`baseline_setup` then :func:`measure`, after ``precheck(config)``, which may raise
    :class:`SkipBaseline` before any weight is drawn. ValueError on a bad setup.
    """
    if precheck is not None:
        try:
            precheck(config)
        except SkipBaseline as exc:
            return BaselineResult.skipped(name, str(exc), batch=batch, context=context)
    point = baseline_setup(
        config,
        batch=batch,
        context=context,
        device=device,
        dtype=dtype,
        seed=seed,
        steps=steps,
        warmup=warmup,
        weights=weights,
        prefill_repeats=prefill_repeats,
    )
    return measure(name, point, build)


RUN_DOC = """Measure {measures} (see the module docstring).

Args:
    config: the architecture (all layers built).
    batch, context: the operating point (sequences; prompt tokens prefilled).
    device, dtype: where and in what precision.
    seed: of the weights (when not given) and of the prompt and tokens.
    steps, warmup: timed and untimed decode steps.
    weights: kiln's weights to use (drawn from ``seed`` when None).
    prefill_repeats: timed prefills of the prompt after the decode timing (0: none).{option}

Returns:
    The result; *skipped* {skipped}.

Raises:
    ValueError: non-positive batch, context or steps.
"""


class Baseline:
    """A baseline module's ``run(config, *, batch, context, device, dtype, seed, steps, warmup,
    weights=None, prefill_repeats=...)``: :func:`run_baseline` with its name, build and precheck.
    ``measures``, ``skipped``, ``option``: its docstring's lines.
    """

    def __init__(
        self,
        name: str,
        build: Build,
        *,
        precheck: Callable[[ModelConfig], None] | None = None,
        measures: str,
        skipped: str,
        option: str = "",
    ) -> None:
        self.name = name
        self.build = build
        self.precheck = precheck
        self.__doc__ = RUN_DOC.format(measures=measures, option=option, skipped=skipped)

    def __call__(
        self,
        config: ModelConfig,
        *,
        batch: int,
        context: int,
        device: torch.device | str,
        dtype: torch.dtype,
        seed: int,
        steps: int,
        warmup: int,
        weights: WeightStore | None = None,
        prefill_repeats: int = PREFILL_REPEATS,
    ) -> BaselineResult:
        return run_baseline(
            self.name,
            self.build,
            config,
            batch=batch,
            context=context,
            device=device,
            dtype=dtype,
            seed=seed,
            steps=steps,
            warmup=warmup,
            weights=weights,
            precheck=self.precheck,
            prefill_repeats=prefill_repeats,
        )


class CompiledBaseline(Baseline):
    """A compiled baseline's ``run(..., compile_mode=COMPILE_MODE)``, building with
    ``builder(compile_mode)`` (None: eager); ``compiles`` says what it compiles.
    """

    def __init__(
        self,
        name: str,
        builder: Callable[[str | None], Build],
        *,
        precheck: Callable[[ModelConfig], None] | None = None,
        measures: str,
        skipped: str,
        compiles: str,
    ) -> None:
        option = f"\n    compile_mode: ``torch.compile`` mode of {compiles}; None runs it eager."
        super().__init__(
            name,
            builder(COMPILE_MODE),
            precheck=precheck,
            measures=measures,
            skipped=skipped,
            option=option,
        )
        self.builder = builder

    def __call__(
        self,
        config: ModelConfig,
        *,
        batch: int,
        context: int,
        device: torch.device | str,
        dtype: torch.dtype,
        seed: int,
        steps: int,
        warmup: int,
        weights: WeightStore | None = None,
        prefill_repeats: int = PREFILL_REPEATS,
        compile_mode: str | None = COMPILE_MODE,
    ) -> BaselineResult:
        return run_baseline(
            self.name,
            self.builder(compile_mode),
            config,
            batch=batch,
            context=context,
            device=device,
            dtype=dtype,
            seed=seed,
            steps=steps,
            warmup=warmup,
            weights=weights,
            precheck=self.precheck,
            prefill_repeats=prefill_repeats,
        )
