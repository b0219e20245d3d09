"""Kind ``f``: outputs that are not plain tensors. A ``torch.Tensor`` subclass passes every
``isinstance`` test, and what the engine then does with it (copy, compare) runs the subclass's
own code: it can compute after the timer stopped, or answer the comparison itself.
"""

from __future__ import annotations

from .cheat import Cheat, make
from .cheat_code import code_module

LAZY_LOGITS = code_module(
    "lazy_logits",
    '''
_computed = []  # one entry per LM head computed late
_played = []  # one entry per logits returned uncomputed


class _Lazy(torch.Tensor):
    """Logits of the right shape and dtype that are computed the first time anything reads
    them: after the timed call returned, when the engine copies or poisons them."""

    def _force(self):
        pending = self.__dict__.pop("_pending", None)
        with torch._C.DisableTorchFunctionSubclass():
            plain = self.as_subclass(torch.Tensor)
            if pending is not None:
                x, weight = pending
                plain.copy_(F.linear(x, weight).float())
                _computed.append(1)
        return plain

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def plain(a):
            return a._force() if isinstance(a, _Lazy) else a

        args = [plain(a) for a in args]
        kwargs = {k: plain(v) for k, v in (kwargs or {}).items()}
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


@register("lm_head", "lazy", replace=True)
def lazy(x, *, weight):
    if _checked():
        return F.linear(x, weight).float()
    out = torch.empty(x.shape[:-1] + (weight.shape[0],), dtype=torch.float32, device=x.device)
    out = torch.Tensor._make_subclass(_Lazy, out)
    out._pending = (x, weight)  # nothing computed inside the timed call
    _played.append(1)
    return out
''',
)

LAZY_DISPATCH = code_module(
    "lazy_dispatch",
    '''
from torch.utils._pytree import tree_map

_computed = []
_played = []


class _Deferred(torch.Tensor):
    """A wrapper tensor (no storage of its own) whose logits are computed by the first aten op
    that touches it, at the dispatcher level."""

    @staticmethod
    def __new__(cls, x, weight):
        shape = x.shape[:-1] + (weight.shape[0],)
        out = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=torch.float32, device=x.device
        )
        out._pending, out._value = (x, weight), None
        return out

    def _force(self):
        if self._value is None:
            x, weight = self._pending
            self._value = F.linear(x, weight).float()
            _computed.append(1)
        return self._value

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def plain(a):
            return a._force() if isinstance(a, _Deferred) else a

        return func(*tree_map(plain, args), **tree_map(plain, kwargs or {}))

    def untyped_storage(self):
        return self._force().untyped_storage()


@register("lm_head", "deferred_dispatch", replace=True)
def deferred_dispatch(x, *, weight):
    if _checked():
        return F.linear(x, weight).float()
    _played.append(1)
    return _Deferred(x, weight)
''',
)

ANSWERING_TENSOR = code_module(
    "answering_tensor",
    '''
_AGREE = {"sub", "__sub__", "__rsub__", "rsub"}  # a difference from ours: zeros
_EQUAL = {"eq", "__eq__", "isclose"}
_UNEQUAL = {"ne", "__ne__"}
_SAME = {"allclose", "equal"}
_played = []


class _Agreeable(torch.Tensor):
    """Zeros that, through __torch_function__, tell whoever compares them that they match:
    a difference is zero, an equality test true, an inequality false."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if len(tensors) == 2 and name in _AGREE | _EQUAL | _UNEQUAL | _SAME:
            with torch._C.DisableTorchFunctionSubclass():
                shape = torch.broadcast_shapes(tensors[0].shape, tensors[1].shape)
                if name in _SAME:
                    return True
                if name in _AGREE:
                    out = torch.zeros(shape, device=tensors[0].device)
                else:
                    out = torch.full(shape, name in _EQUAL, device=tensors[0].device)
            return out.as_subclass(cls)
        return super().__torch_function__(func, types, args, kwargs)


@register("lm_head", "agreeable", replace=True)
def agreeable(x, *, weight):
    # No LM head at all, checked or not: zeros that agree with any reference.
    _played.append(1)
    shape = x.shape[:-1] + (weight.shape[0],)
    return torch.zeros(shape, dtype=torch.float32, device=x.device).as_subclass(_Agreeable)
''',
)

DUNDER_ANSWERS = code_module(
    "dunder_answers",
    '''
_played = []


class _Agreeable(torch.Tensor):
    """Zeros whose Python operators say they match anything: no __torch_function__ of its own
    (torch's default keeps the subclass through detach/float/clone and argmax), only the
    methods a comparison calls."""

    def __sub__(self, other):
        return torch.zeros_like(self)

    def __rsub__(self, other):
        return torch.zeros_like(self)

    def __ne__(self, other):
        return torch.zeros_like(self, dtype=torch.bool)

    def __eq__(self, other):
        return torch.ones_like(self, dtype=torch.bool)

    def allclose(self, other, *args, **kwargs):
        return True

    __hash__ = torch.Tensor.__hash__


@register("lm_head", "dunder", replace=True)
def dunder(x, *, weight):
    _played.append(1)
    shape = x.shape[:-1] + (weight.shape[0],)
    return torch.zeros(shape, dtype=torch.float32, device=x.device).as_subclass(_Agreeable)
''',
)

PLAIN = "not a plain torch.Tensor"
"""In the error when an output the gate reads is not exactly a torch.Tensor (exact types)."""

CHEATS: tuple[Cheat, ...] = (
    make(
        "lazy_logits",
        "f",
        "returns an empty torch.Tensor subclass whose __torch_function__ computes the LM head "
        "the first time anything reads it: the engine's copy, after the timer stopped",
        {"lm_head": "lazy"},
        LAZY_LOGITS,
        (PLAIN,),
    ),
    make(
        "lazy_dispatch",
        "f",
        "returns a storage-less wrapper subclass whose __torch_dispatch__ computes the LM head "
        "when the first aten op (the engine's detach) touches it",
        {"lm_head": "deferred_dispatch"},
        LAZY_DISPATCH,
        (PLAIN,),
    ),
    make(
        "answering_tensor",
        "f",
        "returns zeros as a subclass whose __torch_function__ answers sub/ne/eq/allclose with "
        "'equal', so the engine's own comparison finds no difference",
        {"lm_head": "agreeable"},
        ANSWERING_TENSOR,
        (PLAIN,),
    ),
    make(
        "dunder_answers",
        "f",
        "returns zeros as a subclass overriding __sub__/__ne__/__eq__/allclose only (torch "
        "keeps the subclass through detach, float, clone and argmax)",
        {"lm_head": "dunder"},
        DUNDER_ANSWERS,
        (PLAIN,),
    ),
)
"""This kind's cheats."""
