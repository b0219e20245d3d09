"""Which implementation runs each op: the part of a model that hot reload swaps. Binding is
cheap:
no weight is read or copied unless a derived layout is needed for the first time.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import kiln.ops  # noqa: F401  (registers the built-in implementations)
from kiln.ops import registry
from kiln.ops.registry import REFERENCE, OpImpl
from kiln.workloads.models.slots import ModelSlots, Site
from kiln.workloads.weights import WeightStore

BoundOp = Callable[..., Any]


class LossyImplementationError(ValueError):
    """A recipe chose a lossy implementation without opting in (``allow_lossy=True``)."""


class BindError(TypeError):
    """An implementation's keyword params do not match what its site provides."""


def _check_params(impl: OpImpl, site: Site, params: Mapping[str, Any]) -> None:
    sig = inspect.signature(impl.fn)
    accepts = {
        n for n, p in sig.parameters.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
    }
    required = {
        n for n, p in sig.parameters.items() if p.kind is p.KEYWORD_ONLY and p.default is p.empty
    }
    has_var_kw = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    unexpected = [] if has_var_kw else sorted(set(params) - accepts)
    missing = sorted(required - set(params))
    if not has_var_kw:  # inputs the forward passes at call time (GLM-5's topk_indices)
        missing += sorted(set(site.call_params) - accepts)
    if unexpected or missing:
        raise BindError(
            f"{impl.op}={impl.name} at {site.name}: params do not match "
            f"(missing: {missing or 'none'}; unexpected: {unexpected or 'none'})"
        )


class OpBinding:
    """Op name -> implementation; ops missing from ``impls`` cannot be bound."""

    def __init__(self, impls: Mapping[str, OpImpl]) -> None:
        self._impls = dict(impls)

    @classmethod
    def from_recipe(
        cls, recipe: Mapping[str, str] | None = None, *, allow_lossy: bool = False
    ) -> OpBinding:
        """A binding with ``recipe[op]`` for the ops named, ``reference`` for every other.

        Raises:
            kiln.ops.registry.UnknownOpError, UnknownImplementationError: an unknown name.
            LossyImplementationError: a lossy implementation without ``allow_lossy``.
        """
        recipe = dict(recipe or {})
        impls: dict[str, OpImpl] = {}
        for op in registry.ops():
            if op in recipe:
                impls[op] = registry.get(op, recipe.pop(op))
            elif REFERENCE in registry.implementations(op):
                impls[op] = registry.get(op, REFERENCE)
        for op, name in recipe.items():  # what is left names ops that do not exist
            registry.get(op, name)
        lossy = sorted(f"{i.op}={i.name}" for i in impls.values() if i.lossy)
        if lossy and not allow_lossy:
            raise LossyImplementationError(
                f"lossy implementations need allow_lossy=True: {', '.join(lossy)}"
            )
        return cls(impls)

    @property
    def recipe(self) -> dict[str, str]:
        """Op -> implementation name, every bound op included."""
        return {op: impl.name for op, impl in self._impls.items()}

    @property
    def lossy(self) -> bool:
        """True when some implementation is lossy."""
        return any(impl.lossy for impl in self._impls.values())

    def impl(self, op: str) -> OpImpl:
        """The implementation chosen for ``op``; UnknownImplementationError if none."""
        try:
            return self._impls[op]
        except KeyError:
            known = ", ".join(registry.implementations(op)) or "none yet"
            raise registry.UnknownImplementationError(
                f"op {op!r} has no implementation bound (registered: {known})"
            ) from None

    def bind(self, site: Site, store: WeightStore) -> BoundOp:
        """The implementation of ``site.op`` with ``site.params`` (or its derived layout, cached
        in ``store``) bound; BindError when they do not fit its signature.
        """
        impl = self.impl(site.op)
        params: Mapping[str, Any] = site.params
        derived = impl.derived
        if derived is not None:
            params = store.derived(derived.name, site.name, lambda: derived.fn(site.params))
        _check_params(impl, site, params)
        return functools.partial(impl.fn, **params)

    def bind_model(self, slots: ModelSlots[Site], store: WeightStore) -> ModelSlots[BoundOp]:
        """Every site of a model bound (see :meth:`bind`)."""
        return slots.map(lambda site: self.bind(site, store))

    def __repr__(self) -> str:
        swapped = {op: n for op, n in self.recipe.items() if n != REFERENCE}
        return f"OpBinding({swapped or 'reference'})"
