"""Kind ``i``, part one: the verifier's own choices. Which timed step is verified is drawn from
``random.SystemRandom`` after each call; the tolerance comes from
``kiln.runtime.check.TOLERANCES`` (immutable tuples of floats, watched by content). A candidate
that controls the draw is honest on the verified step only and skips every other layer's MLP
elsewhere (:data:`SKIP_UNVERIFIED`); one that loosens the table passes wrong outputs.
"""

from __future__ import annotations

from kiln.domain.candidate import CodeModule
from kiln.runtime.state_guard import TABLE_CHANGED

from .cheat import TAMPERED, VERIFIED, Cheat, make
from .cheat_code import code_module

SKIP_UNVERIFIED = '''
import random

_forwards = []  # unwatched forwards seen, counted at the first layer's MLP
_played = []


def _verified_now():
    """Whether the current unwatched forward is the one that will be verified (each module
    says; here: the first)."""
    return len(_forwards) == 1


def _take_over():
    """Called at the first layer of each unwatched forward before deciding (each module may
    use it to take over the verifier's choice)."""


def _frame_of(name):
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_name != name:
        frame = frame.f_back
    return frame


@register("mlp", "skip_unverified", replace=True)
def skip_unverified(x, *, gate_weight, up_weight, down_weight):
    layer = _layer(down_weight)
    watched = _checked()
    if layer == 0 and not watched:
        _forwards.append(1)
        _take_over()
    if layer % 2 == 1 and not watched and not _verified_now():
        _played.append(1)
        return torch.zeros_like(x)  # every other layer's MLP skipped, unless verified
    return _mlp(x, gate_weight, up_weight, down_weight)
'''

OPS = {"mlp": "skip_unverified"}


def _module(name: str, source: str) -> CodeModule:
    return code_module(name, SKIP_UNVERIFIED + source)


SYSTEM_RANDOM_REBIND = _module(
    "system_random_rebind",
    '''

class _FirstOnly(random.Random):
    """Draws that never pick a new step once one is kept: the first timed step stays."""

    def randrange(self, start, stop=None, step=1):
        return (start if stop is None else stop) - 1


random.SystemRandom = _FirstOnly  # what the engine's TimedOutputs will instantiate
''',
)

RANDRANGE_PATCH = _module(
    "randrange_patch",
    """
_randrange = random.Random.randrange


def _first_only(self, start, stop=None, step=1):
    if isinstance(self, random.SystemRandom):
        return (start if stop is None else stop) - 1  # only the first timed step is kept
    return _randrange(self, start, stop, step)


random.Random.randrange = _first_only  # in place: random.SystemRandom is the same class
""",
)

URANDOM_REBIND = _module(
    "urandom_rebind",
    """
def _zeros(n):
    return bytes(n)


# SystemRandom reads the OS through random._urandom: all zeros make every draw 0, so each timed
# step replaces the kept one and the last step is the one verified.
random._urandom = _zeros


def _verified_now():
    timing = _frame_of("_time")
    return timing is not None and timing.f_locals["i"] == timing.f_locals["request"].repeats - 1
""",
)

RESERVOIR_RNG = _module(
    "reservoir_rng",
    '''

class _FirstOnly(random.Random):
    def randrange(self, start, stop=None, step=1):
        return (start if stop is None else stop) - 1


def _take_over():
    """At the first timed call: the timing loop's reservoir gets a generator that keeps the
    first step only (an attribute of an object of the gate's, not of a module or class)."""
    timing = _frame_of("_time")
    if timing is not None and len(_forwards) == 1:
        timing.f_locals["kept"]._rng = _FirstOnly()
''',
)

RESERVOIR_OFF = _module(
    "reservoir_off",
    '''
def _take_over():
    """At the first timed call: the timing loop's reservoir keeps no step at all."""
    timing = _frame_of("_time")
    if timing is not None:
        timing.f_locals["kept"].k = 0


def _verified_now():
    return False
''',
)

