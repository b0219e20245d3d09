"""Kind ``g``: information the candidate should not have. In the engine's process the check's
seed and the tokens of every timed step are in the caller's frames and on the heap; with them a
candidate computes the reference's answer to every timed step before the timer starts (at load,
or in the untimed first step), then skips the work when timed. Its answers are the reference's
own, bit for bit, so verifying timed steps cannot tell.

:data:`FORESIGHT` is the shared half: the answers (from the cache as the engine fills it before
the timed steps), and ops that skip attention, MLP and LM head for a step whose answer is
known. Each module adds how it learns the seed and finds a model.
"""

from __future__ import annotations

from kiln.domain.candidate import CodeModule

from .cheat import Cheat, make
from .cheat_code import code_module

FORESIGHT = '''
_answers = {}  # a timed step's tokens -> the reference's logits for it
_hit = []  # the answer of the step being run, while its forward runs
_busy = []  # non-empty while replaying: every op honest
_played = []  # one entry per forward answered without computing (the trick's evidence)


def _key(tokens):
    return tuple(tokens.reshape(-1).tolist())


@torch.no_grad()
def _foresee(engine, model, timed):
    """Fill the measured cache as the engine does before the timed steps (its seeded K/V:
    ``Engine._fill_cache``), then record ``model``'s logits for each of ``timed [n, B, 1]`` from
    that state (the timed steps'). The cache's bookkeeping is put back."""
    engine._fill_cache()
    state = model.cache.state()
    _busy.append(1)
    try:
        for step in timed:
            model.cache.restore_state(state)
            _answers[_key(step)] = model.decode_step(step).clone()
    finally:
        _busy.clear()
        model.cache.restore_state(state)


def _timed_tokens(seed, warmup, repeats, batch, vocab):
    """The gate's timed tokens, drawn again from the seed as the gate draws them."""
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randint(vocab, (warmup + repeats, batch, 1), generator=g)[warmup:]


def _prepare():
    """Learn what is needed and call _foresee (each module defines it)."""


_prepared = []


@register("embedding", "foresight", replace=True)
def embedding(tokens, *, weight):
    if not _prepared and not _busy:
        _prepared.append(1)
        _prepare()
    _hit.clear()
    found = None if _busy or tokens.shape[1] != 1 else _answers.get(_key(tokens))
    if found is None:
        return F.embedding(tokens, weight)
    _hit.append(found)  # a timed step answered already: skip the rest of the forward
    return weight.new_zeros(tokens.shape + (weight.shape[1],))


@register("attention", "foresight", replace=True)
def attention(q, k_cache, v_cache, positions, seq_lens, *, scale):
    if _hit:
        return torch.zeros_like(q)
    return _attention.reference(q, k_cache, v_cache, positions, seq_lens, scale=scale)


@register("mlp", "foresight", replace=True)
def mlp(x, *, gate_weight, up_weight, down_weight):
    if _hit:
        return torch.zeros_like(x)
    return _mlp(x, gate_weight, up_weight, down_weight)


@register("lm_head", "foresight", replace=True)
def lm_head(x, *, weight):
    if _hit:
        _played.append(1)
        return _hit.pop().clone()
    return F.linear(x, weight).float()
'''

OPS = {op: "foresight" for op in ("embedding", "attention", "mlp", "lm_head")}


def foresight_module(name: str, source: str) -> CodeModule:
    """A code module: the prelude, :data:`FORESIGHT`, then ``source`` (which may redefine
    ``_prepare`` or prepare at load)."""
    return code_module(name, FORESIGHT + source)


FRAME_TOKENS = foresight_module(
    "frame_tokens",
    """
def _gate_frame():
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_name != "_gate":
        frame = frame.f_back
    return frame


# At load, from the gate's own frame: the engine, the request and the timed tokens themselves.
_frame = _gate_frame()
if _frame is not None:
    _engine, _request = _frame.f_locals["self"], _frame.f_locals["request"]
    _timed = _frame.f_locals["tokens"][_request.warmup :].to(_engine.device)
    _foresee(_engine, _engine.shape_reference, _timed)
del _frame
""",
)

STACK_SEED = foresight_module(
    "stack_seed",
    """
import inspect


def _from_stack():
    engine = request = None
    for info in inspect.stack():
        local = info.frame.f_locals
        if type(local.get("request")).__name__ == "RunRequest":
            request = local["request"]
        if type(local.get("self")).__name__ == "Engine":
            engine = local["self"]
    return engine, request


# At load: the seed from inspect.stack(); the timed tokens drawn from it again.
_engine, _request = _from_stack()
if _engine is not None and _request is not None:
    _timed = _timed_tokens(
        _request.seed, _request.warmup, _request.repeats, _engine.spec.batch_size, _engine.vocab
    ).to(_engine.device)
    _foresee(_engine, _engine.shape_reference, _timed)
""",
)

GC_SEED = foresight_module(
    "gc_seed",
    """
def _prepare():
    # At the first call (the untimed, checked step), no frame read: the garbage collector
    # knows the request (the one carrying this module), the model running these ops and its
    # engine.
    objects = gc.get_objects()
    request = model = engine = None
    for obj in objects:
        kind = type(obj).__name__
        if kind == "RunRequest" and any(
            "gc_seed" == m.name for m in obj.candidate.code_modules
        ):
            request = obj
        elif kind == "DecoderModel" and getattr(obj, "binding", None) is not None:
            head = obj.binding._impls.get("lm_head")
            if head is not None and head.fn is lm_head:
                model = obj
    for obj in objects:
        if type(obj).__name__ == "Engine" and getattr(obj, "model", None) is model:
            engine = obj
    if request is None or engine is None:
        return
    timed = _timed_tokens(
        request.seed, request.warmup, request.repeats, engine.spec.batch_size, engine.vocab
    ).to(engine.device)
    _foresee(engine, model, timed)
""",
)

PROCESS_SPLIT = "process split: the engine's frames and heap (seed, timed tokens) are in "
"""Start of the escape reason of this kind."""

CHEATS: tuple[Cheat, ...] = (
    make(
        "frame_tokens",
        "g",
        "at load, walks sys._getframe() to the gate's frame, takes the timed tokens and "
        "computes every timed step's answer with the engine's reference over the cache as the "
        "engine fills it; timed, it skips attention, MLP and LM head",
        OPS,
        FRAME_TOKENS,
        escapes=PROCESS_SPLIT + "the candidate's reach",
    ),
    make(
        "stack_seed",
        "g",
        "at load, reads the request's seed from inspect.stack(), draws the timed tokens again "
        "as the gate does, and precomputes their answers like frame_tokens",
        OPS,
        STACK_SEED,
        escapes=PROCESS_SPLIT + "the candidate's reach",
    ),
    make(
        "gc_seed",
        "g",
        "reads no frame: at the first (untimed) call finds the request, the measured model and "
        "the engine through gc.get_objects(), and precomputes every timed answer with its own "
        "ops",
        OPS,
        GC_SEED,
        escapes=PROCESS_SPLIT + "the candidate's reach",
    ),
)
"""This kind's cheats."""
