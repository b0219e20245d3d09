"""The engine-pool service: persistent engine processes that take experiments off the NATS work
queue and answer ``EnginePool`` gRPC calls.

``app`` (the ServiceApp), ``service`` (EnginePool gRPC), ``queue`` (the work-queue consumer,
one worker per device) and ``delivery`` (a message to its ``ExperimentCompleted``, ack, nak or
term), ``pool`` (a slot per device, engines by spec, LRU), ``devices`` (which devices, their
kinds, the pin of an engine process), ``registry`` (pools and engines heartbeated into a NATS
key-value bucket), ``process`` (one engine process: start, deadline, crash and restart),
``worker`` (the engine process's main: a :class:`kiln.runtime.engine.Engine` answering run
requests, a baseline through the external measure it is given), ``settings`` (``KILN_ENGINE_*``),
``metrics``; ``microbench_*`` (the cost model's microbenchmarks: the NATS responder, the
subprocess that times the ops; the wire format is :mod:`kiln.common.microbench_wire`). The
engine itself is :mod:`kiln.runtime`.
"""
