"""Exporting a compilation's winner as a standalone artifact and loading it back.

- :mod:`kiln.export.artifact`: the artifact directory (``manifest.json``, candidate, model
  config, code modules) and its pydantic manifest;
- :mod:`kiln.export.signing`: the deployment's Ed25519 key, an artifact's ``signature.json``,
  the trusted keys, and the errors of a refused artifact (:class:`SignatureError`:
  :class:`UnsignedArtifact`, :class:`UnknownSigningKey`, :class:`AlteredArtifact`, also
  importable from here);
- :mod:`kiln.export.load`: :func:`~kiln.export.load.load_optimized`, the model with the winner's
  ops and transforms, in the caller's process, once its signature is checked;
- :mod:`kiln.export.reproduce`: ``python -m kiln.export.reproduce ARTIFACT``, recorded vs
  measured tokens/s and the correctness check;
- :mod:`kiln.export.from_ledger`: the artifact of a compilation's best, from its events.

Imports nothing at module level (torch stays unloaded until a model is loaded).
"""

from __future__ import annotations

from typing import Any

_ERRORS = ("SignatureError", "UnsignedArtifact", "UnknownSigningKey", "AlteredArtifact")
__all__ = ["ArtifactError", *_ERRORS]


def __getattr__(name: str) -> Any:
    """The artifact errors (PEP 562: imported on first use)."""
    if name == "ArtifactError":
        from kiln.export.artifact import ArtifactError

        return ArtifactError
    if name in _ERRORS:
        from kiln.export import signing

        return getattr(signing, name)
    raise AttributeError(f"module 'kiln.export' has no attribute {name!r}")
