"""The engine runtime: build a model once, hot-reload candidates into it, check them against
the reference, time them (torch, :mod:`kiln.workloads` and :mod:`kiln.ops` only; importable
without gRPC, NATS or SQLAlchemy). Used by the engine pool's worker processes and by
:mod:`kiln.export`.

``engine`` (lifecycle, one experiment under the integrity watches), ``gate`` and ``gate_check``
(the phases: bind, check, time, verify), ``check``, ``exact`` and ``moe_check`` (correctness),
``timed_verification`` (how many timed steps are verified), ``integrity``, ``attributes``,
``dispatch_watch`` and ``thread_watch`` (what a candidate must not touch), ``timing``,
``transforms``, ``fused_decode`` and ``cuda_graph`` (whole-step transforms), ``support`` (what
applies to a model on a device), ``reload`` (code modules), ``spec`` (what an engine is built for),
``request`` and ``measurement`` (plain data in and out).
"""
