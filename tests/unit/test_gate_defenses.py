"""The gate's defenses of issue 13 on a CPU engine: every output it reads must be exactly a
``torch.Tensor`` (subclasses that defer or fake their work, Parameters); front-loaded work
decides tokens/s by the mean; enough timed steps are verified, stacked into few reference
forwards, to catch a candidate wrong on a fraction of its steps; the escape probability is
recorded.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kiln.domain.candidate import Candidate
from kiln.engine_pool.settings import EngineSettings
from kiln.runtime import gate_check
from kiln.runtime.check import (
    PLAIN,
    NotPlainTensor,
    OutputGuard,
    TimedOutputs,
    compare,
    not_plain,
    run_steps,
)
from kiln.runtime.engine import Engine
from kiln.runtime.exact import stacked, step_bytes
from kiln.runtime.gate import JUDGED
from kiln.runtime.measurement import Measurement, Timing
from kiln.runtime.request import RunRequest
from kiln.runtime.spec import EngineLimits, EngineSpec
from kiln.runtime.timed_verification import (
    CHEAT_FRACTION,
    ESCAPE_TARGET,
    VERIFY_TIMED_STEPS,
    escape_probability,
    steps_to_verify,
)
from kiln.runtime.timing import summarize

from .engine_testing import module, tiny_workload

LIMITS = EngineLimits(max_batch=4, max_context=32, fast_layers=2, prompt_len=8, check_steps=2)
BATCH = 3  # the traffic shape's batch; the check's prompts are check_batch = 2

# Tells the check's calls from timed ones the way the red team's cheats do (tests/red_team).
CHECKED = """
import sys
import torch.nn.functional as F


def _checked():
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name in ("run_steps", "_check", "_verify", "compare"):
            return True
        frame = frame.f_back
    return False
