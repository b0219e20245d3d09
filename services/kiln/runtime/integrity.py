"""What a candidate must not do besides computing: change the engine's code or global numerics,
or keep working after its call returned (rationale and limits: docs/design/engine.md,
"Integrity").

:class:`HarnessFingerprint` records the objects the reference, the check and the timers are made
of (down to code objects, defaults and closure cells) and the numerics state (precision flags,
torch function/dispatch modes, ``aten`` kernels, trace and profile hooks); changes are put back
and the engine restarts. :class:`~kiln.runtime.thread_watch.ThreadWatch` checks no thread still
runs candidate code after a timed call.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.runtime.attributes import AttributeSnapshot
from kiln.runtime.dispatch_watch import DispatchTables

WATCHED_PACKAGES = (
    "kiln.runtime.check",
    "kiln.runtime.moe_check",
    "kiln.runtime.exact",
    "kiln.runtime.engine",
    "kiln.runtime.gate",
    "kiln.runtime.gate_check",
    "kiln.runtime.integrity",
    "kiln.runtime.state_guard",
    "kiln.runtime.attributes",
    "kiln.runtime.thread_watch",
    "kiln.runtime.timing",
    "kiln.ops",
    "kiln.workloads.models",
    "kiln.workloads.weights",
)
"""Every loaded module under these names is fingerprinted (globals and the classes it defines):
the engine's gate, the models and their ops, the weight store. (Settings, specs, the pool and
the measured model's transforms are not on the reference's path.)"""
WATCHED_MODULES = (
    "builtins",
    "functools",
    "math",
    "random",
    "secrets",
    "statistics",
    "threading",
    "time",
    "torch",
    "torch.nn.functional",
    "torch.cuda",
    "torch.library",
)
"""Other modules whose globals the engine or the reference read."""
WATCHED_SYS = ("_current_frames", "_getframe", "gettrace", "getprofile", "settrace")
"""The attributes of ``sys`` the watches rely on (``sys`` itself changes legitimately)."""
NUMERICS_FLAGS = (
    "backends.fp32_precision",
    "backends.cuda.matmul.fp32_precision",
    "backends.cudnn.fp32_precision",
    "backends.cudnn.conv.fp32_precision",
    "backends.mkldnn.fp32_precision",
    "backends.mkldnn.matmul.fp32_precision",
    "backends.mkldnn.conv.fp32_precision",
    "backends.cuda.matmul.allow_tf32",
    "backends.cuda.matmul.allow_fp16_reduced_precision_reduction",
    "backends.cuda.matmul.allow_bf16_reduced_precision_reduction",
    "backends.cudnn.allow_tf32",
)
"""``torch.<path>`` flags that change how float32 (and half) matmuls are computed: the
per-backend ``fp32_precision`` API first, then the legacy flags, whose getters raise once the
two APIs disagree and whose setters also set the per-backend flags (so :meth:`restore` puts
them back in the reverse order)."""


@dataclass(frozen=True)
class _Unreadable:
    """A flag whose getter raised."""

    error: str

    def __repr__(self) -> str:
        return f"unreadable ({self.error[:60]}...)"


@dataclass(frozen=True)
class _Flag:
    label: str
    getter: Callable[[], object]
    put: Callable[[object], None]

    def get(self) -> object:
        try:
            return self.getter()
        except RuntimeError as exc:
            return _Unreadable(str(exc)[:80])


def _attr_flag(path: str) -> _Flag | None:
    """A ``torch.<path>`` attribute as a flag, or None where this build has no such flag."""
    *parents, name = path.split(".")
    owner: Any = torch
    try:
        for part in parents:
            owner = getattr(owner, part)
        getattr(owner, name)
    except (AttributeError, RuntimeError):
        return None
    return _Flag(
        f"torch.{path}",
        lambda: getattr(owner, name),
        lambda v: setattr(owner, name, v),
    )


def _global_flags() -> list[_Flag]:
    flags = [f for f in map(_attr_flag, NUMERICS_FLAGS) if f is not None]
    flags.append(
        _Flag(
            "torch.get_float32_matmul_precision()",
            torch.get_float32_matmul_precision,
            lambda v: torch.set_float32_matmul_precision(str(v)),
        )
    )
    flags.append(
        _Flag(
            "torch.get_default_dtype()",
            torch.get_default_dtype,
            lambda v: torch.set_default_dtype(v),  # type: ignore[arg-type]
        )
    )
    flags.append(_Flag("sys.gettrace()", sys.gettrace, lambda v: sys.settrace(v)))  # type: ignore[arg-type]
    flags.append(_Flag("sys.getprofile()", sys.getprofile, lambda v: sys.setprofile(v)))  # type: ignore[arg-type]
    return flags


def _modules() -> Iterator[types.ModuleType]:
    for name, mod in list(sys.modules.items()):
        if isinstance(mod, types.ModuleType) and (
            name in WATCHED_MODULES or name.startswith(WATCHED_PACKAGES)
        ):
            yield mod


def _classes_of(mod: types.ModuleType) -> Iterator[type]:
    if not mod.__name__.startswith(WATCHED_PACKAGES):
        return
    for value in list(vars(mod).values()):
        if isinstance(value, type) and value.__module__ == mod.__name__:
            yield value


_Target = tuple[str, object, bool, tuple[str, ...] | None]


def _static_targets() -> list[_Target]:
    """``(label, owner, additions, keys)`` of everything watched statically."""
    wanted: list[_Target] = []
    for mod in _modules():
        wanted.append((mod.__name__, mod, False, None))
        wanted += [(f"{mod.__name__}.{c.__qualname__}", c, True, None) for c in _classes_of(mod)]
    wanted.append(("sys", sys, False, WATCHED_SYS))
    for cls in (torch.Tensor, torch._C.TensorBase, torch.cuda.Event, torch.cuda.Stream):
        wanted.append((f"{cls.__module__}.{cls.__qualname__}", cls, True, None))
    return wanted


@dataclass
class HarnessFingerprint:
    """What the reference, the check and the timers are made of, at one moment: :meth:`take` (or
    :meth:`refresh`) before a candidate loads, :meth:`changes` after, :meth:`restore` puts back
    what it can.
    """

    namespaces: list[AttributeSnapshot]
    flags: list[tuple[_Flag, object]]
    modes: tuple[int, int]
    dispatch: DispatchTables
    _static: list[_Target] = field(default_factory=list)
    _modules_seen: int = -1

    @staticmethod
    def take(
        instances: Iterable[tuple[str, object, tuple[str, ...] | None]] = (),
    ) -> HarnessFingerprint:
        """Record the watched state and ``instances``: ``(label, object, attribute names or None
        for all)``.
        """
        fingerprint = HarnessFingerprint([], [], (0, 0), DispatchTables())
        fingerprint.refresh(instances)
        return fingerprint

    def refresh(
        self,
        instances: Iterable[tuple[str, object, tuple[str, ...] | None]] = (),
        *,
        dispatch: bool = True,
    ) -> list[str]:
        """Make the present state the recorded one (re-taking only what changed, adding modules
        imported since); returns what had changed. ``dispatch=False`` leaves the dispatcher's
        tables (the costly part) as recorded: :attr:`dispatch` is then checked by its owner.
        """
        changed: list[str] = []
        kept = {id(space.owner): space for space in self.namespaces}
        spaces: list[AttributeSnapshot] = []
        if len(sys.modules) != self._modules_seen:  # something was imported: look again
            self._static, self._modules_seen = _static_targets(), len(sys.modules)
        seen: set[int] = set()
        targets = self._static + [(label, o, keys is None, keys) for label, o, keys in instances]
        for label, owner, additions, keys in targets:
            if id(owner) in seen:
                continue
            seen.add(id(owner))
            space = kept.pop(id(owner), None)
            if space is None:
                spaces.append(AttributeSnapshot(label, owner, additions, keys).take())
                continue
            if not space.unchanged():
                changed += space.changes()
                space.take()
            spaces.append(space)
        if self.flags:
            changed += self._global_changes(dispatch=False)
        if dispatch:
            changed += self.dispatch.advance()
        self.namespaces = spaces
        self.flags = [(f, f.get()) for f in _global_flags()]
        self.modes = _mode_depths()
        return changed

    def changes(self, *, dispatch: bool = True) -> list[str]:
        """What differs from when it was taken, one line each (empty: nothing);
        ``dispatch=False``: the dispatcher's tables left out (see :meth:`refresh`)."""
        out: list[str] = []
        for space in self.namespaces:
            out.extend(space.changes())
        return out + self._global_changes(dispatch=dispatch)

    def _global_changes(self, dispatch: bool = True) -> list[str]:
        out: list[str] = []
        for flag, value in self.flags:
            now = flag.get()
            if now != value:
                out.append(f"{flag.label} changed from {value!r} to {now!r}")
        fn_depth, dispatch_depth = _mode_depths()
        if fn_depth != self.modes[0]:
            out.append(f"torch function modes: {self.modes[0]} -> {fn_depth} active")
        if dispatch_depth != self.modes[1]:
            out.append(f"torch dispatch modes: {self.modes[1]} -> {dispatch_depth} active")
        return out + (self.dispatch.changes() if dispatch else [])

    def restore(self) -> list[str]:
        """Put back every changed attribute, flag and mode stack; returns what could not be
        undone.
        """
        problems: list[str] = []
        for space in self.namespaces:
            try:
                space.restore()
            except Exception as exc:  # an immutable type, a read-only attribute
                problems.append(f"{space.label}: {type(exc).__name__}: {exc}")
        # Legacy precision setters also set the per-backend flags: put them back first, the
        # per-backend ones last (their order in NUMERICS_FLAGS, reversed).
        for flag, value in reversed(self.flags):
            try:
                if flag.get() != value:
                    flag.put(value)
            except Exception as exc:
                problems.append(f"{flag.label}: {type(exc).__name__}: {exc}")
        while torch._C._len_torch_function_stack() > self.modes[0]:
            torch._C._pop_torch_function_stack()
        while torch._C._len_torch_dispatch_stack() > self.modes[1]:
            torch._C._pop_torch_dispatch_stack()
        left = self.dispatch.restore()
        if left:
            problems.append(f"dispatcher kernels stay replaced: {'; '.join(left[:4])}")
        return problems


def _mode_depths() -> tuple[int, int]:
    return torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack()
