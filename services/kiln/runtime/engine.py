"""A persistent engine: a model built once, then many candidates hot-reloaded into it (design:
docs/design/engine.md, "Engine").

Built once (:class:`Engine`): the weights (:class:`~kiln.workloads.weights.WeightStore`); the
*reference* model (reference ops bound at build time) with a small check cache; the *measured* model
over the same weights with ``batch_size`` x ``cache_len`` slots filled to ``context_len``; a
reference over the measured cache for the traffic-shape check. Per candidate (:meth:`Engine.run`):
the gate's phases (:mod:`kiln.runtime.gate`, :mod:`kiln.runtime.gate_check`) under the watches of
:mod:`kiln.runtime.integrity` (a change makes the experiment INCORRECT and restarts the engine).
Afterwards the engine is always put back (transforms undone, registry restored, reference ops
re-bound, derived layouts dropped; after code modules the weights verified by content,
:mod:`kiln.runtime.state_guard`, and the cache refilled), or the measurement asks for a restart
(``restart_engine``).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kiln.domain.candidate import Candidate
from kiln.ops import registry
from kiln.ops.registry import REFERENCE
from kiln.runtime.attributes import AttributeSnapshot
from kiln.runtime.device_memory import (
    activation_bytes_per_sequence,
    fit_batch,
    free_bytes,
    peak_allocated,
    reset_peak,
)
from kiln.runtime.engine_sandbox import EngineSandbox
from kiln.runtime.environment import environment
from kiln.runtime.integrity import HarnessFingerprint
from kiln.runtime.measurement import Measurement, MemoryUsage
from kiln.runtime.reload import RegistrySnapshot, forget_sources
from kiln.runtime.request import RunRequest
from kiln.runtime.sandbox.host import SandboxHost
from kiln.runtime.sandbox.memory import SharedWeights
from kiln.runtime.sandbox.model import SandboxModel
from kiln.runtime.spec import EngineSpec
from kiln.runtime.state_guard import (
    StateGuard,
    reference_tensors,
    restore_tolerances,
    tolerance_changes,
)
from kiln.runtime.thread_watch import ThreadWatch
from kiln.runtime.timing import timer_for
from kiln.runtime.transforms import AppliedTransforms
from kiln.workloads.models import DecoderModel, OpBinding, build_model

ExternalMeasure = Callable[[Any, RunRequest, dict[str, Any]], Measurement]
"""``(engine, request, base) -> Measurement``: what :meth:`Engine.run_external` runs."""
MODEL_BINDING = ("binding", "ops")
"""Attributes of the measured model hot reload swaps (only transforms may set others, and they undo
it).
"""
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
    "_state",
    "_registry",
)
"""The engine's attributes no experiment reassigns (fingerprinted by :meth:`Engine._attempt`)."""


