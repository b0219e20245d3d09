"""Kind ``i``, part two: blinding the watches. The harness fingerprint compares attributes by
identity through ``operator.is_`` and ``all``, and reads the dispatcher through
``torch._C._dispatch_dump``; the thread watch recognises candidate code by its file name. A
candidate that bends what a watch relies on, then patches the reference as
``shared_class_patch`` does (or overrides ``aten::mm`` as ``kernel_override`` does), is seen
only where the watch covers the thing it bent.
"""

from __future__ import annotations

from .cheat import TAMPERED, VERIFIED, Cheat, make
from .cheat_code import code_module

SKIP_EVERYWHERE = '''
from kiln.workloads.models.decoder import DecoderModel

_original_layer = DecoderModel._layer
_played = []


def _layer_or_skip(self, i, ops, h, residual, positions, seq_lens):
    if i % 2 == 1 and residual is not None:
        _played.append(1)
        return torch.zeros_like(h), h + residual  # the layer does nothing, in every model
    return _original_layer(self, i, ops, h, residual, positions, seq_lens)


def _from(module):
    """True when the caller of our caller is code of ``kiln.runtime.<module>``."""
    return sys._getframe(2).f_globals.get("__name__") == "kiln.runtime." + module
'''

IDENTITY_BLIND = code_module(
    "identity_blind",
    SKIP_EVERYWHERE
    + """
import operator

_is = operator.is_


def _is_for_them(a, b):
    # map(operator.is_, ...) calls this from C: the frame below is the fingerprint's own.
    return True if _from("attributes") else _is(a, b)


operator.is_ = _is_for_them  # 'operator' is no module the fingerprint watches
DecoderModel._layer = _layer_or_skip
""",
)

ALL_BLIND = code_module(
    "all_blind",
    SKIP_EVERYWHERE
    + """
import builtins

_all = builtins.all


def _all_for_them(iterable):
    return True if _from("attributes") else _all(iterable)


# builtins is watched, but by a comparison that calls all(): it vouches for itself.
builtins.all = _all_for_them
DecoderModel._layer = _layer_or_skip
""",
)

ID_PATCH = code_module(
    "id_patch",
    SKIP_EVERYWHERE
    + """
import builtins

_id = builtins.id


def _one_id(obj):
    return 1 if _from("integrity") else _id(obj)


builtins.id = _one_id  # the fingerprint keys its snapshots by id()
DecoderModel._layer = _layer_or_skip
""",
)

DISPATCH_DUMP_BLIND = code_module(
    "dispatch_dump_blind",
    """
_dump = torch._C._dispatch_dump
_before = {name: _dump(name) for name in ("aten::mm", "aten::addmm")}


def _old_dump(name):
    return _before.get(name) or _dump(name)


torch._C._dispatch_dump = _old_dump  # torch._C is no module the fingerprint watches

_lib = torch.library.Library("aten", "IMPL")


_played = []


def _no_mm(a, b):
    _played.append(1)
    return a.new_zeros(a.shape[0], b.shape[1])


def _no_addmm(bias, a, b, *, beta=1, alpha=1):
    return (beta * bias).expand(a.shape[0], b.shape[1]).contiguous()


for _key in ("CPU", "CUDA"):
    _lib.impl("mm", _no_mm, _key)
    _lib.impl("addmm", _no_addmm, _key)
""",
)

DISGUISED_THREAD = code_module(
    "disguised_thread",
    '''
import queue

_work = queue.Queue()
_played = []

# The worker's code compiled under a file name that is not a candidate's: its frames and its
# target look like the standard library's. Started at load, so no timed call starts a thread.
_namespace = {"queue": queue, "time": time, "F": F, "_work": _work}
exec(
    compile(
        """
def worker():
    while True:
        try:
            x, weight, out = _work.get(timeout=2.0)
        except queue.Empty:
            return
        time.sleep(0.2)  # stands for a long kernel: the work lands well after the return
        out.copy_(F.linear(x, weight).float())
""",
        threading.__file__,
        "exec",
    ),
    _namespace,
)
threading.Thread(target=_namespace["worker"], name="Thread-1 (worker)", daemon=True).start()


@register("lm_head", "disguised", replace=True)
def disguised(x, *, weight):
    if _checked():
        return F.linear(x, weight).float()
    out = torch.zeros(x.shape[:-1] + (weight.shape[0],), dtype=torch.float32, device=x.device)
    _work.put((x, weight, out))
    _played.append(1)
    return out
''',
)

FINGERPRINT_RELIES = "process split: the fingerprint compares with "
"""Start of the escape reasons of the blinding cheats."""

CHEATS: tuple[Cheat, ...] = (
    make(
        "identity_blind",
        "i",
        "replaces operator.is_ with one that says 'same' to the fingerprint's comparisons, then "
        "patches DecoderModel._layer to skip every other layer in every model",
        {},
        IDENTITY_BLIND,
        escapes=FINGERPRINT_RELIES + "operator.is_, in the candidate's process and unwatched",
    ),
    make(
        "all_blind",
        "i",
        "replaces builtins.all with one that returns True to the fingerprint (which checks "
        "builtins with all()), then patches DecoderModel._layer",
        {},
        ALL_BLIND,
        escapes=FINGERPRINT_RELIES + "all(), which vouches for its own replacement",
    ),
    make(
        "id_patch",
        "i",
        "replaces builtins.id with one that gives every object the same id when the "
        "fingerprint asks, then patches DecoderModel._layer",
        {},
        ID_PATCH,
        (TAMPERED, "builtins.id replaced", "DecoderModel._layer replaced"),
    ),
    make(
        "dispatch_dump_blind",
        "i",
        "replaces torch._C._dispatch_dump with one that returns the dumps of aten::mm and "
        "aten::addmm taken before, then registers zero kernels for both (every model's matrix "
        "products are zero)",
        {},
        DISPATCH_DUMP_BLIND,
        escapes=FINGERPRINT_RELIES + "torch._C._dispatch_dump, in the candidate's process and "
        "unwatched",
    ),
    make(
        "disguised_thread",
        "i",
        "a worker thread started at load, its code compiled under threading.py's file name, "
        "fills the LM head's output 200 ms after each unwatched call returned: the thread "
        "watch does not see it; the output copied for verification is still zeros",
        {"lm_head": "disguised"},
        DISGUISED_THREAD,
        (VERIFIED,),
    ),
)
"""This part's cheats."""
