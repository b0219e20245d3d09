"""The process split (issue 13, item 1; rationale: docs/design/engine.md, "Sandbox"): a
candidate's code modules run in a separate, confined process over the judge's weights, one
call's inputs at a time; the judge (the engine process) keeps the reference, the inputs and
their seed, the choice of verified steps, the comparison, the tolerances and the timer.

- :mod:`.wire`: JSON headers and raw bytes over a socket (nothing is unpickled).
- :mod:`.memory`: the weights in a sealed memfd (CPU) or behind CUDA IPC handles, and the
  shared output buffer.
- :mod:`.confine`: the sandbox's environment, rlimits, namespaces and Landlock domain.
- :mod:`.user`: the unprivileged user a root engine's sandbox becomes; :mod:`.view`: the mount
  namespace that keeps what it needs readable to that user.
- :mod:`.server`: the sandbox process.
- :mod:`.host`: the judge's side, and the stand-in model the gate drives.
"""
