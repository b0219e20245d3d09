"""Op implementations chosen by name.

Every op of the decoder (``OPS``) has a plain-PyTorch ``reference`` and any number of alternatives
(:func:`register`, :func:`get`). An implementation is a function: positional call tensors (the same
for every implementation of the op), keyword params bound once per call site (weights, config
scalars), tensors out. One needing weights in another layout names a :class:`Derivation`, computed
once per site and cached in the weight store. Importing :mod:`kiln.ops` registers the built-ins; a
candidate's module registers more (``replace=True`` on hot reload).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

REFERENCE = "reference"

#: The ops a decoder is made of, with their call contract in one line (details in each family's
#: module).
OPS: dict[str, str] = {
    "embedding": "tokens[B,T] int64 -> hidden[B,T,H]",
    "rms_norm": "x[...,N], residual[...,N]|None -> (normed[...,N], residual_out[...,N])",
    "qkv_proj": "x[B,T,H] -> (q[B,Hq,T,D], k[B,Hkv,T,D], v[B,Hkv,T,D])",
    "rope": "q[B,Hq,T,D], k[B,Hkv,T,D], positions[B,T] int64 -> (q, k) rotated",
    "attention": "q[B,Hq,T,D], k_cache[B,Hkv,S,D], v_cache[B,Hkv,S,D], positions[B,T], "
    "seq_lens[B] -> out[B,Hq,T,D]",
    "o_proj": "attn[B,Hq,T,D] -> hidden[B,T,H]",
    "mlp": "x[B,T,H] -> [B,T,H] (gate/up/down, SiLU)",
    "moe": "x[B,T,H] -> [B,T,H] (router top-k + SwiGLU experts)",
    "lm_head": "x[...,H] -> logits[...,V] float32",
    "sampler": "logits[B,V] float32 -> tokens[B] int64",
}

F = TypeVar("F", bound=Callable[..., Any])


class OpLookupError(KeyError):
    """Base of the registry's lookup errors; ``str()`` is the plain message (not repr-quoted
    like a bare ``KeyError``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class UnknownOpError(OpLookupError):
    """The op name is not one of :data:`OPS`; the message lists the known ones."""


class UnknownImplementationError(OpLookupError):
    """The op has no implementation of that name; the message lists the registered ones."""


class DuplicateImplementationError(ValueError):
    """:func:`register` of an (op, impl) pair that exists, without ``replace=True``."""


@dataclass(frozen=True)
class Derivation:
    """A named weight-layout transform, e.g. ``Derivation("fused_qkv", fuse)``.

    ``fn`` maps an op site's base params (the keyword params the ``reference`` implementation
    takes: weights as stored in the checkpoint, plus config scalars) to the params the deriving
    implementation takes. It must not modify its input. Engines cache its result per
    (``name``, site), so ``name`` must identify the transform (and its parameters) uniquely.
    """

    name: str
    fn: Callable[[Mapping[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class OpImpl:
    """One registered implementation of an op.

    Attributes:
        op: the op name (a key of :data:`OPS`).
        name: the implementation name (``"reference"``, ``"sdpa"``, ...).
        fn: the function; positional call tensors, keyword params.
        lossy: True when it changes results beyond dtype rounding (quantization); used only when a
            candidate opts in, and reported.
        derived: the weight transform it needs, or None to take the base params.
        devices: the device types it runs on, or None for every device; search spaces offer it only
            there.
        capturable: False when a call synchronises with the host or has data-dependent shapes;
            search spaces never pair it with ``cuda_graph``. Every built-in is capturable.
        alias_of: the implementation this older name now runs; search spaces do not offer aliases.
    """

    op: str
    name: str
    fn: Callable[..., Any]
    lossy: bool = False
    derived: Derivation | None = None
    devices: tuple[str, ...] | None = None
    capturable: bool = True
    alias_of: str | None = None

    def runs_on(self, device_type: str) -> bool:
        """True when the implementation runs on ``device_type`` (``"cpu"``, ``"cuda"``)."""
        return self.devices is None or device_type in self.devices

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


_REGISTRY: dict[str, dict[str, OpImpl]] = {op: {} for op in OPS}


def _check_op(op: str) -> dict[str, OpImpl]:
    try:
        return _REGISTRY[op]
    except KeyError:
        raise UnknownOpError(f"unknown op {op!r} (known ops: {', '.join(OPS)})") from None


def register(
    op: str,
    impl: str,
    *,
    lossy: bool = False,
    derived: Derivation | None = None,
    devices: tuple[str, ...] | None = None,
    capturable: bool = True,
    alias_of: str | None = None,
    replace: bool = False,
) -> Callable[[F], F]:
    """Decorator registering ``fn`` as implementation ``impl`` of ``op``; returns ``fn`` unchanged.

    Raises:
        UnknownOpError: ``op`` is not one of :data:`OPS`.
        DuplicateImplementationError: ``impl`` is registered already and ``replace`` is False.
        ValueError: ``impl`` is empty.
    """
    impls = _check_op(op)
    if not impl:
        raise ValueError("implementation name must not be empty")
    if impl in impls and not replace:
        raise DuplicateImplementationError(
            f"{op}: implementation {impl!r} is registered already (pass replace=True to redefine)"
        )

    def decorate(fn: F) -> F:
        impls[impl] = OpImpl(
            op=op, name=impl, fn=fn, lossy=lossy, derived=derived, devices=devices,
            capturable=capturable, alias_of=alias_of,
        )  # fmt: skip
        return fn

    return decorate


def unregister(op: str, impl: str) -> None:
    """Remove an implementation (a code module being unloaded). The reference cannot be removed.

    Raises:
        UnknownOpError, UnknownImplementationError: no such op or implementation.
        ValueError: ``impl`` is ``"reference"``.
    """
    get(op, impl)
    if impl == REFERENCE:
        raise ValueError(f"{op}: the reference implementation cannot be unregistered")
    del _REGISTRY[op][impl]


def ops() -> tuple[str, ...]:
    """All op names, in forward order."""
    return tuple(OPS)


def implementations(op: str) -> tuple[str, ...]:
    """The implementation names registered for ``op``, ``reference`` first, then sorted.

    Raises:
        UnknownOpError: ``op`` is not one of :data:`OPS`.
    """
    names = _check_op(op)
    return tuple(sorted(names, key=lambda n: (n != REFERENCE, n)))


def get(op: str, impl: str = REFERENCE) -> OpImpl:
    """The implementation ``impl`` of ``op``.

    Raises:
        UnknownOpError: ``op`` is not one of :data:`OPS` (the message lists them).
        UnknownImplementationError: no implementation ``impl`` (the message lists the known ones).
    """
    impls = _check_op(op)
    try:
        return impls[impl]
    except KeyError:
        known = ", ".join(implementations(op)) or "none yet"
        raise UnknownImplementationError(
            f"op {op!r} has no implementation {impl!r} (known: {known})"
        ) from None