"""


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    spec = EngineSpec.from_workload(tiny_workload(batch=BATCH, context=24), "fast", LIMITS)
    yield Engine(spec, engine_id="defenses")


def _run(engine: Engine, candidate: Candidate, **kw: Any) -> Measurement:
    values: dict[str, Any] = {"warmup": 1, "repeats": 4, **kw}
    return engine.run(RunRequest("defenses", candidate, **values))


def _head(name: str, body: str) -> Candidate:
    """A candidate whose ``lm_head`` is ``name`` from a code module (``x``, ``weight`` in
    scope; :data:`CHECKED`'s helpers too)."""
    source = f"""{CHECKED}
{body}
"""
    return Candidate.make({"lm_head": name}, code_modules=[module(name, source)])


# --------------------------------------------------------------------------- exact types

DEFERRED = '''
class Deferred(torch.Tensor):
    """Empty logits that do the LM head when anything reads them: after the timer stopped."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def real(a):
            if isinstance(a, Deferred):
                with torch._C.DisableTorchFunctionSubclass():
                    return F.linear(a.x, a.w).float()
            return a
        return func(*[real(a) for a in args], **{k: real(v) for k, v in (kwargs or {}).items()})
'''

DEFERRED_SUBCLASS = _head(
    "deferred_subclass",
    DEFERRED
    + """
@register("lm_head", "deferred_subclass", replace=True)
def deferred_subclass(x, *, weight):
    out = torch.empty(x.shape[0], weight.shape[0]).as_subclass(Deferred)
    out.x, out.w = x, weight
    return out
""",
)

LAZY_WRAPPER = """
from torch.utils._pytree import tree_map


class Lazy(torch.Tensor):
    \"\"\"A wrapper subclass with no data of its own: every ATen op on it computes the logits
    first (what a harness's copy triggers, after the timer stopped).\"\"\"

    @staticmethod
    def __new__(cls, x, weight):
        out = torch.Tensor._make_wrapper_subclass(
            cls, (x.shape[0], weight.shape[0]), dtype=torch.float32, device=x.device
        )
        out.x, out.w = x, weight
        return out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def real(a):
            return F.linear(a.x, a.w).float() if isinstance(a, Lazy) else a
        return func(*tree_map(real, args), **tree_map(real, kwargs or {}))
"""

LAZY_WHEN_TIMED = _head(
    "lazy_when_timed",
    LAZY_WRAPPER
    + """
@register("lm_head", "lazy_when_timed", replace=True)
def lazy_when_timed(x, *, weight):
    if _checked():
        return F.linear(x, weight).float()
    return Lazy(x, weight)
""",
)

LAZY_POSING_AS_PLAIN = _head(
    "lazy_posing",
    LAZY_WRAPPER
    + """
@register("lm_head", "lazy_posing", replace=True)
def lazy_posing(x, *, weight):
    if _checked():
        return F.linear(x, weight).float()
    out = Lazy(x, weight)
    out.__class__ = torch.Tensor  # type() says plain; its dispatch still runs Lazy's code
    return out
""",
)

PARAMETER_HEAD = _head(
    "parameter_head",
    """
@register("lm_head", "parameter_head", replace=True)
def parameter_head(x, *, weight):
    return torch.nn.Parameter(F.linear(x, weight).float(), requires_grad=False)
""",
)


@pytest.mark.parametrize(
    ("candidate", "phase", "what"),
    [
        (DEFERRED_SUBCLASS, "compile", "Deferred, " + PLAIN),  # its first step is checked
        (LAZY_WHEN_TIMED, "measure: timed step 1", "Lazy, " + PLAIN),
        (LAZY_POSING_AS_PLAIN, "measure: timed step 1", "Python, PythonTLSSnapshot dispatch"),
        (PARAMETER_HEAD, "compile", "torch.nn.parameter.Parameter, " + PLAIN),
    ],
    ids=["torch_function_subclass", "lazy_wrapper_subclass", "lazy_posing_as_plain", "parameter"],
)
def test_outputs_that_are_not_plain_tensors_are_incorrect(
    engine: Engine, candidate: Candidate, phase: str, what: str
) -> None:
    m = _run(engine, candidate)
    assert m.status == "incorrect" and not m.correct and m.timing is None, m.error
    # in the sandbox no call can be told from a checked one: the first is refused already
    assert m.error.startswith((f"incorrect: {phase}: output is ", "incorrect: compile: output is "))
    assert what in m.error and "outputs must be exactly torch.Tensor" in m.error, m.error
    assert _run(engine, Candidate()).status == "ok"  # the engine measures on as before


def test_a_plain_tensor_built_like_the_cheats_passes(engine: Engine) -> None:
    honest = _head(
        "honest_head",
        """
@register("lm_head", "honest_head", replace=True)
def honest_head(x, *, weight):
    out = torch.nn.Parameter(F.linear(x, weight).float(), requires_grad=False)
    return out.detach()  # a plain tensor again
""",
    )
    m = _run(engine, honest)
    assert m.status == "ok", m.error


def test_the_deferred_subclass_fools_a_naive_copy_but_not_the_trusted_one() -> None:
    """What makes the subclass a cheat: a copy that lets its ``__torch_function__`` run gets
    the right logits (computed during the copy); the gate's copy refuses it, and its
    comparison runs with subclass dispatch disabled."""
    namespace: dict[str, Any] = {"torch": torch, "F": F}
    exec(DEFERRED, namespace)
    x, weight = torch.randn(2, 8), torch.randn(5, 8)
    out = torch.empty(2, 5).as_subclass(namespace["Deferred"])
    out.x, out.w = x, weight
    torch.testing.assert_close(out.detach().float().clone(), F.linear(x, weight))
    with pytest.raises(NotPlainTensor, match=re.escape(f"Deferred, {PLAIN}")):
        run_steps([lambda: out], OutputGuard(set()))

    class Agreeing(torch.Tensor):
        """Answers every operation with zeros: ``c - r`` included."""

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def,override]
            with torch._C.DisableTorchFunctionSubclass():
                result = func(*args, **(kwargs or {}))
            return torch.zeros_like(result) if isinstance(result, torch.Tensor) else result

    want = torch.randn(2, 5)
    agreeing = torch.zeros(2, 5).as_subclass(Agreeing)
    verdict = compare([agreeing], [want], 1e-3)  # its zeros, not its answers
    assert not verdict.correct and verdict.max_abs_error == pytest.approx(float(want.abs().max()))


