"""A persistent engine: a model built once, then many candidates hot-reloaded into it.

Built once (:class:`Engine`):

- the weights (a :class:`~kiln.workloads.weights.WeightStore`, read or drawn once);
- the *reference* model over them (reference ops, bound at build time, so nothing a candidate
  registers can change it), with a small KV cache (``check_batch`` x prompt + steps) for the
  correctness check;
- the *measured* model over the same weights, with a KV cache of ``batch_size`` sequences x
  ``cache_len`` slots, filled to ``context_len`` tokens (the traffic shape's operating point);
- a reference model over the measured model's cache, for the check at the traffic shape.

Per candidate (:meth:`Engine.run`), phases timed in ms:

1. ``load``: execute its code modules in fresh namespaces (they register implementations);
2. ``bind``: what :func:`~kiln.engine_pool.support.support_for` says does not apply to the
   model on this device is REJECTED with its reason; then ``OpBinding.from_recipe(candidate.ops)``
   and ``model.rebind`` (derived layouts come from the weight store's cache: no weight is read
   again), then its transforms;
3. ``compile``: ``warmup`` (at least one) untimed decode steps at the traffic shape (graph
   compilation lands here); the first one's logits are kept for the check, so the step checked
   at the traffic shape is one the candidate cannot tell from a warm-up or timed step;
4. ``check``: the reference's step at the traffic shape (full batch and context) against the
   kept logits; then fresh random prompts (``check_batch`` of them), prefill + ``check_steps``
   decode steps, candidate then reference (on its own copy of the inputs), outputs poisoned
   between calls; on an MoE model routing-aware, with every MoE layer also checked on the
   reference's own inputs (:mod:`~kiln.engine_pool.moe_check`);
5. ``measure``: timed decode steps at (batch_size, context_len) — ``min_repeats`` to
   ``repeats`` of them within ``measure_budget_s`` — median, p10, p90, stdev;
   tokens/s = batch_size / median_s. The previous output is poisoned before each call; after
   each call returns (outside the timed interval) a random choice keeps a copy of its output
   (:class:`~kiln.engine_pool.check.TimedOutputs`), and no thread may still be running
   candidate code (else INCORRECT: work outside the timed call);
6. ``verify``: the reference's step on each kept timed step's token (``verify_timed_steps``,
   default 1), at the same cache state, against the kept copy.

Around all of it (:mod:`kiln.engine_pool.integrity`): the engine's code, reference models,
timer and numerics flags are fingerprinted before the candidate loads and compared after; a
change (or a candidate thread still running) makes the experiment INCORRECT whatever the
gate said, is put back, and restarts the engine. :mod:`kiln.engine_pool.red_team` holds the
cheating candidates this is tested against.

An exception in any phase makes the experiment CRASHED (with the exception and the tail of its
traceback); an unknown op, implementation or transform, or one the support statement refuses,
makes it REJECTED. Either way the engine
is put back afterwards: transforms undone, the op registry restored, the measured model re-bound
to the reference ops, derived layouts a code module introduced dropped, and (after code
modules) the weights verified unchanged (identity, address, sampled contents) and the cache
refilled. When that cannot be guaranteed the measurement asks for a restart
(``restart_engine``).
"""

from __future__ import annotations

