"""The messages the code-writing agent sends: the contract (system) and the task (user: the op's
call contract, its reference source, its profile, the result history and the target's facts).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kiln.agent_runner.llm.client import Message
from kiln.agent_runner.llm.history import history_text, op_profile
from kiln.agent_runner.llm.parse import allowed_imports


@dataclass(frozen=True)
class WorkloadFacts:
    """What the prompt says about the target: hardware, model, dtype ("" if unknown), batch and
    context measured at (None if unknown).
    """

    hardware: str = ""
    model: str = ""
    batch: int | None = None
    context: int | None = None
    dtype: str = ""

    def text(self) -> str:
        """One line, e.g. ``hardware h200; model Llama-3.2-1B (bfloat16); batch 8; context 2048
        tokens``.
        """
        parts = [f"hardware {self.hardware or 'unknown'}"]
        model = self.model or "unknown"
        parts.append(f"model {model} ({self.dtype})" if self.dtype else f"model {model}")
        if self.batch:
            parts.append(f"decode batch {self.batch}")
        if self.context:
            parts.append(f"context {self.context} tokens")
        return "; ".join(parts)


SYSTEM = """\
You write PyTorch op implementations for kiln, which searches for the fastest correct forward \
pass of a language model.

Write ONE Python module that registers a new implementation of the op `{op}`:

    from kiln.ops.registry import register

    @register("{op}", "<name>", replace=True)
    def <name>(...): ...

Rules:
- <name> is a new implementation name of [a-z0-9_] (not one of: {taken}).
- Same signature and contract as the reference implementation shown: the same positional call \
arguments, the same keyword params, outputs of the same shapes and dtypes, equal to the \
reference's within dtype tolerance. It is checked against the reference on fresh random inputs \
every time; cached outputs, skipped work, reading the reference's results or calling the \
reference are rejected.
- Register exactly one implementation, of `{op}` only.
- Import only {imports}. No files, network, processes, threads or globals shared across calls.
- Reply with one short paragraph saying what makes it faster, then a single ```python fenced \
block holding the whole module."""


def reference_source(op: str) -> str:
    """The op's reference implementation with its module's docstring; UnknownOpError if no such
    op.
    """
    import kiln.ops  # noqa: F401  (registers the built-in implementations)
    from kiln.ops import registry

    fn = registry.get(op).fn
    module = inspect.getmodule(fn)
    doc = inspect.getdoc(module) if module is not None else None
    name = module.__name__ if module is not None else "?"
    head = f'# module {name}\n"""{doc}"""\n\n' if doc else f"# module {name}\n"
    return head + inspect.getsource(fn)


def profile_text(op: str, op_ms: Mapping[str, float]) -> str:
    """What the profile says of ``op``: its ms per step and share of the ops' total ("not
    measured yet" without a profile)."""
    if op not in op_ms:
        return "not measured yet"
    total = sum(op_ms.values())
    share = f" ({100 * op_ms[op] / total:.1f}% of the {total:.4g} ms of all ops)" if total else ""
    ranked = ", ".join(f"{k} {v:.4g}" for k, v in sorted(op_ms.items(), key=lambda kv: -kv[1]))
    return f"{op_ms[op]:.4g} ms per forward step{share}; all ops (ms): {ranked}"


def build_messages(
    op: str,
    *,
    facts: WorkloadFacts,
    results: Sequence[Mapping[str, Any]] = (),
    notes: Sequence[str] = (),
    history_chars: int = 6000,
    triton: bool = False,
) -> list[Message]:
    """The system and user messages asking for an implementation of ``op``.

    ``results``: the compilation's result bodies, oldest first; ``notes``: why this agent's
    earlier replies were rejected; ``history_chars``: the history's budget. UnknownOpError for an
    unknown op.
    """
    from kiln.ops import registry

    source = reference_source(op)
    taken = ", ".join(registry.implementations(op))
    imports = ", ".join(sorted(allowed_imports(triton=triton) - {"__future__"}))
    system = SYSTEM.format(op=op, taken=taken, imports=imports)
    user = "\n\n".join(
        [
            f"Op: {op}\nCall contract: {registry.OPS[op]}",
            f"Target: {facts.text()}",
            f"Measured time of {op}: {profile_text(op, op_profile(results))}",
            f"Reference implementation:\n```python\n{source}```",
            "Results so far (correct ones fastest first, then failures with "
            f"their errors):\n{history_text(results, history_chars, notes)}",
            f"Write the module registering a faster implementation of `{op}`.",
        ]
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]