def test_not_plain_names_each_kind() -> None:
    plain = torch.ones(2, 3)
    assert not_plain(plain) == ""
    assert not_plain((plain,)) == "output is tuple, not a tensor"
    assert not_plain(torch.nn.Parameter(plain)).endswith(f"Parameter, {PLAIN}")
    assert not_plain(torch.empty(2, device="meta")) == f"output is a meta tensor, {PLAIN}"
    assert not_plain(plain.to_sparse()) == f"output is a torch.sparse_coo tensor, {PLAIN}"

    class Outer(torch.Tensor):
        pass

    class Inner(Outer):
        pass

    assert "Inner, " + PLAIN in not_plain(plain.as_subclass(Inner))
    posing = plain.clone().as_subclass(Inner)
    posing.__class__ = torch.Tensor  # a subclass without its own dispatch: now plain indeed
    assert not_plain(posing) == ""
    kept = TimedOutputs(2)
    with pytest.raises(NotPlainTensor, match=r"timed step 3: output is torch\.nn\.parameter"):
        kept.offer(2, torch.nn.Parameter(plain))
    assert kept.seen == 0  # refused before it counts
    guard = OutputGuard(set())
    guard.hold(plain.as_subclass(Inner))  # never poisoned through its own code
    guard.hold(plain)
    guard.poison()
    assert bool(plain.isnan().all())


# --------------------------------------------------------------------------- front-loaded work

FRONT_LOADED = _head(
    "front_loaded",
    """
import time

_calls = {}


@register("lm_head", "front_loaded", replace=True)
def front_loaded(x, *, weight):
    out = F.linear(x, weight).float()  # every answer is right
    rows = x.shape[0]
    _calls[rows] = _calls.get(rows, 0) + 1
    if rows == 3 and _calls[rows] == 2:
        # the first timed call (the first at this batch was the checked one): the work of
        # every step at once, so the later steps look cheap to a median
        start = time.perf_counter()
        while time.perf_counter() - start < 0.5:
            F.linear(x, weight)
    return out
""",
)


def test_front_loaded_work_decides_tokens_per_s_by_the_mean(engine: Engine) -> None:
    m = _run(engine, FRONT_LOADED, repeats=8, min_repeats=8)
    assert m.status == "ok" and m.correct, m.error
    t = m.timing
    assert t is not None and t.samples_ms[0] >= 500 and t.max_ms == t.samples_ms[0]
    assert t.median_ms < 200  # the median never saw the work
    assert t.mean_decides and t.decision_ms == pytest.approx(t.mean_ms / 1.25)
    assert m.tokens_per_s == pytest.approx(BATCH / (t.mean_ms / 1.25 / 1e3))
    assert m.tokens_per_s < BATCH / (t.median_ms / 1e3) / 2
    assert any(n.startswith("tokens/s from the mean") for n in m.notes), m.notes


def test_the_decision_step_is_the_median_unless_the_mean_is_a_quarter_above_it() -> None:
    even = summarize([10.0, 10.0, 11.0, 12.0], 1)
    assert even.mean_ms == pytest.approx(10.75) and even.max_ms == 12.0
    assert even.decision_ms == even.median_ms == 10.5 and not even.mean_decides
    assert even.per_second(3) == pytest.approx(3 / 0.0105)
    front = summarize([100.0, 1.0, 1.0, 1.0], 1)
    assert front.median_ms == 1.0 and front.decision_ms == pytest.approx(25.75 / 1.25)
    old = Timing(median_ms=4.0, p10_ms=3.0, p90_ms=5.0)  # recorded before the mean was
    assert old.decision_ms == 4.0 and Timing().per_second(3) == 0.0