import functools
import gc
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kiln.engine_pool.check import (
    LOSSY_RTOL,
    RTOL,
    CheckInputs,
    CheckResult,
    EngineFault,
    OutputGuard,
    TimedOutputs,
    compare,
    run_steps,
)
from kiln.engine_pool.device_memory import (
    activation_bytes_per_sequence,
    fit_batch,
    free_bytes,
    peak_allocated,
    reset_peak,
)
from kiln.engine_pool.environment import environment
from kiln.engine_pool.exact import exact_model, exact_step
from kiln.engine_pool.integrity import (
    AttributeSnapshot,
    HarnessFingerprint,
    OutsideWork,
    ThreadWatch,
)
from kiln.engine_pool.measurement import Measurement, MemoryUsage, Timing
from kiln.engine_pool.moe_check import RoutedCheck
from kiln.engine_pool.op_profile import profile_decode_step, profile_fields
from kiln.engine_pool.reload import RegistrySnapshot, forget_sources, load_code_modules
from kiln.engine_pool.request import RunRequest
from kiln.engine_pool.spec import EngineSpec
from kiln.engine_pool.support import support_for
from kiln.engine_pool.timing import summarize, time_after_untimed, timer_for
from kiln.engine_pool.transforms import AppliedTransforms, RejectedCandidate, apply_transforms
from kiln.ops import registry
from kiln.ops.registry import REFERENCE, OpLookupError
from kiln.workloads.candidate import Candidate
from kiln.workloads.models import DecoderModel, OpBinding, build_model
from kiln.workloads.models.binding import BindError, LossyImplementationError

Tensor = torch.Tensor
TRACEBACK_CHARS = 1500
SAMPLES_PER_TENSOR = 1 << 16
MODEL_BINDING = ("binding", "ops")
"""Attributes of the measured model hot reload swaps (everything else only transforms may set,
and they undo it)."""
ENGINE_ATTRIBUTES = (
    "reference",
    "shape_reference",
    "model",
    "weights",
    "timer",
    "spec",
    "_context",
    "_protected",
    "_base",
    "_sample",
    "_registry",
)
"""The engine's attributes no experiment reassigns (fingerprinted by :meth:`Engine._attempt`)."""


@contextmanager
def _timed(phases: dict[str, float], name: str, sync: Callable[[], None]) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        sync()
        phases[name] = (time.perf_counter() - start) * 1e3


def _compare(
    got: list[Tensor],
    want: list[Tensor],
    rtol: float,
    rows: list[Tensor] | None,
    exact: list[Tensor] | None,
) -> CheckResult:
    """:func:`~kiln.engine_pool.check.compare`, with ``rows`` and ``exact`` only when given."""
    extra = {k: v for k, v in (("rows", rows), ("exact", exact)) if v is not None}
    return compare(got, want, rtol, **extra)


def _crash_text(phase: str, exc: BaseException) -> str:
    tail = "".join(traceback.format_exception(exc))[-TRACEBACK_CHARS:]
    return f"{phase}: {type(exc).__name__}: {exc}\n{tail}"


