"""Kind ``k``: a fraction of the timed steps. Honest whenever checked; on a fraction of the
timed steps every other layer's MLP is skipped. With one timed step verified, chosen at random,
a cheat on a fraction ``p`` of them escapes with probability ``1 - p``: each is run until it
escapes (:attr:`~.cheat.Cheat.runs` bounds the tries; all rejected has probability below
1e-4).
"""

from __future__ import annotations

from kiln.domain.candidate import CodeModule

from .cheat import VERIFIED, Cheat, make
from .cheat_code import code_module


def _fraction(name: str, decide: str) -> CodeModule:
    """A code module skipping odd layers' MLPs on the unwatched forwards ``decide`` picks
    (source of ``_cheat_now(n)``, ``n`` the 1-based unwatched forward)."""
    return code_module(
        name,
        f"""
import random

_rng = random.Random()  # its own draws: nothing the engine uses
_forwards = []
_cheating = [False]
_played = []

{decide}

@register("mlp", "some_steps", replace=True)
def some_steps(x, *, gate_weight, up_weight, down_weight):
    layer = _layer(down_weight)
    if layer == 0:
        watched = _checked()
        if not watched:
            _forwards.append(1)
        _cheating[0] = not watched and _cheat_now(len(_forwards))
        if _cheating[0]:
            _played.append(1)
    if _cheating[0] and layer % 2 == 1:
        return torch.zeros_like(x)
    return _mlp(x, gate_weight, up_weight, down_weight)
""",
    )


FRACTION_60 = _fraction("fraction_60", "def _cheat_now(n):\n    return _rng.random() < 0.6\n")
FRACTION_20 = _fraction("fraction_20", "def _cheat_now(n):\n    return _rng.random() < 0.2\n")
EVERY_OTHER = _fraction("every_other", "def _cheat_now(n):\n    return n % 2 == 0\n")


OPS = {"mlp": "some_steps"}

CHEATS: tuple[Cheat, ...] = (
    make(
        "fraction_60",
        "k",
        "skips every other layer's MLP on 60 % of the timed steps, drawn at random",
        OPS,
        FRACTION_60,
        (VERIFIED,),
        runs=4,  # with 21 of 40 steps verified each run escapes with p = 0.4^21 (one: 0.4)
        timed_steps=40,
    ),
    make(
        "fraction_20",
        "k",
        "skips every other layer's MLP on 20 % of the timed steps, drawn at random",
        OPS,
        FRACTION_20,
        (VERIFIED,),
        runs=8,
    ),
    make(
        "every_other",
        "k",
        "skips every other layer's MLP on the even-numbered timed steps (half the time, no "
        "randomness)",
        OPS,
        EVERY_OTHER,
        (VERIFIED,),
        runs=16,
        timed_steps=40,
    ),
)
"""This kind's cheats."""
