"""What a candidate must not do besides computing: change the engine's code or global numerics,
or keep working after its call returned.

A candidate's code modules run in the engine's process with all of Python at hand, so the
correctness gate (:mod:`kiln.engine_pool.check`) is backed by two watches:

- :class:`HarnessFingerprint`: taken (or refreshed) before a candidate loads, compared after
  its experiment. It records *which objects* make up the code the reference forward, the check
  and the timers run — every global of the engine's, the models' and the ops' modules (and of
  ``torch``, ``torch.nn.functional``, ``time``, ``builtins``...), every attribute of the
  classes defined there (and of ``torch.Tensor``), the engine's reference models and their
  bound ops, the timer — down to each Python function's code object, defaults and closure
  cells; plus the global state that changes what the reference computes (float32 matmul
  precision, TF32 and reduced-precision flags, torch function/dispatch modes, the dispatcher's
  kernels for ``aten`` ops (:mod:`kiln.engine_pool.dispatch_watch`), the trace and profile
  hooks). A candidate that patches ``DecoderModel._layer``,
  ``torch.nn.functional.linear``, ``time.perf_counter`` or the engine's ``compare``, or turns on
  TF32, or overrides ``aten::mm`` through ``torch.library``, changes the reference too — the
  comparison alone cannot see that; this can. What it changed is put back
  (:meth:`HarnessFingerprint.restore`) and the engine restarts anyway.
- :class:`ThreadWatch`: after each timed call, no thread may still be running candidate code
  (a frame of a ``<candidate:...>`` file on its stack, or a candidate function as its target),
  and no thread started during the call may outlive it. Work finished on a thread after the
  call returned is work the timer did not see.

Limits (in-process checking cannot be complete): a candidate that patches something only
while its own calls run and puts it back before returning, or that targets this module itself,
is not seen here; what the gate still guarantees then is that the outputs of the candidate's
calls are right (checked and verified timed steps). Code a candidate leaves to run between
experiments (a finalizer, a ``gc.callbacks`` entry) changes the next experiment's baseline: the
engine notes such changes but does not blame anyone. Threads in C (OpenMP, CUDA, a
``threading.Thread`` whose target is a torch function, started before timing) are not Python
threads running candidate code: work they finish late shows only in the verified outputs; so
does work in a child process.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
import os
import sys
import threading
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.engine_pool.dispatch_watch import DispatchTables

CANDIDATE_FILE_PREFIX = "<candidate:"
"""Code modules are compiled under ``<candidate:NAME#i>`` (see
:func:`kiln.engine_pool.reload.module_filename`)."""

WATCHED_PACKAGES = (
    "kiln.engine_pool.check",
    "kiln.engine_pool.moe_check",
    "kiln.engine_pool.exact",
    "kiln.engine_pool.engine",
    "kiln.engine_pool.integrity",
    "kiln.engine_pool.timing",
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

_EMPTY = object()


def is_candidate_code(code: types.CodeType) -> bool:
    """True for code compiled from a candidate's code module."""
    return code.co_filename.startswith(CANDIDATE_FILE_PREFIX)


# ---------------------------------------------------------------------------------------------
# fingerprint


def _parts(value: object) -> tuple[object, ...]:
    """The mutable insides of a callable that change what it does without changing its
    identity: a function's code, defaults and closure cells; what a method, property or
    ``functools.partial`` wraps. Empty for anything else (never calls user code)."""
    t = type(value)
    if t is types.FunctionType:
        fn: Any = value
        cells = tuple(
            _EMPTY if not _cell_full(c) else c.cell_contents for c in fn.__closure__ or ()
        )
        return (fn.__code__, fn.__defaults__, fn.__kwdefaults__, *cells)
    if t is staticmethod or t is classmethod:
        inner = value.__func__  # type: ignore[attr-defined]
        return (inner, *_parts(inner))
    if t is property:
        prop: Any = value
        return (prop.fget, prop.fset, prop.fdel, *_parts(prop.fget))
    if t is functools.partial:
        part: Any = value
        pairs = [x for item in part.keywords.items() for x in item]
        return (part.func, part.args, len(pairs), *pairs, *_parts(part.func))
    return ()