class Engine:
    """The model state of one engine process (see the module docstring).

    Args:
        spec: what to build.
        engine_id: reported with every measurement.

    Attributes:
        build_s: seconds the build took (weights, caches, warm-up), in this process.
        build_phases_s: the build split into ``weights``, ``models``, ``cache``, ``warm``.

    Raises:
        kiln.workloads.models.UnbuildableModelError, kiln.workloads.weights.WeightError,
        ValueError: the spec cannot be built (see :func:`kiln.workloads.models.build_model`).
    """

    _fingerprint: HarnessFingerprint | None = None
    """The pristine engine's fingerprint, taken before its first candidate loads (see
    :meth:`_attempt`)."""

    def __init__(self, spec: EngineSpec, engine_id: str = "") -> None:
        start = time.perf_counter()
        self.spec = spec
        self.engine_id = engine_id
        self.device = torch.device(spec.device)
        self.dtype: torch.dtype = getattr(torch, spec.dtype)
        self.timer = timer_for(self.device)
        self.build_phases_s: dict[str, float] = {}
        config = spec.model_config()
        common: dict[str, Any] = {"layers": spec.layers, "dtype": self.dtype, "device": self.device}
        t = time.perf_counter()
        self.reference = build_model(
            config,
            seed=spec.seed,
            weights_dir=spec.weights_dir,
            max_batch=spec.check_batch,
            max_seq_len=spec.prompt_len + spec.check_steps,
            **common,
        )
        self.weights = self.reference.weights
        self.build_phases_s["weights"] = time.perf_counter() - t
        t = time.perf_counter()
        if self.device.type == "cuda":
            spec = self.spec = fit_batch(spec, config, free_bytes(self.device))
        self.model = build_model(
            config,
            weights=self.weights,
            max_batch=spec.batch_size,
            max_seq_len=spec.cache_len,
            **common,
        )
        self.shape_reference = DecoderModel(self.model.config, self.weights, self.model.cache)
        self.vocab = self.model.config.vocab_size
        self.build_phases_s["models"] = time.perf_counter() - t
        t = time.perf_counter()
        self._context = torch.full((spec.batch_size,), spec.context_len, dtype=torch.int64)
        self._context = self._context.to(self.device)
        self._fill_cache()
        self.build_phases_s["cache"] = time.perf_counter() - t
        self._base = {name: (tensor, tensor.data_ptr()) for name, tensor in self.weights.items()}
        self._sample = self._weights_sample()
        self._protected = {t.untyped_storage().data_ptr() for _, t in self.weights.items()}
        for cache in (self.model.cache, self.reference.cache):
            self._protected |= {t.untyped_storage().data_ptr() for t in cache.k + cache.v}
        self.warm_notes: list[str] = []
        self._registry = RegistrySnapshot.take()
        self._collect = False
        self._threads = torch.get_num_threads()
        t = time.perf_counter()
        self._warm()
        self.build_phases_s["warm"] = time.perf_counter() - t
        self.build_s = time.perf_counter() - start

    # ------------------------------------------------------------------ state
    def _fill_cache(self) -> None:
        """Random K/V (seeded, unit normal) in every slot, sequences at ``context_len``."""
        g = torch.Generator(device=self.device).manual_seed(self.spec.seed + 1)
        cache = self.model.cache
        with torch.no_grad():
            for t in cache.k + cache.v:
                t.normal_(generator=g)
        self._at_context()

    def _at_context(self) -> None:
        """Every sequence of the measured model at ``context_len`` tokens (buffers untouched)."""
        self.model.cache.start(self._context, self.spec.context_len)

    def _weights_sample(self) -> dict[str, Tensor]:
        """A copy of every base weight's elements at a fixed stride (about
        :data:`SAMPLES_PER_TENSOR` each): milliseconds to take and compare, any dtype, exact.
        Whole-tensor writes (``mul_``, ``fill_``, ``copy_``...) always show; a write to a few
        elements may fall between samples."""
        out: dict[str, Tensor] = {}
        with torch.no_grad():
            for name, t in self.weights.items():
                flat = t.detach().reshape(-1)
                out[name] = flat[:: max(1, flat.numel() // SAMPLES_PER_TENSOR)].clone()
        return out

    def weights_intact(self) -> bool:
        """True when every base weight is the same tensor at the same address, with the same
        sampled contents as at build time (see :meth:`_weights_sample`)."""
        for name, (tensor, ptr) in self._base.items():
            if self.weights.get(name) is not tensor or tensor.data_ptr() != ptr:
                return False
        now = self._weights_sample()
        return all(torch.equal(now[name], sample) for name, sample in self._sample.items())

    def _warm(self) -> None:
        """A decode step at the traffic shape and a check prefill, with the reference ops and
        then with each built-in non-lossy alternative that runs on this device, so first-use
        costs (allocator, kernel selection, loading cuDNN / flash-attention kernels, cuBLAS
        handles: about 0.9 s for the first SDPA call on an H200; Triton's compilation) and the
        built-in derived weight layouts (fused QKV, gate/up) belong to the build, not to the
        first experiment that uses them. An alternative that fails here is noted in
        :attr:`warm_notes` and left to its experiments.
        """
        tokens = torch.zeros((self.spec.batch_size, 1), dtype=torch.int64, device=self.device)
        prompt = torch.zeros(
            (self.spec.check_batch, self.spec.prompt_len), dtype=torch.int64, device=self.device
        )
        self.shape_reference.decode_step(tokens)
        self.reference.prefill(prompt)
        self._at_context()
        kind = self.device.type
        alternatives = {
            op: [
                n
                for n in registry.implementations(op)
                if n != REFERENCE
                and not registry.get(op, n).lossy
                and registry.get(op, n).runs_on(kind)  # Triton kernels only where they compile
            ]
            for op in registry.ops()
        }
        rounds = max((len(names) for names in alternatives.values()), default=0)
        for i in range(rounds):
            recipe = {op: names[i] for op, names in alternatives.items() if i < len(names)}
            try:
                binding = OpBinding.from_recipe(recipe)
                model = DecoderModel(self.model.config, self.weights, self.model.cache, binding)
                model.decode_step(tokens)
                self._at_context()
                # the check's candidate prefill runs on the measured model's cache: same shapes
                # here (cuDNN attention plans are built per shape, ~0.7 s each on an H200)
                model.prefill(prompt)
            except Exception as exc:  # a built-in alternative that cannot run here
                self.warm_notes.append(f"warm-up of {recipe}: {type(exc).__name__}: {exc}")
            finally:
                self._at_context()
        if rounds:
            self._fill_cache()  # the warm prefills wrote the first slots of the measured cache
        self.timer.sync()

    def after_reply(self) -> None:
        """Work the next experiment needs done but the last one's result need not wait for:
        a full garbage collection after a candidate that loaded code modules or compiled
        (its functions, graphs and compiled code hold device memory until collected); tens
        of milliseconds with torch loaded. The worker calls it once the result is sent."""
        if self._collect:
            self._collect = False
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def memory(self) -> MemoryUsage:
        """Bytes held: base weights, both KV caches, and workspace. On CUDA the workspace is
        measured: the peak PyTorch allocated since the experiment (or the build) began, less
        weights and caches (derived layouts, activations, CUDA graph pools, compiled code's
        buffers). On CPU it is derived layouts plus an estimate of one decode step's
        activations (:func:`~kiln.engine_pool.device_memory.activation_bytes_per_sequence`)."""
        weights = self.weights.nbytes()
        kv = self.model.cache.nbytes() + self.reference.cache.nbytes()
        peak = peak_allocated(self.device)
        if peak is not None:
            workspace = max(0, peak - weights - kv)
        else:
            elem = torch.empty((), dtype=self.dtype).element_size()
            per_seq = activation_bytes_per_sequence(self.model.config, self.spec.cache_len, elem)
            workspace = self.weights.derived_nbytes() + self.spec.batch_size * per_seq
        return MemoryUsage(weights_bytes=weights, kv_cache_bytes=kv, workspace_bytes=workspace)

    def info(self) -> dict[str, Any]:
        """What the worker reports once built."""
        return {
            "build_s": self.build_s,
            "build_phases_s": self.build_phases_s,
            "memory": self.memory().__dict__,
            "threads": self._threads,
            "warm_notes": self.warm_notes,
        }

    # ------------------------------------------------------------------ one experiment
    def run(self, request: RunRequest) -> Measurement:
        """Hot-reload the candidate, check it, time it, and put the engine back.

        Never raises for a candidate's fault: it is a CRASHED / REJECTED / INCORRECT
        measurement. Raises only what the worker should die of (KeyboardInterrupt).
        """
        started = time.perf_counter()
        base: dict[str, Any] = {
            "engine_id": self.engine_id,
            "tier": self.spec.tier,
            "environment": {
                **environment(self.spec.device),
                "dtype": str(self.dtype).removeprefix("torch."),
            },
            "batch_size": self.spec.batch_size,
            "context_len": self.spec.context_len,
        }
        reset_peak(self.device)
        if request.baseline:  # a baseline of kiln.baselines instead of the candidate
            from kiln.baselines.in_engine import measure_baseline

            self._collect = True  # its models and compiled graphs: collected after the reply
            result = measure_baseline(self, request, base)
            result.device_ms = (time.perf_counter() - started) * 1e3
            return result
        try:
            candidate = Candidate.from_canonical(request.candidate)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            return Measurement.failed("rejected", f"malformed candidate: {exc!r}", **base)
        base["candidate_id"] = candidate.id
        phases: dict[str, float] = {}
        spec = self.spec
        notes = [
            *spec.notes,
            f"operating point: batch {spec.batch_size}, context {spec.context_len} tokens, "
            f"{spec.layers}/{spec.total_layers} layers, {spec.dtype} on {spec.device}",
            f"check seed {request.seed}",
        ]
        applied = AppliedTransforms()
        derived_before = {name for name, _ in self.weights.derived_keys()}
        try:
            result = self._attempt(candidate, request, phases, notes, applied, base)
        finally:
            problem = self._restore(candidate, applied, derived_before)
        if problem:
            result.restart_engine = True
            result.notes.append(f"engine restarts after this experiment: {problem}")
        result.device_ms = (time.perf_counter() - started) * 1e3
        return result

    def _attempt(
        self,
        candidate: Candidate,
        request: RunRequest,
        phases: dict[str, float],
        notes: list[str],
        applied: AppliedTransforms,
        base: dict[str, Any],
    ) -> Measurement:
        """The gate (:meth:`_gate`) under the watches of :mod:`kiln.engine_pool.integrity`:
        the engine's code and numerics flags fingerprinted before the candidate loads and
        compared after, the measured model's own attributes compared, threads running candidate
        code looked for. Any of those makes the experiment INCORRECT (whatever the gate said),
        puts back what was changed, and asks for a restart. The fingerprint is kept from one
        experiment to the next and refreshed before each candidate loads (what changed in
        between, e.g. torch's lazy imports, is noted and becomes the baseline). Cost: one
        dump of the dispatcher's tables (~50 ms on a 2-core VM) and ~1 ms of attributes each
        to refresh and to compare."""
        fingerprint = self._fingerprint
        if fingerprint is None:
            fingerprint = self._fingerprint = HarnessFingerprint.take(self._watched())
        else:
            between = fingerprint.refresh(self._watched())
            if between:
                notes.append(f"changed since the last experiment: {'; '.join(between[:4])}")
        model = AttributeSnapshot("engine.model", self.model, True, ignore=MODEL_BINDING).take()
        tampered: list[str] = []
        result = self._gate(candidate, request, phases, notes, applied, base, model, tampered)
        tampered += fingerprint.changes()
        tampered += model.changes()
        strays = ThreadWatch().strays(new_threads=False)
        if not tampered and not strays:
            return result
        problems = fingerprint.restore()
        try:
            model.restore()
        except (TypeError, AttributeError) as exc:
            problems.append(f"engine.model: {exc}")
        why = []
        if tampered:
            why.append(f"changed the engine outside its ops: {'; '.join(tampered[:8])}")
        if strays:
            why.append(f"left threads running candidate code: {'; '.join(strays[:4])}")
        said = result.error.removeprefix(f"{result.status}: ")
        before = f" (gate said {result.status}: {said})" if result.status != "ok" else ""
        out_notes = result.notes or notes
        out_notes.append("engine restarts after this experiment: " + "; ".join(why))
        if problems:
            out_notes.append(f"could not put back: {'; '.join(problems[:4])}")
        return Measurement(
            status="incorrect",
            max_abs_error=result.max_abs_error,
            error=f"incorrect: {' and '.join(why)}{before}",
            memory=result.memory,
            phases_ms=phases,
            notes=out_notes,
            restart_engine=True,
            **base,
        )

    def _watched(self) -> Iterator[tuple[str, object, tuple[str, ...] | None]]:
        """The engine's own objects a candidate must leave alone (for the fingerprint): the
        engine's references to its models, weights and timer; both reference models, their
        bound ops and caches; the timer."""
        yield "engine", self, ENGINE_ATTRIBUTES
        for label, ref in (
            ("reference", self.reference),
            ("shape_reference", self.shape_reference),
        ):
            yield f"engine.{label}", ref, None
            yield f"engine.{label}.ops", ref.ops, None
            for i, layer in enumerate(ref.ops.layers):
                yield f"engine.{label}.ops.layers[{i}]", layer, None
            yield f"engine.{label}.cache", ref.cache, ("k", "v", "lengths")
        yield "engine.timer", self.timer, None

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
        rtol = LOSSY_RTOL if candidate.lossy else RTOL[self.dtype]
        g = torch.Generator().manual_seed(request.seed + 1)
        tokens = torch.randint(
            self.vocab, (request.warmup + request.repeats, spec.batch_size, 1), generator=g
        )
        steps = tokens.to(self.device, copy=True)  # the candidate's; ``tokens`` stays ours
        phase = "load"
        try:
            with _timed(phases, "load", sync):
                load_code_modules(candidate.code_modules)
            loaded = list(model.changes())
            if loaded:
                tampered += loaded
                model.restore()
            phase = "bind"
            with _timed(phases, "bind", sync):
                # what this engine runs for the model (after the code modules registered
                # theirs): the statement the agents' search space is restricted to
                support = support_for(self.spec.model_config(), self.device.type)
                refusal = support.refusal(candidate)
                if refusal is not None:
                    raise RejectedCandidate(refusal)
                try:
                    binding = OpBinding.from_recipe(
                        dict(candidate.ops), allow_lossy=candidate.lossy
                    )
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
            if candidate.lossy:
                notes.append(f"lossy: checked to {LOSSY_RTOL:g} x max |reference|")
            phase = "compile"
            guard = OutputGuard(self._protected)
            with _timed(phases, "compile", sync):
                # The first step at the traffic shape is checked (in the check phase); the
                # candidate cannot tell it from the timed steps that follow.
                token = self._shape_token(request.seed)
                self._at_context()
                first = run_steps([functools.partial(self.model.decode_step, token)], guard)
                for i in range(1, request.warmup):
                    self._at_context()
                    self.model.decode_step(steps[i])
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
            if not verified.correct:
                median = summarize(samples, request.warmup).median_ms
                notes.append(f"timed median {median:.4g} ms (not reported: incorrect)")
                return self._incorrect(verified, phases, notes, base)
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
                lambda: profile_decode_step(
                    self.model, self._shape_token(request.seed), self._at_context, self.dtype
                ),
                notes,
                phases,
            )
        except RejectedCandidate as exc:
            return Measurement.failed("rejected", f"{phase}: {exc}", phases_ms=phases, **base)
        except OutsideWork as exc:
            return Measurement.failed(
                "incorrect",
                f"incorrect: work outside the timed call: {exc}",
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
        timing = summarize(samples, request.warmup)
        return Measurement(
            status="ok",
            correct=True,
            max_abs_error=max(verdict.max_abs_error, verified.max_abs_error),
            timing=timing,
            tokens_per_s=spec.batch_size / (timing.median_ms / 1e3) if timing.median_ms else 0.0,
            prefill=prefill,
            prefill_tokens_per_s=(
                spec.batch_size * spec.context_len / (prefill.median_ms / 1e3)
                if prefill and prefill.median_ms
                else 0.0
            ),
            memory=self.memory(),
            phases_ms=phases,
            notes=notes,
            **profiled,
            **base,
        )

    def _time_prefill(self, repeats: int, seed: int) -> list[float]:
        """Prefill of ``batch_size`` random prompts of ``context_len`` tokens on the measured
        model (the candidate's ops): one untimed, then ``repeats`` timed, ms each. The cache is
        put back at the operating point afterwards (its first slots now hold real K/V).

        Raises:
            whatever the candidate's prefill raises (the experiment is then CRASHED).
        """
        spec = self.spec
        g = torch.Generator().manual_seed(seed + 3)
        prompts = torch.randint(self.vocab, (spec.batch_size, spec.context_len), generator=g)
        prompts = prompts.to(self.device)
        call = functools.partial(self.model.prefill, prompts)
        try:
            return time_after_untimed(self.timer, call, repeats)
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
            error=f"incorrect: {verdict.reason}",
            memory=self.memory(),
            phases_ms=phases,
            notes=notes,
            **base,
        )

    def _time(
        self, request: RunRequest, steps: Tensor, guard: OutputGuard, kept: TimedOutputs
    ) -> list[float]:
        """Timed decode steps at the operating point, ms each: at least ``min_repeats``, at most
        ``repeats``, stopping early once ``measure_budget_s`` of timed steps have run.

        Args:
            request: the experiment (repeats, budget).
            steps: ``[repeats, batch_size, 1]`` int64 tokens, one step each.
            guard: the candidate's output guard: the previous output is poisoned before each
                call (outside the timed interval).
            kept: offered each step's output right after its call returns, outside the timed
                interval (on CUDA: on the current stream, before the device-wide sync).

        Raises:
            OutsideWork: after a call returned, a thread was still running candidate code or a
                thread started during the call was still alive.
        """
        samples: list[float] = []
        budget_ms = request.measure_budget_s * 1e3
        threads = ThreadWatch()

        def keep(step: int, out: object) -> Callable[[], None] | None:
            guard.hold(out)
            return kept.offer(step, out)

        for i in range(request.repeats):
            self._at_context()
            guard.poison()
            guard.release()
            step = functools.partial(self.model.decode_step, steps[i])
            samples.append(self.timer.time_ms(step, functools.partial(keep, i)))
            strays = threads.strays()
            if strays:
                raise OutsideWork(f"after timed step {i + 1} returned: {'; '.join(strays[:4])}")
            enough = len(samples) >= request.min_repeats
            if enough and budget_ms > 0 and sum(samples) >= budget_ms:
                break
        guard.poison()
        guard.release()
        return samples

    def _verify(
        self, kept: TimedOutputs, tokens: Tensor, rtol: float, timed: int, notes: list[str]
    ) -> CheckResult:
        """The reference's decode step on each kept timed step's token, at the same cache state
        (every timed step starts at ``context_len``), against the kept logits.

        Args:
            kept: the timed steps' outputs kept (see :class:`~kiln.engine_pool.check.TimedOutputs`).
            tokens: ``[repeats, batch_size, 1]`` int64 on the CPU: the engine's own copy of the
                timed steps' tokens (a candidate writing into its input changes only its copy).
            rtol: relative tolerance.
            timed: how many timed steps ran (for the message).
            notes: the measurement's notes (an MoE model's routing-aware comparison adds one).

        Cost: one reference decode step at the traffic shape per kept step (two in reduced
        precision: the float32 exact one too).
        """
        ref_guard = OutputGuard(self._protected)
        worst, tolerance = 0.0, 0.0
        moe = RoutedCheck(self.shape_reference, rtol, lossy=rtol == LOSSY_RTOL)
        for step, got in kept.kept():
            self._at_context()
            token = tokens[step].to(self.device)
            exact = self._exact([functools.partial(exact_step, self.shape_reference, token)])
            ref = moe.record(self.shape_reference, "timed step")
            want = run_steps([functools.partial(ref.decode_step, token)], ref_guard)
            verdict = _compare([got], want, rtol, moe.rows(ref), exact)
            if not verdict.correct:
                reason = verdict.reason.removeprefix("step 0: ")
                return CheckResult(
                    False,
                    verdict.max_abs_error,
                    verdict.tolerance,
                    f"timed step {step + 1} of {timed} (verified after timing): {reason}",
                )
            worst, tolerance = max(worst, verdict.max_abs_error), verdict.tolerance
        ref_guard.poison()
        self._at_context()
        if moe.applies and kept.kept():
            notes.append(f"moe, verified timed steps: {moe.rows_note()}")
        return CheckResult(True, worst, tolerance)

    @property
    def _reduced_precision(self) -> bool:
        """bfloat16 / float16: comparisons also run the float32 exact forward."""
        return self.dtype in (torch.bfloat16, torch.float16)

    def _exact(self, calls: list[Callable[[], object]]) -> list[Tensor] | None:
        """The float32 exact forward's logits of ``calls`` in reduced precision, else None."""
        if not self._reduced_precision:
            return None
        return run_steps(calls, OutputGuard(self._protected))

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
        """Compare the candidate against the reference forward.

        Args:
            seed: the experiment's check seed (fresh inputs every experiment).
            rtol: relative tolerance (see :mod:`kiln.engine_pool.check`).
            at_shape: the candidate's logits of its first step at the traffic shape (full batch,
                full context; ``[[batch_size, V]]`` float32), on :meth:`_shape_token`, taken
                right before this call with nothing run since.
            guard: the candidate's output guard (its outputs are poisoned before each call).
            notes: the measurement's notes (an MoE model's routing-aware check adds one).

        The reference runs the same step at the traffic shape (same cache contents: each step
        writes its own K/V before attending), then candidate and reference each run a prefill
        of ``check_batch`` fresh right-padded prompts and ``check_steps`` decode steps. The
        reference gets its own copy of every input (drawn again from the seed), so a candidate
        that writes into its inputs cannot steer the reference.

        On an MoE model the comparisons are routing-aware and every MoE layer is also checked on
        the reference's own inputs (:mod:`kiln.engine_pool.moe_check`).
        """
        spec = self.spec
        ref_guard = OutputGuard(self._protected)
        self._at_context()
        token = self._shape_token(seed)
        moe = RoutedCheck(self.reference, rtol, lossy=rtol == LOSSY_RTOL)
        exact = self._exact([functools.partial(exact_step, self.shape_reference, token)])
        ref = moe.record(self.shape_reference, "at the traffic shape")
        want = run_steps([functools.partial(ref.decode_step, token)], ref_guard)
        shape_verdict = _compare(at_shape, want, rtol, moe.rows(ref), exact)
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

        got = run_steps(calls(self.model), guard)
        exact = None
        if self._reduced_precision:
            cache = self.reference.cache
            fresh = exact_model(self.reference, max_batch=cache.max_batch, max_len=cache.max_len)
            exact = self._exact(calls(fresh))
        ref = moe.record(self.reference, "check prefill/decode")
        want = run_steps(calls(ref), ref_guard)
        guard.poison()
        ref_guard.poison()
        self._at_context()
        verdict = _compare(got, want, rtol, moe.rows(ref), exact)
        if not verdict.correct:
            return verdict
        if exact is not None:
            notes.append(
                f"{self.dtype} check against the float32 exact forward: tolerance "
                f"{shape_verdict.tolerance:.3g} at the traffic shape, {verdict.tolerance:.3g} "
                f"on fresh prompts (max |error| {shape_verdict.max_abs_error:.3g}, "
                f"{verdict.max_abs_error:.3g})"
            )
        if moe.applies:
            layers = moe.check_layers(self.model)
            if not layers.correct:
                return layers
            notes.append(moe.note())
        worst = max(verdict.max_abs_error, shape_verdict.max_abs_error)
        return CheckResult(True, worst, verdict.tolerance)

    def _restore(
        self, candidate: Candidate, applied: AppliedTransforms, derived_before: set[str]
    ) -> str:
        """Put the engine back after a candidate; returns why it needs a restart, or ""."""
        problem = ""
        try:
            applied.revert()
            torch.set_num_threads(self._threads)
            if candidate.code_modules:
                forget_sources(candidate.code_modules)
            if not self._registry.restore():
                problem = "a code module registered a reference implementation"
            if candidate.code_modules:
                for name in {n for n, _ in self.weights.derived_keys()} - derived_before:
                    self.weights.drop_derived(name)
            self.model.rebind(OpBinding.from_recipe())
            if candidate.code_modules:
                if not self.weights_intact():
                    problem = "the candidate modified the engine's weights"
                self._fill_cache()
            self._at_context()
            self._collect = self._collect or bool(candidate.code_modules or applied.compiled)
        except Exception as exc:
            problem = f"restoring the engine failed: {type(exc).__name__}: {exc}"
        return problem
