"""kiln's domain model: the facts every service shares, with no gRPC, NATS, SQLAlchemy or torch.

- :mod:`kiln.domain.operating_point`: the (batch, context, ISL, OSL) a measurement or a
  prediction is made at, derived once from a traffic shape and an engine's limits.
- :mod:`kiln.domain.streams`: ledger stream names (``compilation-<id>``, ``experiment-<id>``).
- :mod:`kiln.domain.compilation`: the compilation aggregate, one fold of a compilation's
  events (status machine, counters) for the runner, the Compiler API and the projection.
- :mod:`kiln.domain.experiment`: one experiment's request and completion as plain data, and
  the fold of a compilation's experiments.
- :mod:`kiln.domain.judging`: the tiers, the runner's own agent names, a measurement's speedup
  over its reference (the fast tier's baseline, the adjacent full-tier reference).
- :mod:`kiln.domain.step_time`: the step time tokens/s and the band test are decided by (the
  median, or the mean over a slack when work is front-loaded).
- :mod:`kiln.domain.curve`: the best-so-far curve and the time to a fraction of the final best.
- :mod:`kiln.domain.baselines`: the side-by-side baselines' names, how a compilation asks for
  them, and what marks their experiments.
"""
