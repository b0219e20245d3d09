"""The engine pool: persistent engines that hot-reload and measure candidates.

Service side (imports gRPC and NATS): ``app`` (the ServiceApp), ``service`` (EnginePool gRPC),
``queue`` (the NATS work-queue consumer, one worker per device), ``pool`` (a slot per device,
engines by spec, LRU), ``devices`` (which devices, their kinds, the pin of an engine process),
``registry`` (pools and engines heartbeated into a NATS key-value bucket), ``process`` (one
engine process: start, deadline, crash and restart), ``settings`` (``KILN_ENGINE_*``).

Engine side (imports torch, ``kiln.workloads`` and ``kiln.ops`` only; runs in the spawned
process): ``worker`` (process main), ``engine`` (build once, run candidates), ``check``
(correctness against the reference), ``timing``, ``transforms``, ``reload`` (code modules and
the op registry).

Shared plain data: ``spec`` (what an engine is built for), ``request`` (pipe messages),
``measurement`` (results).
"""
