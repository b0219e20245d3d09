"""The dispatcher's kernels for ``aten`` ops, as a candidate must leave them.

A kernel registered for ``aten::mm`` (through ``torch.library`` or ``torch._C`` directly)
changes what the reference computes as much as the candidate's, so the comparison cannot see it.
:class:`DispatchTables` records every ``aten`` op's registered kernels per dispatch key (the
dispatcher's own dump, not ``torch.library``'s bookkeeping, which candidate code can edit and
which a dropped library's finalizer edits by name) and names the op and key of each kernel
added or replaced since. Shape-only keys (``Meta``) are left out: they compute no values, and
torch registers them lazily.

Cost: one dump of some 3,100 ops, about 60 ms on a 2-core VM (the dispatcher's printing; ops
whose dump is unchanged are compared as strings).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

import torch

SHAPE_ONLY_KEYS = frozenset({"Meta"})
"""Dispatch keys whose kernels compute shapes only."""


def _dumps() -> dict[str, str]:
    """``aten`` op name -> the dispatcher's dump of its kernels, as printed."""
    dump = torch._C._dispatch_dump
    return {
        name: dump(name)
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("aten::")
    }


def _computing(dump: str) -> frozenset[str]:
    """The lines of one op's dump that name an active computing kernel (``KEY: registered at
    FILE:LINE ...``; a kernel a newer one overrides is inactive)."""
    return frozenset(
        line
        for line in dump.splitlines()
        if ": registered at " in line
        and "(inactive)" not in line.split(":", 1)[0]
        and line.split(":", 1)[0] not in SHAPE_ONLY_KEYS
    )


def _key(line: str) -> str:
    return line.split(":", 1)[0].split("[", 1)[0].strip()


def _where(line: str) -> str:
    return line.split(": registered at ", 1)[1].split(" :: ", 1)[0]


def _diff(before: dict[str, str], now: dict[str, str]) -> list[tuple[str, str, str]]:
    out: set[tuple[str, str, str]] = set()
    for name, dump in now.items():
        old = before.get(name)
        if old is None or dump == old:  # the common case: one string comparison an op
            continue
        lines, old_lines = _computing(dump), _computing(old)
        if lines != old_lines:
            out.update((name, _key(line), _where(line)) for line in lines - old_lines)
    return sorted(out)


def _lines(changed: list[tuple[str, str, str]]) -> list[str]:
    return [
        f"dispatcher kernel for {op} at {key} replaced (registered at {where})"
        for op, key, where in changed
    ]


@dataclass
class DispatchTables:
    """The kernels of every ``aten`` op at one moment (:meth:`take`): each op's dump as the
    dispatcher prints it; only an op whose dump differs is parsed for its computing kernels."""

    tables: dict[str, str] = field(default_factory=dict)

    @staticmethod
    def take() -> DispatchTables:
        return DispatchTables(_dumps())

    def changed(self) -> list[tuple[str, str, str]]:
        """``(op, dispatch key, where the new kernel was registered)`` for each kernel added or
        replaced since :meth:`take`, sorted."""
        return _diff(self.tables, _dumps())

    def changes(self) -> list[str]:
        """One line per changed kernel (empty: none)."""
        return _lines(self.changed())

    def advance(self) -> list[str]:
        """Make the present tables the recorded ones; returns what had changed (one dump)."""
        now = _dumps()
        changed = _diff(self.tables, now) if self.tables else []
        self.tables = now
        return _lines(changed)

    def restore(self) -> list[str]:
        """Destroy every live ``torch.library.Library`` that registered a changed kernel (found
        through the garbage collector); returns a line per kernel still changed after that."""
        changed = self.changed()
        if not changed:
            return []
        names = {f"{op.removeprefix('aten::')}/{key}" for op, key, _ in changed}
        for obj in gc.get_objects():
            if type(obj) is not torch.library.Library or getattr(obj, "m", None) is None:
                continue
            impls = {name.removeprefix("aten/") for name in obj._op_impls}
            if obj.ns == "aten" and impls & names:
                obj._destroy()
        return self.changes()
