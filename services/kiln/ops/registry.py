"""Op implementations chosen by name.

Every op (``OPS``) has a plain-PyTorch ``reference`` and any number of alternatives. An
implementation takes the op's positional call tensors and keyword params bound once per call
site (weights, config scalars) and returns tensors; one needing another weight layout names a
:class:`Derivation`. Importing :mod:`kiln.ops` registers the built-ins.
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
    "mla_proj": "x[B,T,H] -> (q_nope[B,Hq,T,Dn], q_rope[B,Hq,T,Dr], latent[B,1,T,R], "
    "k_rope[B,1,T,Dr]) (latent attention)",
    "rope": "q[B,Hq,T,D], k[B,Hkv,T,D], positions[B,T] int64 -> (q, k) rotated",
    "attention": "q[B,Hq,T,D], k_cache[B,Hkv,S,D], v_cache[B,Hkv,S,D], positions[B,T], "
    "seq_lens[B] -> out[B,Hq,T,D]",
    "mla_attention": "q_nope[B,Hq,T,Dn], q_rope[B,Hq,T,Dr], latent_cache[B,1,S,R], "
    "rope_cache[B,1,S,Dr], positions[B,T], seq_lens[B] -> out[B,Hq,T,Dv]",
    "dsa_index_proj": "x[B,T,H] -> (q[B,Hi,T,Di], k[B,1,T,Di], w[B,T,Hi] float32) (GLM-5's "
    "sparse-attention indexer)",
    "dsa_indexer": "q[B,Hi,T,Di], w[B,T,Hi], key_cache[B,1,S,Di], positions[B,T], seq_lens[B] "
    "-> topk_indices[B,T,K] int64 (-1: none)",
    "o_proj": "attn[B,Hq,T,D] -> hidden[B,T,H]",
    "mlp": "x[B,T,H] -> [B,T,H] (gate/up/down, SiLU)",
    "moe": "x[B,T,H] -> [B,T,H] (router top-k, softmax or grouped sigmoid, + SwiGLU experts)",
    "lm_head": "x[...,H] -> logits[...,V] float32",
    "sampler": "logits[B,V] float32 -> tokens[B] int64",
}

F = TypeVar("F", bound=Callable[..., Any])


class OpLookupError(KeyError):
    """Base of the lookup errors; ``str()`` is the plain message."""

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

    ``fn`` maps a site's base params to the deriving implementation's params without modifying
    its input; results are cached per (``name``, site), so ``name`` must identify the transform.
    """

    name: str
    fn: Callable[[Mapping[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class OpImpl:
    """One registered implementation of an op.

    Attributes:
        lossy: changes results beyond dtype rounding; used only when a candidate opts in.
        derived: the weight transform it needs, or None.
        devices: the device types it runs on (None: all).
        capturable: False when a call syncs with the host or has data-dependent shapes (never
            paired with ``cuda_graph``).
        alias_of: the implementation this older name runs (aliases are not offered).
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
    """Decorator registering ``fn`` as ``impl`` of ``op``; returns ``fn`` unchanged.

    Raises:
        UnknownOpError: ``op`` is not one of :data:`OPS`.
        DuplicateImplementationError: ``impl`` exists and ``replace`` is False.
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
    """Remove an implementation (not ``reference``: ValueError); UnknownOpError or
    UnknownImplementationError when there is none.
    """
    get(op, impl)
    if impl == REFERENCE:
        raise ValueError(f"{op}: the reference implementation cannot be unregistered")
    del _REGISTRY[op][impl]


def ops() -> tuple[str, ...]:
    """All op names, in forward order."""
    return tuple(OPS)


def implementations(op: str) -> tuple[str, ...]:
    """Implementation names of ``op``, ``reference`` first, then sorted; UnknownOpError if
    unknown.
    """
    names = _check_op(op)
    return tuple(sorted(names, key=lambda n: (n != REFERENCE, n)))


def get(op: str, impl: str = REFERENCE) -> OpImpl:
    """The implementation ``impl`` of ``op``; UnknownOpError or UnknownImplementationError."""
    impls = _check_op(op)
    try:
        return impls[impl]
    except KeyError:
        known = ", ".join(implementations(op)) or "none yet"
        raise UnknownImplementationError(
            f"op {op!r} has no implementation {impl!r} (known: {known})"
        ) from None
