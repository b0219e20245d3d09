"""``load_optimized``: a compilation's winner, rebuilt in the caller's process.

The model is built as engines build it, the candidate's code modules loaded, its ops bound and
its transforms applied with the engine's own code; the KV cache is filled as an engine's, at the
operating point, so :meth:`OptimizedModel.decode_step` runs at the shape the candidate was
measured at. A reference model over the same weights and cache is kept for checks. Versions that
differ from the manifest's give a :class:`VersionWarning`, not an error.

Code modules run in the caller's process, so nothing loads before the artifact's signature is
checked (:mod:`kiln.export.signing`) and everything loaded comes from the bytes it checked.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.export.artifact import (
    Artifact,
    ArtifactError,
    artifact_root,
    parse_artifact,
    read_files,
)

if TYPE_CHECKING:
    import torch
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from kiln.runtime.reload import RegistrySnapshot
    from kiln.runtime.transforms import AppliedTransforms
    from kiln.workloads.models import DecoderModel


class VersionWarning(UserWarning):
    """This process's versions (torch, CUDA, GPU...) differ from the artifact's: speed may
    differ.
    """


class OptimizedModel:
    """The winner's forward in this process: ``model`` bound to the candidate's ops with its
    transforms, ``reference`` over the same weights and KV cache, ``notes`` on the transforms.
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
        """Seeded unit-normal K/V in every cache slot and every sequence at ``context_len``, as
        an engine's.
        """
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
        """Start sequences from ``tokens [B, T]`` int64 right-padded prompts (B <=
        ``batch_size``; ``seq_lens [B]``, None: all T): ``[B, V]`` float32 logits.
        CacheCapacityError when it does not fit.
        """
        self._live()
        return self.model.prefill(tokens.to(self.device), seq_lens)

    def decode_step(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[B, 1]`` int64 -> ``[B, V]`` float32 logits; a ``cuda_graph`` replays at ``B =
        batch_size`` after :meth:`at_operating_point` (other shapes run eagerly).
        """
        self._live()
        return self.model.decode_step(tokens.to(self.device))

    def generate(self, tokens: torch.Tensor, steps: int) -> torch.Tensor:
        """Greedy continuation of ``[B, T]`` int64 prompts: ``[B, steps]`` int64; ValueError if
        steps < 1.
        """
        self._live()
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        return self.model.generate(tokens.to(self.device), steps=steps)

    def release(self) -> None:
        """Undo the transforms and unregister what the code modules registered; idempotent, and
        the object is unusable afterwards.
        """
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


def read_verified(
    artifact_dir: str | Path,
    trusted_keys: Mapping[str, Ed25519PublicKey] | str | Path | Iterable[str | Path] | None = None,
    verify: bool = True,
) -> Artifact:
    """The artifact, its signature checked first unless ``verify`` is False.

    ``trusted_keys``: key id -> public key, or a path or paths of PEM public keys (files, or
    directories of ``*.pub``); None: :func:`kiln.export.signing.default_trusted_keys`.

    Raises:
        kiln.export.signing.SignatureError: unsigned, signed by an unknown key, or altered.
        ArtifactError: a bad artifact.
    """
    root = artifact_root(artifact_dir)
    if not verify:
        return parse_artifact(root, read_files(root))
    from kiln.export import signing

    if trusted_keys is None:
        keys: Mapping[str, Ed25519PublicKey] = signing.default_trusted_keys()
    elif isinstance(trusted_keys, Mapping):
        keys = trusted_keys
    elif isinstance(trusted_keys, str | Path):
        keys = signing.load_public_keys([trusted_keys])
    else:
        keys = signing.load_public_keys(trusted_keys)
    return parse_artifact(root, signing.verify_artifact(root, keys))


def load_optimized(
    artifact_dir: str | Path,
    *,
    weights: str | Path | None = None,
    device: str | None = None,
    dtype: str | None = None,
    max_seq_len: int | None = None,
    trusted_keys: Mapping[str, Ed25519PublicKey] | str | Path | Iterable[str | Path] | None = None,
    verify: bool = True,
) -> OptimizedModel:
    """Load an exported winner, at its operating point.

    Args:
        weights: a ``*.safetensors`` directory (HF names) instead of the manifest's weights.
        device, dtype: default the manifest's.
        max_seq_len: KV-cache tokens per sequence; default ``context_len + 1``.
        trusted_keys: the keys whose signature is accepted (see :func:`read_verified`); by
            default the state directory's ``pki/signing.pub`` and ``KILN_TRUSTED_KEYS``.
        verify: False loads an unsigned or altered artifact, and runs its code modules here:
            only for one whose origin you trust (artifacts exported before signing).

    Raises:
        kiln.export.signing.UnsignedArtifact, UnknownSigningKey, AlteredArtifact: the signature
            check refused it (nothing was loaded).
        ArtifactError: a bad artifact.
        kiln.runtime.transforms.RejectedCandidate: an op, implementation or transform this kiln
            does not know, or ``cuda_graph`` on a CPU.
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

    art = read_verified(artifact_dir, trusted_keys, verify)
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
