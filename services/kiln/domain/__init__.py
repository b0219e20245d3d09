"""kiln's domain model: the facts every service shares, with no gRPC, NATS, SQLAlchemy or torch.

- :mod:`kiln.domain.operating_point`: the (batch, context, ISL, OSL) a measurement or a
  prediction is made at, derived once from a traffic shape and an engine's limits.
- :mod:`kiln.domain.streams`: ledger stream names (``compilation-<id>``, ``experiment-<id>``).
- :mod:`kiln.domain.compilation`: the compilation aggregate, one fold of a compilation's
  events (status machine, counters) for the runner, the Compiler API and the projection.
"""
