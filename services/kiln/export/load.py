"""``load_optimized``: a compilation's winner, rebuilt in the caller's process.

The model is built with the builder engines use (:func:`kiln.workloads.models.build_model`:
seeded random weights from the manifest's seed, or a local safetensors directory), the
candidate's code modules are loaded (:func:`kiln.runtime.reload.load_code_modules`), its
ops bound (:meth:`OpBinding.from_recipe`) and its transforms applied with the engine's own code
(:func:`kiln.runtime.transforms.apply_transforms`: ``threads``, ``torch_compile``,
``cuda_graph``). Like an engine, the KV cache is then filled with seeded random K/V and every
sequence set at the operating point's context (``batch_size`` sequences of ``context_len``
tokens), so :meth:`OptimizedModel.decode_step` runs at the shape the candidate was measured at
(and a ``cuda_graph`` is captured at it). A reference model over the same weights and cache
(reference ops) is kept for checks (:mod:`kiln.export.reproduce`).

Versions that differ from the manifest's ``environment`` give a :class:`VersionWarning`, not
an error.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.export.artifact import Artifact, ArtifactError, read_artifact

if TYPE_CHECKING:
    import torch

    from kiln.runtime.reload import RegistrySnapshot
    from kiln.runtime.transforms import AppliedTransforms
    from kiln.workloads.models import DecoderModel


class VersionWarning(UserWarning):
    """The loading process's versions (torch, CUDA, GPU...) differ from those the artifact was
    measured with: speed (and, rarely, numerics) may differ."""


class OptimizedModel:
    """The winner's forward in this process (see the module docstring).

    Attributes:
        artifact: what it was loaded from.
        model: the :class:`DecoderModel` bound to the candidate's ops, with its transforms.
        reference: a reference-ops model over the same weights and KV cache.
        device, dtype: where it runs.
        notes: what the transforms did, in words.
    """

    def __init__(
        self,
        artifact: Artifact,
        model: DecoderModel,
        reference: DecoderModel,
        applied: AppliedTransforms,
        registry: RegistrySnapshot,
        seed: int,
    ) -> None:
        self.artifact = artifact
        self.model = model
        self.reference = reference
        self.device = model.cache.lengths.device
        self.dtype = model.cache.k[0].dtype
        self.notes = list(applied.notes)
        self._applied = applied
        self._registry = registry
        self._seed = seed
        self._released = False

    @property
    def batch_size(self) -> int:
        """Decode batch of the operating point (sequences)."""
        return self.artifact.manifest.operating_point.batch_size

    @property
    def context_len(self) -> int:
        """Context of the operating point (tokens)."""
        return self.artifact.manifest.operating_point.context_len

    def _live(self) -> None:
        if self._released:
            raise RuntimeError("this OptimizedModel was released")

    def fill_operating_point(self) -> None:
        """Seeded random K/V (unit normal) in every cache slot and every sequence at
        ``context_len`` tokens, as an engine's measured model is
        (``kiln.runtime.engine.Engine._fill_cache``)."""
        import torch

        self._live()
        g = torch.Generator(device=self.device).manual_seed(self._seed + 1)
        cache = self.model.cache
        with torch.no_grad():
            for t in cache.k + cache.v:
                t.normal_(generator=g)
        self.at_operating_point()

    def at_operating_point(self) -> None:
        """Every sequence back at ``context_len`` tokens (cache contents untouched)."""
        import torch

        self._live()
        lengths = torch.full((self.batch_size,), self.context_len, dtype=torch.int64)
        self.model.cache.start(lengths.to(self.device), self.context_len)

    def prefill(self, tokens: torch.Tensor, seq_lens: torch.Tensor | None = None) -> torch.Tensor:
        """Start sequences from prompts.

        Args:
            tokens: ``[B, T]`` int64 right-padded prompts (B <= ``batch_size``).
            seq_lens: ``[B]`` int64 prompt lengths (all T when None).

        Returns:
            ``[B, V]`` float32 logits of the next token.

        Raises:
            CacheCapacityError: more sequences or tokens than the cache holds.
        """
        self._live()
        return self.model.prefill(tokens.to(self.device), seq_lens)

    def decode_step(self, tokens: torch.Tensor) -> torch.Tensor:
        """One token for every active sequence: ``[B, 1]`` int64 -> ``[B, V]`` float32 logits.
        A ``cuda_graph`` candidate replays its graph at ``B = batch_size`` after
        :meth:`at_operating_point` (other shapes run eagerly)."""
        self._live()
        return self.model.decode_step(tokens.to(self.device))

    def generate(self, tokens: torch.Tensor, steps: int) -> torch.Tensor:
        """Greedy continuation of ``[B, T]`` int64 prompts: ``[B, steps]`` int64 tokens.

        Raises:
            ValueError: ``steps`` < 1.
        """
        self._live()
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        return self.model.generate(tokens.to(self.device), steps=steps)

    def release(self) -> None:
        """Undo the transforms (threads, compiled forward, CUDA graph) and remove what the code
        modules registered from the process's op registry; the object is unusable afterwards.
        Idempotent."""
        if self._released:
            return
        self._released = True
        self._applied.revert()
        self._registry.restore()
        from kiln.runtime.reload import forget_sources

        forget_sources(self.artifact.candidate.code_modules)


def _dtype(name: str) -> torch.dtype:
    import torch

    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ArtifactError(f"unknown dtype {name!r}")
    return value


def load_optimized(
    artifact_dir: str | Path,
    *,
    weights: str | Path | None = None,
    device: str | None = None,
    dtype: str | None = None,
    max_seq_len: int | None = None,
) -> OptimizedModel:
    """Load an exported winner (see the module docstring).

    Args:
        artifact_dir: the artifact directory (``kiln export``).
        weights: a local directory of ``*.safetensors`` (HF names) to use instead of the
            manifest's weights source (seeded random, or the directory recorded).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"``; default the manifest's device type.
        dtype: ``float32`` / ``bfloat16`` / ``float16``; default the manifest's.
        max_seq_len: KV-cache tokens per sequence; default ``context_len + 1`` (the operating
            point), or more for :meth:`OptimizedModel.generate` on longer prompts.

    Returns:
        The model, at the operating point.

    Raises:
        ArtifactError: a bad artifact (:func:`kiln.export.artifact.read_artifact`).
        kiln.runtime.transforms.RejectedCandidate: an op, implementation or transform this
            kiln does not know, or ``cuda_graph`` on a CPU device.
        kiln.workloads.weights.WeightError: missing or mis-shaped weights.
        Exception: whatever a code module raises while loading.
    """
    import torch

    from kiln.ops.registry import OpLookupError
    from kiln.runtime.environment import differences, environment
    from kiln.runtime.reload import RegistrySnapshot, forget_sources, load_code_modules
    from kiln.runtime.transforms import RejectedCandidate, apply_transforms
    from kiln.workloads.config import parse_config
    from kiln.workloads.models import DecoderModel, OpBinding, build_model
    from kiln.workloads.models.binding import BindError, LossyImplementationError

    art = read_artifact(artifact_dir)
    m, op = art.manifest, art.manifest.operating_point
    dev = torch.device(device or op.device)
    dt = _dtype(dtype or op.dtype)
    diff = differences(m.environment, environment(str(dev)))
    if diff:
        warnings.warn(
            f"{art.path}: loading with {', '.join(diff)}; speed may differ from the recorded "
            f"{m.measured.tokens_per_s:,.1f} tokens/s",
            VersionWarning,
            stacklevel=2,
        )
    config = parse_config(art.model_config, m.model_name)
    if op.expert_zipf_exponent:
        config = config.with_expert_skew(op.expert_zipf_exponent)
    weights_dir: str | Path | None = weights
    if weights_dir is None and m.weights.kind == "safetensors":
        weights_dir = m.weights.path
    cache_len = max(op.context_len + 1, max_seq_len or 0)
    kwargs: dict[str, Any] = {"layers": op.layers, "dtype": dt, "device": dev}
    model = build_model(
        config,
        seed=m.weights.seed,
        weights_dir=weights_dir,
        max_batch=op.batch_size,
        max_seq_len=cache_len,
        **kwargs,
    )
    reference = DecoderModel(model.config, model.weights, model.cache)
    registry = RegistrySnapshot.take()
    candidate = art.candidate
    try:
        load_code_modules(candidate.code_modules)
        try:
            model.rebind(OpBinding.from_recipe(dict(candidate.ops), allow_lossy=candidate.lossy))
        except (OpLookupError, LossyImplementationError, BindError) as exc:
            raise RejectedCandidate(str(exc)) from exc
        from kiln.runtime.transforms import AppliedTransforms

        out = OptimizedModel(art, model, reference, AppliedTransforms(), registry, m.weights.seed)
        out.fill_operating_point()  # before the transforms: a CUDA graph captures at it
        applied = apply_transforms(model, candidate.transforms)
        out._applied, out.notes = applied, list(applied.notes)
        out.at_operating_point()
    except BaseException:
        registry.restore()
        forget_sources(candidate.code_modules)
        raise
    return out
