"""Loading a candidate's code modules, and putting the op registry back afterwards.

A code module is source text that registers op implementations
(``@kiln.ops.registry.register("attention", "mine", replace=True)``). Each is executed in a fresh
module namespace (``types.ModuleType``, never entered in ``sys.modules``), so nothing one
candidate defines is visible to the next. What a module registers lives in the process-wide
registry, so :class:`RegistrySnapshot` records the registry before loading and restores it after
the experiment: implementations added are removed, replaced ones put back.
"""

from __future__ import annotations

import linecache
import re
import types
from collections.abc import Sequence
from dataclasses import dataclass

from kiln.domain.candidate import CodeModule
from kiln.ops import registry
from kiln.ops.registry import REFERENCE, OpImpl

_UNSAFE = re.compile(r"[^A-Za-z0-9_]")


def module_filename(module: CodeModule, index: int) -> str:
    """The pseudo file name tracebacks show for a code module, ``<candidate:NAME#i>``."""
    return f"<candidate:{module.name}#{index}>"


def load_code_modules(modules: Sequence[CodeModule]) -> list[types.ModuleType]:
    """Execute each module's source in its own fresh namespace, in order.

    The source is registered with ``linecache`` under :func:`module_filename` so tracebacks show
    its lines (:func:`forget_sources` drops them).

    Raises:
        Exception: whatever the source raises (SyntaxError included); the caller reports it.
    """
    loaded: list[types.ModuleType] = []
    for i, module in enumerate(modules):
        filename = module_filename(module, i)
        lines = module.source.splitlines(keepends=True)
        linecache.cache[filename] = (len(module.source), None, lines, filename)
        namespace = types.ModuleType(f"kiln_candidate_{_UNSAFE.sub('_', module.name)}")
        namespace.__file__ = filename
        exec(compile(module.source, filename, "exec"), namespace.__dict__)
        loaded.append(namespace)
    return loaded


def forget_sources(modules: Sequence[CodeModule]) -> None:
    """Drop the modules' sources from ``linecache``."""
    for i, module in enumerate(modules):
        linecache.cache.pop(module_filename(module, i), None)


@dataclass(frozen=True)
class RegistrySnapshot:
    """Every (op, implementation) → :class:`~kiln.ops.registry.OpImpl` at one moment."""

    impls: dict[tuple[str, str], OpImpl]

    @staticmethod
    def take() -> RegistrySnapshot:
        """The registry as it is now."""
        return RegistrySnapshot(
            {
                (op, n): registry.get(op, n)
                for op in registry.ops()
                for n in registry.implementations(op)
            }
        )

    def changed(self) -> bool:
        """True when the registry differs from the snapshot."""
        return RegistrySnapshot.take().impls != self.impls

    def restore(self) -> bool:
        """Put the registry back as it was: remove added implementations, re-register replaced
        ones. Returns False when that is impossible through the registry's API (a module added a
        ``reference`` to an op that had none, which cannot be unregistered); the engine should
        then be restarted."""
        clean = True
        now = RegistrySnapshot.take().impls
        for (op, name), impl in now.items():
            before = self.impls.get((op, name))
            if before == impl:
                continue
            if before is not None:
                registry.register(
                    op, name, lossy=before.lossy, derived=before.derived, replace=True
                )(before.fn)
            elif name == REFERENCE:
                clean = False
            else:
                registry.unregister(op, name)
        for (op, name), impl in self.impls.items():
            if (op, name) not in now:  # removed by a module: bring it back
                registry.register(op, name, lossy=impl.lossy, derived=impl.derived)(impl.fn)
        return clean