class Engine(EngineSandbox):
    """The model state of one engine process (module docstring).

    Args:
        spec: what to build. engine_id: reported with every measurement.
        sandbox: run code-module candidates in a sandbox process
            (:mod:`kiln.runtime.sandbox`); False runs them in this process, as recipes are
            (for comparisons and tests of the in-process watches only).

    Attributes:
        build_s: seconds the build took, in this process; build_phases_s: split into ``weights``,
            ``models``, ``cache``, ``warm``.

    Raises:
        kiln.workloads.models.UnbuildableModelError, kiln.workloads.weights.WeightError, ValueError:
            the spec cannot be built.
    """

    _fingerprint: HarnessFingerprint | None = None
    """The pristine engine's fingerprint, taken before its first candidate loads."""
    _dispatch_unchecked = False
    """A recipe ran here since the dispatcher was last checked (sandboxed engines check it
    after the reply: :meth:`after_reply`)."""

    def __init__(self, spec: EngineSpec, engine_id: str = "", *, sandbox: bool = True) -> None:
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
        # before any address is recorded: on CPU this moves the weights into a sealed memfd; on
        # CUDA the weights are exported on the first code-module candidate (:meth:`_host`)
        self._sandboxed = sandbox
        self._share_error = ""
        cpu = self.device.type == "cpu"
        self._shared = SharedWeights(self.weights) if sandbox and cpu else None
        self._sandbox: SandboxHost | None = None
        self._deadline = 0.0
        self._deadline_s = 0.0
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
        self._measured: DecoderModel | SandboxModel = self.model
        self.vocab = self.model.config.vocab_size
        self.build_phases_s["models"] = time.perf_counter() - t
        t = time.perf_counter()
        self._context = torch.full((spec.batch_size,), spec.context_len, dtype=torch.int64)
        self._context = self._context.to(self.device)
        self._fill_cache()
        self.build_phases_s["cache"] = time.perf_counter() - t
        self._base = {name: (tensor, tensor.data_ptr()) for name, tensor in self.weights.items()}
        models = (("reference", self.reference), ("shape_reference", self.shape_reference))
        self._state = StateGuard(
            [*reference_tensors(models, self.weights), ("engine._context", self._context)],
            keyed=self.device.type == "cuda",
        )
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
        """Random K/V (seeded, unit normal) in every slot, sequences at ``context_len``: the same
        content each time, so whatever a candidate wrote there is gone (the gate refills before
        each reference step on this cache and before the timed steps).
        """
        g = torch.Generator(device=self.device).manual_seed(self.spec.seed + 1)
        cache = self.model.cache
        with torch.no_grad():
            for t in cache.k + cache.v:
                t.normal_(generator=g)
        self.model.cache.start(self._context, self.spec.context_len)
        measured = getattr(self, "_measured", None)
        if isinstance(measured, SandboxModel):
            measured.fill()  # the sandbox's own cache, filled alike

    def _at_context(self) -> None:
        """Every sequence of the measured model (and the sandbox's, when the candidate runs
        there) at ``context_len`` tokens (buffers untouched)."""
        self.model.cache.start(self._context, self.spec.context_len)
        if isinstance(self._measured, SandboxModel):
            self._measured.at_context()

    def weights_intact(self) -> bool:
        """True when every base weight is the same tensor at the same address as at build time,
        and every tensor the reference reads has its recorded content
        (:class:`~kiln.runtime.state_guard.StateGuard`).
        """
        for name, (tensor, ptr) in self._base.items():
            if self.weights.get(name) is not tensor or tensor.data_ptr() != ptr:
                return False
        return not self._state.changes()

    def _warm(self) -> None:
        """A decode step at the traffic shape and a check prefill with the reference ops, then with
        each built-in non-lossy alternative on this device, so first-use costs and built-in derived
        layouts belong to the build. An alternative that fails is noted in :attr:`warm_notes`.
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

    def after_reply(self) -> str:
        """Work the next experiment needs but the last result need not wait for: a full garbage
        collection after a candidate that loaded code modules or compiled, and (sandboxed
        engines) the dispatcher check of the recipe just measured. The worker calls it once the
        result is sent. Returns why the engine must restart ("" when it need not).
        """
        if self._sandbox is not None:
            self._sandbox.settle()
            self._sandbox.prewarm()  # a replaced sandbox starts now, not in the next experiment
        if self._collect:
            self._collect = False
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        if not (self._dispatch_unchecked and self._fingerprint is not None):
            return ""
        self._dispatch_unchecked = False
        dispatch = self._fingerprint.dispatch
        changed = dispatch.changes()
        if not changed:
            return ""
        left = dispatch.restore()
        return f"a recipe changed dispatcher kernels: {'; '.join(changed[:4])}" + (
            f" (still replaced: {'; '.join(left[:2])})" if left else ""
        )

    def memory(self) -> MemoryUsage:
        """Bytes held: base weights, both KV caches, and workspace (CUDA: the peak allocated since
        the experiment or build began, less weights and caches; CPU: derived layouts plus
        :func:`~kiln.runtime.device_memory.activation_bytes_per_sequence` of one step).
        """
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
    def _measurement_fields(self, request: RunRequest) -> dict[str, Any]:
        """The fields every measurement of this engine carries, ``request``'s candidate id
        included (a baseline's measurement names the baseline instead)."""
        return {
            "candidate_id": request.candidate.id,
            "engine_id": self.engine_id,
            "tier": self.spec.tier,
            "environment": {
                **environment(self.spec.device),
                "dtype": str(self.dtype).removeprefix("torch."),
            },
            "batch_size": self.spec.batch_size,
            "context_len": self.spec.context_len,
        }

    def run_external(self, request: RunRequest, measure: ExternalMeasure) -> Measurement:
        """Measure something other than a candidate (a baseline's forward) on this engine's weights
        and operating point: ``measure(engine, request, base)``, ``base`` the common measurement
        fields; its models are collected after the reply.
        """
        started = time.perf_counter()
        base = self._measurement_fields(request)
        reset_peak(self.device)
        self._collect = True
        result = measure(self, request, base)
        result.device_ms = (time.perf_counter() - started) * 1e3
        return result

    def run(self, request: RunRequest) -> Measurement:
        """Hot-reload the candidate, check it, time it, and put the engine back.

        Never raises for a candidate's fault (CRASHED / REJECTED / INCORRECT measurement); raises
        only what the worker should die of (KeyboardInterrupt).
        """
        started = time.perf_counter()
        base = self._measurement_fields(request)
        if request.baseline:
            message = f"baseline {request.baseline!r}: measured through run_external, not run"
            return Measurement.failed("rejected", message, **base)
        if self._sandboxed and request.candidate.code_modules and self._host() is None:
            message = (
                "code modules run only in a sandbox, and this engine cannot share its weights "
                f"with one ({self._share_error})"
            )
            return Measurement.failed("rejected", message, **base)
        reset_peak(self.device)
        candidate = request.candidate
        phases: dict[str, float] = {}
        spec = self.spec
        notes = [
            *spec.notes,
            *self.weights.notes,  # e.g. a quantized checkpoint dequantized at load
            f"operating point: batch {spec.batch_size}, context {spec.context_len} tokens, "
            f"{spec.layers}/{spec.total_layers} layers, {spec.dtype} on {spec.device}",
            f"check seed {request.seed}",
        ]
        applied = AppliedTransforms()
        derived_before = {name for name, _ in self.weights.derived_keys()}
        self._deadline = time.monotonic() + request.deadline_s if request.deadline_s > 0 else 0.0
        self._deadline_s = request.deadline_s
        host = self._sandbox_for(candidate, request)
        sandboxed = host is not None
        try:
            result = self._attempt(candidate, request, phases, notes, applied, base)
            t = time.perf_counter()
            result = self._end_sandbox(result, base, host)
            if sandboxed:
                result.phases_ms["sandbox_end"] = (time.perf_counter() - t) * 1e3
        except BaseException:
            if host is not None:
                host.discard()  # its check cannot run now: a fresh sandbox for the next one
            raise
        finally:
            self._measured = self.model
            t = time.perf_counter()
            problem = self._restore(candidate, applied, derived_before, sandboxed)
            restore_ms = (time.perf_counter() - t) * 1e3
        result.phases_ms["restore"] = restore_ms
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
        """The gate (:meth:`_gate`), for a candidate run in this process under
        :mod:`kiln.runtime.integrity`'s watches (code and numerics
        fingerprint, the measured model's attributes, candidate threads): any change makes the
        experiment INCORRECT, is put back, and asks for a restart. The fingerprint is refreshed
        before each candidate loads (changes in between are noted); so is the state guard's key
        (CUDA), whose attributes are watched too. The public tolerance table is watched by content
        (:func:`~kiln.runtime.state_guard.tolerance_changes`).
        """
        t = time.perf_counter()
        self._state.begin()
        phases["state_begin"] = (time.perf_counter() - t) * 1e3
        if self._sandbox_for(candidate, request) is not None:
            # no candidate code runs in this process: nothing here for the watches to see
            model = AttributeSnapshot("engine.model", self.model, True, ignore=MODEL_BINDING)
            return self._gate(candidate, request, phases, notes, applied, base, model, [])
        t = time.perf_counter()
        between = tolerance_changes()
        restore_tolerances()
        # Sandboxed, only recipes (library code) run here: the dispatcher is checked after the
        # reply (after_reply), not on the result's path.
        scan = not self._sandboxed
        fingerprint = self._fingerprint
        if fingerprint is None:
            fingerprint = self._fingerprint = HarnessFingerprint.take(self._watched())
        else:
            between += fingerprint.refresh(self._watched(), dispatch=scan)
        self._dispatch_unchecked = not scan
        if between:
            notes.append(f"changed since the last experiment: {'; '.join(between[:4])}")
        model = AttributeSnapshot("engine.model", self.model, True, ignore=MODEL_BINDING).take()
        state = AttributeSnapshot("engine._state", self._state, True).take()
        watches_ms = (time.perf_counter() - t) * 1e3
        tampered: list[str] = []
        result = self._gate(candidate, request, phases, notes, applied, base, model, tampered)
        t = time.perf_counter()
        tampered += fingerprint.changes(dispatch=scan)
        tampered += model.changes()
        tampered += state.changes()
        tampered += tolerance_changes()
        strays = ThreadWatch().strays(new_threads=False)
        result.phases_ms["watches"] = watches_ms + (time.perf_counter() - t) * 1e3
        if not tampered and not strays:
            return result
        problems = fingerprint.restore()
        restore_tolerances()
        for snapshot in (model, state):
            try:
                snapshot.restore()
            except (TypeError, AttributeError) as exc:
                problems.append(f"{snapshot.label}: {exc}")
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
        """The engine's objects a candidate must leave alone: its references to models, weights,
        timer and state guard; both reference models, their bound ops and caches.
        """
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

    def _restore(
        self,
        candidate: Candidate,
        applied: AppliedTransforms,
        derived_before: set[str],
        sandboxed: bool = False,
    ) -> str:
        """Put the engine back after a candidate; returns why it needs a restart, or "".
        ``sandboxed``: its code ran in the sandbox (the weights are checked here only where the
        sandbox could write them: CUDA IPC)."""
        problem = ""
        here = bool(candidate.code_modules) and not sandboxed
        try:
            applied.revert()
            torch.set_num_threads(self._threads)
            if here:
                forget_sources(candidate.code_modules)
            if not self._registry.restore():
                problem = "a code module registered a reference implementation"
            if here:
                for name in {n for n, _ in self.weights.derived_keys()} - derived_before:
                    self.weights.drop_derived(name)
            self.model.rebind(OpBinding.from_recipe())
            if here or (sandboxed and self.device.type == "cuda"):
                if not self.weights_intact():
                    problem = "the candidate modified the engine's weights"
                self._fill_cache()
            self._at_context()
            self._collect = self._collect or bool(here or applied.compiled)
        except Exception as exc:
            problem = f"restoring the engine failed: {type(exc).__name__}: {exc}"
        return problem
