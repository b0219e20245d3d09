"""kiln: continual compilation for AI inference.

The engine (models, ops, engines) must stay importable without the service dependencies
(gRPC, NATS, SQLAlchemy), so this package imports nothing at module level.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kiln.export.load import load_optimized

__version__ = "0.2.0"
__all__ = ["__version__", "load_optimized"]


def __getattr__(name: str) -> Any:
    """``kiln.load_optimized`` (:func:`kiln.export.load.load_optimized`), imported on first
    use so that ``import kiln`` stays light (PEP 562)."""
    if name == "load_optimized":
        from kiln.export.load import load_optimized

        return load_optimized
    raise AttributeError(f"module 'kiln' has no attribute {name!r}")
