"""kiln: continual compilation for AI inference.

The engine (models, ops, engines) must stay importable without the service dependencies
(gRPC, NATS, SQLAlchemy), so this package imports nothing at module level.
"""

__version__ = "0.1.0"