# --------------------------------------------------------------------------- verified steps

SOMETIMES_WRONG = _head(
    "sometimes_wrong",
    """
import random


@register("lm_head", "sometimes_wrong", replace=True)
def sometimes_wrong(x, *, weight):
    out = F.linear(x, weight).float()
    if not _checked() and random.random() < 0.6:
        out[0] = 0.0  # one row skipped on ~60 % of the unwatched steps
    return out
""",
)


def test_the_default_verifies_enough_steps_for_one_percent() -> None:
    assert VERIFY_TIMED_STEPS == steps_to_verify(CHEAT_FRACTION, ESCAPE_TARGET) == 21
    assert escape_probability(21) < ESCAPE_TARGET <= escape_probability(20)
    assert steps_to_verify(0.5, 0.01) == 7 and escape_probability(0) == 1.0
    with pytest.raises(ValueError):
        steps_to_verify(0.0)
    assert RunRequest("x", Candidate()).verify_timed_steps == 21
    assert EngineSettings().verify_timed_steps == 21


def test_a_cheat_on_most_timed_steps_is_caught_every_time(engine: Engine) -> None:
    # In process only verification catches it (its check helpers are on the stack when checked);
    # sandboxed, the check already does (test_red_team: test_output_cheats_pass_every_check_...).
    for _ in range(20):
        m = _run(engine, SOMETIMES_WRONG, repeats=30, min_repeats=30)
        # honest only under the check helpers, which are not on a sandboxed candidate's stack
        assert m.status == "incorrect", m.error
        assert "(verified after timing)" in m.error or JUDGED in m.error, m.error


def test_the_escape_probability_is_recorded(engine: Engine) -> None:
    m = _run(engine, Candidate(), repeats=30, min_repeats=30)
    assert m.status == "ok", m.error
    assert m.verified_steps == 21 and m.escape_probability == pytest.approx(0.8**21)
    assert m.escape_probability < 0.01
    assert "21 kept timed step(s) verified in 1 forward(s)" in m.notes
    few = _run(engine, Candidate(), repeats=4)  # fewer timed steps: all of them
    assert few.verified_steps == 4 and few.escape_probability == pytest.approx(0.8**4)
    failed = _run(engine, SOMETIMES_WRONG, repeats=30, min_repeats=30)
    assert failed.status == "incorrect" and failed.verified_steps == 0
    assert failed.escape_probability == 1.0


def test_kept_steps_are_stacked_as_memory_allows(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gate_check, "VERIFY_CHUNK_BYTES", 2 * step_bytes(engine.shape_reference))
    m = _run(engine, Candidate.make({"attention": "sdpa"}), repeats=5, min_repeats=5)
    assert m.status == "ok", m.error
    assert "5 kept timed step(s) verified in 3 forward(s)" in m.notes
    caught = _run(engine, SOMETIMES_WRONG, repeats=30, min_repeats=30)
    assert caught.status == "incorrect"
    assert "(verified after timing)" in caught.error or JUDGED in caught.error


def test_a_stacked_step_is_the_reference_step_of_each_copy(engine: Engine) -> None:
    ref = engine.shape_reference
    engine._at_context()
    g = torch.Generator().manual_seed(5)
    tokens = [torch.randint(engine.vocab, (BATCH, 1), generator=g) for _ in range(3)]
    before = [t.clone() for t in ref.cache.k + ref.cache.v]
    lengths = ref.cache.lengths.clone()
    got = stacked(ref, 3).decode_step(torch.cat(tokens))
    assert got.shape == (3 * BATCH, engine.vocab)
    assert all(torch.equal(a, b) for a, b in zip(before, ref.cache.k + ref.cache.v, strict=True))
    assert torch.equal(ref.cache.lengths, lengths)  # nothing written, nothing advanced
    for i, token in enumerate(tokens):
        engine._at_context()
        want = ref.decode_step(token)
        torch.testing.assert_close(got[i * BATCH : (i + 1) * BATCH], want)
    engine._at_context()
