"""Snapshots of a module's, class's or instance's attributes by identity, down to what each
function, method, property or partial wraps: what changed since, and putting it back.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
import os
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

_EMPTY = object()


def _parts(value: object) -> tuple[object, ...]:
    """The mutable insides of a callable (code, defaults, closure cells; what a method, property
    or partial wraps); empty for anything else. Never calls user code.
    """
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
    """True when ``new`` is torch's own ``functools.wraps`` wrapper of ``old``."""
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
    """The wrapped values of a namespace, grouped so their insides' identities are compared at C
    level.
    """

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
        """The insides, in a fixed order."""
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
    """The attributes of one module, class or instance at one moment, by identity.

    Args:
        label: how changes are named.
        additions: whether a new attribute counts as a change.
        keys: only these attributes (None: all); ignore: attributes left out.
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
        """True when every attribute and its insides are the recorded objects."""
        now = self.current()
        return (
            len(now) == len(self._order)
            and all(map(operator.is_, now.values(), self._order))
            and _identical(self._insides.objects(), self._inside_objects)
        )

    def changes(self) -> Iterator[str]:
        """One line per attribute replaced, deleted, modified in place or (``additions``) added."""
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
        """Put the recorded attributes back and delete added ones; TypeError or AttributeError
        when the owner refuses.
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
