"""Exporting a compilation's winner as a standalone artifact and loading it back.

- :mod:`kiln.export.artifact`: the artifact directory (``manifest.json``, candidate, model
  config, code modules) and its pydantic manifest;
- :mod:`kiln.export.load`: :func:`~kiln.export.load.load_optimized`, the model with the winner's
  ops and transforms, in the caller's process;
- :mod:`kiln.export.reproduce`: ``python -m kiln.export.reproduce ARTIFACT``, recorded vs
  measured tokens/s and the correctness check;
- :mod:`kiln.export.from_ledger`: the artifact of a compilation's best, from its events.

Imports nothing at module level (torch stays unloaded until a model is loaded).
"""
