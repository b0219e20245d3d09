"""Kind ``h``: the timing statistic. The engine reports the median of the timed steps, so one
slow step among four costs nothing: the first timed call computes every timed step's answer
(the tokens it needs are within reach, :mod:`.information`), the rest return them at once. Each
answer is the candidate's own honest forward on the right cache state, so verifying timed
steps cannot tell.
"""

from __future__ import annotations

from .cheat import Cheat, make
from .information import OPS, foresight_module

ALL_AT_ONCE = '''
def _all_at_once(model, steps):
    """Compute ``model``'s answer to every step of ``steps [n, B, 1]`` from the cache state it
    is in now (every timed step starts from it), inside the current timed call."""
    state = model.cache.state()
    _busy.append(1)
    try:
        for step in steps:
            model.cache.restore_state(state)
            _answers[_key(step)] = model.decode_step(step).clone()
    finally:
        _busy.clear()
        model.cache.restore_state(state)


def _caller(name):
    """The innermost frame of a function called ``name`` on the stack, or None."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_name != name:
        frame = frame.f_back
    return frame
'''

FRONT_LOADED_STORAGE = foresight_module(
    "front_loaded_storage",
    ALL_AT_ONCE
    + """
_seen = set()


@register("embedding", "front_loaded", replace=True)
def front_loaded(tokens, *, weight):
    storage = tokens.untyped_storage()
    bigger = storage.nbytes() > tokens.numel() * tokens.element_size()
    if not _busy and not _checked() and bigger and storage.data_ptr() not in _seen:
        _seen.add(storage.data_ptr())
        # The step's tokens are a view: the storage behind it holds every step's tokens.
        every = tokens.new_empty(0).set_(storage).view(-1, *tokens.shape)
        _all_at_once(_caller("decode_step").f_locals["self"], every)
    return embedding(tokens, weight=weight)
""",
)

FRONT_LOADED_FRAMES = foresight_module(
    "front_loaded_frames",
    ALL_AT_ONCE
    + """
_done = []


@register("embedding", "front_loaded", replace=True)
def front_loaded(tokens, *, weight):
    timing = None if (_busy or _done) else _caller("_time")
    if timing is not None:
        _done.append(1)
        # The first timed call: the timing loop's frame holds every timed step's tokens.
        model = _caller("decode_step").f_locals["self"]
        _all_at_once(model, timing.f_locals["steps"])
    return embedding(tokens, weight=weight)
""",
)

TIMING_STATISTIC = (
    "timing statistic: not rejected (an ok counts as an escape), but the mean decides its "
    "tokens/s, so it gains at most 1.25x"
)
"""Start of the escape reason of this kind."""

CHEATS: tuple[Cheat, ...] = (
    make(
        "front_loaded_storage",
        "h",
        "the first timed call reads every timed step's tokens through untyped_storage() of its "
        "own token tensor (a view of the gate's [steps, B, 1] tensor), computes all their "
        "answers, and the other timed calls skip attention, MLP and LM head",
        {**OPS, "embedding": "front_loaded"},
        FRONT_LOADED_STORAGE,
        escapes=TIMING_STATISTIC + " (and each step's tokens a fresh tensor, process split)",
    ),
    make(
        "front_loaded_frames",
        "h",
        "the first timed call takes every timed step's tokens from the timing loop's frame "
        "(sys._getframe), computes all their answers; the rest return them",
        {**OPS, "embedding": "front_loaded"},
        FRONT_LOADED_FRAMES,
        escapes=TIMING_STATISTIC + " (or the frames out of reach, process split)",
    ),
)
"""This kind's cheats."""