def _cell_full(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _torch_rewrap(old: object, new: object) -> bool:
    """True when ``new`` is torch's own wrapper of ``old`` (``functools.wraps``, code inside
    the torch package): importing ``torch._dynamo`` replaces ``torch.manual_seed`` so."""
    if getattr(new, "__wrapped__", None) is not old:
        return False
    code = getattr(new, "__code__", None)
    return isinstance(code, types.CodeType) and code.co_filename.startswith(_TORCH_DIR)


def _same(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


_WRAPPERS = (types.FunctionType, staticmethod, classmethod, property, functools.partial)
"""Types whose insides :func:`_parts` records."""
_FN = operator.attrgetter("__code__", "__defaults__", "__kwdefaults__")
_CELL = operator.attrgetter("cell_contents")
_METHOD = operator.attrgetter("__func__")
_PROPERTY = operator.attrgetter("fget", "fset", "fdel")
_PARTIAL = operator.attrgetter("func", "args", "keywords")
_KEYWORDS = operator.attrgetter("keywords")


@dataclass
class _Insides:
    """The wrapped values of a namespace, grouped so that the identities of their insides are
    read by C-level ``map``/``attrgetter`` (:meth:`signature`): comparing a namespace of a
    thousand functions costs tens of microseconds, not milliseconds."""

    functions: list[types.FunctionType] = field(default_factory=list)
    cells: list[types.CellType] = field(default_factory=list)
    methods: list[object] = field(default_factory=list)
    properties: list[property] = field(default_factory=list)
    partials: list[functools.partial[Any]] = field(default_factory=list)

    @staticmethod
    def of(values: Iterable[object]) -> _Insides:
        out = _Insides()
        for v in values:
            t = type(v)
            if t is types.FunctionType:
                out._function(v)  # type: ignore[arg-type]
            elif t is staticmethod or t is classmethod:
                out.methods.append(v)
                if type(v.__func__) is types.FunctionType:  # type: ignore[attr-defined]
                    out._function(v.__func__)  # type: ignore[attr-defined]
            elif t is property:
                out.properties.append(v)  # type: ignore[arg-type]
                for f in _PROPERTY(v):
                    if type(f) is types.FunctionType:
                        out._function(f)
            elif t is functools.partial:
                out.partials.append(v)  # type: ignore[arg-type]
                if type(v.func) is types.FunctionType:  # type: ignore[attr-defined]
                    out._function(v.func)  # type: ignore[attr-defined]
        return out

    def _function(self, fn: types.FunctionType) -> None:
        self.functions.append(fn)
        self.cells.extend(c for c in fn.__closure__ or () if _cell_full(c))

    def objects(self) -> list[object]:
        """The insides, in a fixed order: each function's code, defaults and keyword defaults,
        each closure cell's contents, each method's function, each property's accessors, each
        partial's function, arguments, keyword dict and keyword values."""
        return list(
            itertools.chain(
                itertools.chain.from_iterable(map(_FN, self.functions)),
                map(_CELL, self.cells),
                map(_METHOD, self.methods),
                itertools.chain.from_iterable(map(_PROPERTY, self.properties)),
                itertools.chain.from_iterable(map(_PARTIAL, self.partials)),
                itertools.chain.from_iterable(map(dict.values, map(_KEYWORDS, self.partials))),
            )
        )


def _identical(a: list[object], b: list[object]) -> bool:
    """Same length and the same objects at every position (C-level)."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


@dataclass
class AttributeSnapshot:
    """The attributes of one module, class or instance at one moment, by identity (and, for
    functions, methods, properties and partials, what they wrap: see :func:`_parts`).

    Args:
        label: how changes are named (``"kiln.engine_pool.engine.compare"``).
        owner: the module, class or instance.
        additions: whether a new attribute counts as a change (classes: it can shadow an
            inherited one; modules gain attributes legitimately, e.g. lazily imported
            submodules).
        keys: only these attributes (None: all).
        ignore: attributes left out (e.g. a model's op binding, which hot reload swaps).
    """

    label: str
    owner: object
    additions: bool
    keys: tuple[str, ...] | None = None
    ignore: tuple[str, ...] = ()
    values: dict[str, object] = field(default_factory=dict)
    wrapped: dict[str, tuple[object, ...]] = field(default_factory=dict)
    _order: list[object] = field(default_factory=list)
    _insides: _Insides = field(default_factory=_Insides)
    _inside_objects: list[object] = field(default_factory=list)

    def current(self) -> Mapping[str, object]:
        """The owner's attributes now (restricted by ``keys`` and ``ignore``)."""
        try:
            names: Mapping[str, object] = vars(self.owner)
        except TypeError:
            return {}
        if self.keys is not None:
            names = {k: names[k] for k in self.keys if k in names}
        if self.ignore:
            names = {k: v for k, v in names.items() if k not in self.ignore}
        return names

    def take(self) -> AttributeSnapshot:
        """Record the attributes now; returns self."""
        now = self.current()
        self.values = dict(now)
        self._order = list(now.values())
        self.wrapped = {k: _parts(v) for k, v in now.items() if type(v) in _WRAPPERS}
        self._insides = _Insides.of(self.values[k] for k in self.wrapped)
        self._inside_objects = self._insides.objects()
        return self

    def unchanged(self) -> bool:
        """True when every attribute and its insides are the recorded objects (fast: C-level
        maps over identities)."""
        now = self.current()
        return (
            len(now) == len(self._order)
            and all(map(operator.is_, now.values(), self._order))
            and _identical(self._insides.objects(), self._inside_objects)
        )

    def changes(self) -> Iterator[str]:
        """One line per attribute replaced, deleted, modified in place or (``additions``)
        added since :meth:`take`."""
        now = self.current()
        if not (len(now) == len(self._order) and all(map(operator.is_, now.values(), self._order))):
            for key, value in self.values.items():
                if key not in now:
                    yield f"{self.label}.{key} deleted"
                elif now[key] is not value and not _torch_rewrap(value, now[key]):
                    yield f"{self.label}.{key} replaced"
            if self.additions:
                for key in now.keys() - self.values.keys():
                    yield f"{self.label}.{key} added"
        if _identical(self._insides.objects(), self._inside_objects):
            return
        for key, parts in self.wrapped.items():
            if not _same(_parts(self.values[key]), parts):
                yield f"{self.label}.{key} modified in place (code, defaults or closure)"

    def restore(self) -> None:
        """Put the recorded attributes back and delete added ones (``additions``).

        Raises:
            TypeError, AttributeError: the owner refuses the assignment (immutable type).
        """
        now = self.current()
        put = _setter(self.owner)
        for key, value in self.values.items():
            current = now.get(key, _EMPTY)
            if current is not value and not _torch_rewrap(value, current):
                put(key, value)
        for key, parts in self.wrapped.items():
            if not _same(_parts(self.values[key]), parts):
                _put_parts(self.values[key], parts)
        if self.additions:
            for key in now.keys() - self.values.keys():
                delattr(self.owner, key)


def _setter(owner: object) -> Callable[[str, object], None]:
    if dataclasses.is_dataclass(owner) and not isinstance(owner, type):
        return lambda k, v: object.__setattr__(owner, k, v)  # frozen dataclasses too
    return lambda k, v: setattr(owner, k, v)


def _put_parts(value: Any, parts: tuple[object, ...]) -> None:
    """Undo an in-place change of a function (code, defaults, cells) or a partial's keywords."""
    t = type(value)
    if t is types.FunctionType:
        value.__code__, value.__defaults__, value.__kwdefaults__ = parts[:3]
        for cell, contents in zip(value.__closure__ or (), parts[3:], strict=False):
            if contents is not _EMPTY:
                cell.cell_contents = contents
    elif t is staticmethod or t is classmethod:
        _put_parts(parts[0], parts[1:])
    elif t is property:
        _put_parts(parts[0], parts[3:])
    elif t is functools.partial:
        n = int(parts[2])  # type: ignore[call-overload]
        pairs = parts[3 : 3 + n]
        value.keywords.clear()
        value.keywords.update(zip(pairs[::2], pairs[1::2], strict=True))
        _put_parts(parts[0], parts[3 + n :])


@dataclass(frozen=True)
class _Unreadable:
    """A flag whose getter raised (PyTorch refuses to read a legacy precision flag once the
    legacy and per-backend APIs disagree)."""

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
    """``(label, owner, additions, keys)`` of the watched modules, their classes, ``sys`` and
    torch's tensor, event and stream classes."""
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
    """What the reference, the check and the timers are made of, at one moment (module
    docstring).

    Build it with :meth:`take` before a candidate's code loads (or bring a kept one up to date
    with :meth:`refresh`); :meth:`changes` afterwards says what differs, :meth:`restore` puts
    back what it can. Some 5,000 attributes are compared by identity, their insides through
    C-level ``map``: a take costs a few milliseconds, a comparison or a refresh with nothing
    changed about one (on the CPUs of an H200 host; 2 ms on a loaded 2-core VM), plus one dump
    of the dispatcher's tables each (:mod:`kiln.engine_pool.dispatch_watch`).
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
        """Record the watched modules, classes and global state, and ``instances``: ``(label,
        object, attribute names or None for all)``, e.g. the engine's reference models."""
        fingerprint = HarnessFingerprint([], [], (0, 0), DispatchTables())
        fingerprint.refresh(instances)
        return fingerprint

    def refresh(
        self, instances: Iterable[tuple[str, object, tuple[str, ...] | None]] = ()
    ) -> list[str]:
        """Make the present state the recorded one, re-taking only what changed (and adding
        modules imported since); returns what had changed (:meth:`changes`' lines).

        An engine refreshes its fingerprint before each candidate: changes made between
        experiments (a test's monkeypatching, torch's lazy imports) become the baseline
        rather than a later candidate's fault.
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
        changed += self.dispatch.advance()
        self.namespaces = spaces
        self.flags = [(f, f.get()) for f in _global_flags()]
        self.modes = _mode_depths()
        return changed

    def changes(self) -> list[str]:
        """What differs from when it was taken, one line each (empty: nothing)."""
        out: list[str] = []
        for space in self.namespaces:
            out.extend(space.changes())
        return out + self._global_changes()

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
        undone (kernels registered through ``torch.library``, failed assignments)."""
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


# ---------------------------------------------------------------------------------------------
# threads


def _candidate_frame(frame: types.FrameType | None) -> str:
    """``function (file:line)`` of the innermost candidate frame on the stack, or ""."""
    while frame is not None:
        if is_candidate_code(frame.f_code):
            return f"{frame.f_code.co_name} ({frame.f_code.co_filename}:{frame.f_lineno})"
        frame = frame.f_back
    return ""


def _candidate_target(thread: threading.Thread | None) -> str:
    """The candidate function a ``threading.Thread`` was started with, or ""."""
    target = getattr(thread, "_target", None)
    target = getattr(target, "func", target)  # functools.partial
    target = getattr(target, "__func__", target)  # bound method
    code = getattr(target, "__code__", None)
    if isinstance(code, types.CodeType) and is_candidate_code(code):
        return f"{code.co_name} ({code.co_filename})"
    run = getattr(type(thread), "run", None)
    code = getattr(run, "__code__", None)
    if isinstance(code, types.CodeType) and is_candidate_code(code):
        return f"{type(thread).__name__}.run ({code.co_filename})"
    return ""


class ThreadWatch:
    """Python threads besides the caller's, as of construction; :meth:`strays` names the ones
    doing candidate work now.

    Cost: one ``sys._current_frames()`` and a walk of each thread's stack (microseconds with
    the few threads an engine has).
    """

    def __init__(self) -> None:
        self._me = threading.get_ident()
        self._before = set(sys._current_frames())

    def strays(self, new_threads: bool = True) -> list[str]:
        """Threads other than the caller's that run candidate code (a candidate frame on their
        stack, or a candidate function as their target), and (``new_threads``) threads started
        after this watch was made that are still alive; one description each (empty: none)."""
        out: list[str] = []
        active = {t.ident: t for t in threading.enumerate()}  # for names and targets
        for ident, frame in sys._current_frames().items():
            if ident == self._me:
                continue
            thread = active.get(ident)
            name = thread.name if thread is not None else f"ident {ident}"
            where = _candidate_frame(frame) or _candidate_target(thread)
            if where:
                out.append(f"thread {name!r} runs candidate code: {where}")
            elif new_threads and ident not in self._before:
                out.append(f"thread {name!r} started during the call is still running")
        return out


class OutsideWork(RuntimeError):
    """A candidate kept working after its timed call returned (the message says where)."""