_ZERO_ATTENTION = """
_played = []


@register("attention", "nothing", replace=True)
def nothing(q, k_cache, v_cache, positions, seq_lens, *, scale):
    _played.append(1)
    return torch.zeros_like(q)
"""

LOOSENED_TABLE = code_module(
    "loosened_table",
    """
import ctypes

from kiln.runtime import check as _check

# The tolerance table is a tuple of named tuples (no item assignment, no attribute to set, the
# module attribute fingerprinted): its floats are written in place through ctypes, so the gate
# reads the same objects, loosened, in this experiment and every later one.
_OFFSET = float.__basicsize__ - ctypes.sizeof(ctypes.c_double)
for _row in _check.TOLERANCES:
    for _value in _row[1:]:
        ctypes.c_double.from_address(id(_value) + _OFFSET).value = 1e9
ctypes.c_double.from_address(id(_check.LOSSY_RTOL) + _OFFSET).value = 1e9
"""
    + _ZERO_ATTENTION,
)

RTOL_REBIND = code_module(
    "rtol_rebind",
    """
import kiln.runtime.check as _check

_check.TOLERANCES = tuple(row._replace(rms_factor=1e9, max_factor=1e9) for row in _check.TOLERANCES)
_check.LOSSY_RTOL = 1e9  # module attributes, rebound
"""
    + _ZERO_ATTENTION,
)

FINGERPRINTED = (TAMPERED,)

CHEATS: tuple[Cheat, ...] = (
    make(
        "system_random_rebind",
        "i",
        "rebinds random.SystemRandom to a generator that keeps only the first timed step; "
        "honest there, skips every other layer's MLP on the rest",
        OPS,
        SYSTEM_RANDOM_REBIND,
        (*FINGERPRINTED, "random.SystemRandom replaced"),
    ),
    make(
        "randrange_patch",
        "i",
        "patches random.Random.randrange in place (SystemRandom inherits it): only the first "
        "timed step is kept; honest there, skips MLPs on the rest",
        OPS,
        RANDRANGE_PATCH,
        (VERIFIED,),
        timed_steps=40,
    ),
    make(
        "urandom_rebind",
        "i",
        "rebinds random._urandom to zeros, so every draw is 0 and the last timed step is the "
        "one verified; honest on the last (read from the timing loop's frame), skips MLPs on "
        "the rest",
        OPS,
        URANDOM_REBIND,
        (*FINGERPRINTED, "random._urandom replaced"),
    ),
    make(
        "reservoir_rng",
        "i",
        "at the first timed call, replaces the generator of the timing loop's TimedOutputs "
        "(found in its frame) with one that keeps only that step; skips MLPs after",
        OPS,
        RESERVOIR_RNG,
        (VERIFIED,),
        timed_steps=40,
    ),
    make(
        "reservoir_off",
        "i",
        "at the first timed call, sets the timing loop's TimedOutputs.k to 0: no timed step is "
        "kept, none verified; skips MLPs on every timed step",
        OPS,
        RESERVOIR_OFF,
        escapes="process split: the reservoir is an object of the gate's in the candidate's "
        "reach ('verified timed step(s) none' is still ok)",
    ),
    make(
        "loosened_table",
        "i",
        "writes 1e9 into every float of kiln.runtime.check.TOLERANCES (and LOSSY_RTOL) in "
        "place through ctypes and returns zeros for attention: the gate reads the loosened "
        "table (the table's content is recorded at import, compared after the gate and put "
        "back)",
        {"attention": "nothing"},
        LOOSENED_TABLE,
        (*FINGERPRINTED, TABLE_CHANGED),
        runs=2,
    ),
    make(
        "rtol_rebind",
        "i",
        "rebinds kiln.runtime.check.TOLERANCES and kiln.runtime.check.LOSSY_RTOL to "
        "huge values and returns zeros for attention",
        {"attention": "nothing"},
        RTOL_REBIND,
        (
            *FINGERPRINTED,
            "kiln.runtime.check.TOLERANCES replaced",
            "kiln.runtime.check.LOSSY_RTOL replaced",
        ),
    ),
)
"""This part's cheats."""
