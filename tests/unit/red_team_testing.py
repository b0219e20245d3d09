"""Helpers for the red-team tests: the xfail of an escaping cheat, putting back what escaping
cheats leave behind, and reading what a cheat's code module recorded."""

from __future__ import annotations

import builtins
import contextlib
import operator
import random
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kiln.runtime import gate, state_guard
from kiln.runtime.engine import Engine
from kiln.runtime.integrity import HarnessFingerprint
from kiln.runtime.reload import RegistrySnapshot, load_code_modules
from tests.red_team.cheat import Cheat


class Escaped(AssertionError):
    """A cheat came back ok having played its trick: what an escaping cheat's xfail expects."""


def cheat_param(cheat: Cheat) -> Any:
    """``cheat`` as a pytest param with its own id; an escaping one marked xfail (strict, and
    only for :class:`Escaped`: any other failure is a real one)."""
    marks = []
    if cheat.escapes:
        reason = f"escapes today: {cheat.escapes}"
        marks.append(pytest.mark.xfail(strict=True, raises=Escaped, reason=reason))
    return pytest.param(cheat, id=cheat.name, marks=marks)


BLINDERS = (
    (operator, "is_"),
    (builtins, "all"),
    (builtins, "id"),
    (torch._C, "_dispatch_dump"),
    (random, "SystemRandom"),
    (random, "_urandom"),
    (random.Random, "randrange"),
)
"""What cheats of kind i replace that the engine does not put back (or cannot, blinded)."""


@contextlib.contextmanager
def putting_back(engine: Engine | None = None) -> Iterator[Callable[[], None]]:
    """On exit, puts back what an escaping cheat left and the engine did not see: the functions
    the watches rely on, the tolerance table, whatever the fingerprint covers, ``engine``'s
    weights. Yields what stands in for the restart a measurement asks for: the weights put back
    (what a rebuilt engine would load)."""
    blinders = [(owner, name, vars(owner)[name]) for owner, name in BLINDERS]
    fingerprint = HarnessFingerprint.take()
    weights = [(t, t.clone()) for _, t in engine.weights.items()] if engine else []

    def restart() -> None:
        with torch.no_grad():
            for tensor, saved in weights:
                if not torch.equal(tensor, saved):
                    tensor.copy_(saved)

    try:
        yield restart
    finally:
        for owner, name, value in blinders:
            if vars(owner)[name] is not value:
                setattr(owner, name, value)
        state_guard.restore_tolerances()
        assert fingerprint.restore() == []
        restart()


def spy_on_loads(monkeypatch: pytest.MonkeyPatch) -> list[types.ModuleType]:
    """The namespaces of the code modules the engine loads from now on, in a list that fills
    as it does (the engine notes the spy as a change between experiments and takes it as its
    baseline)."""
    out: list[types.ModuleType] = []
    real = gate.load_code_modules

    def spy(modules: Any) -> list[types.ModuleType]:
        namespaces = real(modules)
        out.extend(namespaces)
        return namespaces

    monkeypatch.setattr(gate, "load_code_modules", spy)
    return out


def played(loaded: list[types.ModuleType], engine: Engine | None = None) -> bool | None:
    """Whether the loaded cheat played its trick (its ``_played`` list is non-empty); None for a
    cheat that keeps no such record. A sandboxed one is read from the sandbox's report on putting
    itself back (``engine.after_reply()`` settles it)."""
    records: list[object] = [vars(ns)["_played"] for ns in loaded if "_played" in vars(ns)]
    if engine is not None and engine._sandbox is not None:
        engine.after_reply()
        if not engine._sandbox.replaced or engine._sandbox.last_report:
            records += list(dict(engine._sandbox.last_report.get("played") or {}).values())
    return any(records) if records else None


@contextlib.contextmanager
def loaded_alone(cheat: Cheat) -> Iterator[types.ModuleType]:
    """``cheat``'s code module loaded outside any engine (what a naive harness would do); the
    registry and whatever the module changed are put back on exit."""
    registry = RegistrySnapshot.take()
    with putting_back():
        try:
            (namespace,) = load_code_modules(cheat.candidate.code_modules)
            yield namespace
        finally:
            registry.restore()
