"""The state guard (:mod:`kiln.runtime.state_guard`): weights the reference reads checked by
content before a verdict, the measured KV cache refilled before each reference step on it, and
the tolerance table (immutable) watched by content; on a CPU engine, with candidates that change
each in place, and its parts alone (host digests, the keyed checksum the CUDA engine uses)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kiln.domain.candidate import Candidate, CodeModule
from kiln.runtime import check, state_guard
from kiln.runtime.engine import Engine
from kiln.runtime.measurement import Measurement
from kiln.runtime.request import RunRequest
from kiln.runtime.spec import EngineLimits, EngineSpec
from kiln.runtime.state_guard import StateGuard, keyed_checksum, reference_tensors

from .engine_testing import tiny_workload

LIMITS = EngineLimits(max_batch=4, max_context=32, fast_layers=2, prompt_len=8, check_steps=2)
HELPERS = """
import sys

import torch
import torch.nn.functional as F

from kiln.ops import attention as _attention
from kiln.ops.registry import register


def _checked():
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name in ("run_steps", "_check", "_verify"):
            return True
        frame = frame.f_back
    return False


def _mlp(x, gate_weight, up_weight, down_weight):
    return F.linear(F.silu(F.linear(x, gate_weight)) * F.linear(x, up_weight), down_weight)
"""


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    """Code modules in this process (``sandbox=False``): the state guard is the only defense, so
    these tests see it alone. The sandboxed engine's verdicts on the same cheats are below."""
    spec = EngineSpec.from_workload(tiny_workload(batch=3, context=24), "fast", LIMITS)
    yield Engine(spec, engine_id="state-guard", sandbox=False)


@pytest.fixture(scope="module")
def sandboxed() -> Iterator[Engine]:
    spec = EngineSpec.from_workload(tiny_workload(batch=3, context=24), "fast", LIMITS)
    yield Engine(spec, engine_id="state-guard-sandboxed")


@pytest.fixture
def restarted(engine: Engine) -> Iterator[Engine]:
    """``engine``, its weights put back afterwards (what the restart a test asks for would do)."""
    saved = [(t, t.clone()) for _, t in engine.weights.items()]
    yield engine
    with torch.no_grad():
        for t, copy in saved:
            t.copy_(copy)
    assert engine.weights_intact()


def _run(engine: Engine, candidate: Candidate) -> Measurement:
    return engine.run(RunRequest("state", candidate, warmup=1, repeats=4, verify_timed_steps=4))


def _mlp_module(name: str, body: str) -> Candidate:
    source = (
        HELPERS
        + f"""
_NUDGED = []


@register("mlp", "{name}", replace=True)
def {name}(x, *, gate_weight, up_weight, down_weight):
{body}
    return _mlp(x, gate_weight, up_weight, down_weight)
"""
    )
    return Candidate.make({"mlp": name}, code_modules=[CodeModule(name, source)])


def _halving() -> Candidate:
    """Attention computed honestly over a cache it halves in place at its first timed call."""
    source = (
        HELPERS
        + """

_halved = set()


@register("attention", "halving", replace=True)
def halving(q, k_cache, v_cache, positions, seq_lens, *, scale):
    if not _checked() and q.shape[2] == 1 and k_cache.data_ptr() not in _halved:
        _halved.add(k_cache.data_ptr())
        v_cache.mul_(0.5)
    return _attention.reference(q, k_cache, v_cache, positions, seq_lens, scale=scale)
"""
    )
    return Candidate.make({"attention": "halving"}, code_modules=[CodeModule("halving", source)])


def test_an_honest_candidate_built_the_same_way_passes(engine: Engine) -> None:
    m = _run(engine, _mlp_module("plain", "    pass"))
    assert m.status == "ok" and not m.restart_engine, m.error
    assert engine.weights_intact()


def test_one_weight_element_changed_before_the_check_is_incorrect_naming_it(
    restarted: Engine,
) -> None:
    """A single element, where a strided sample would not look, and the reference computes with
    it too: only its content says it changed."""
    candidate = _mlp_module(
        "nudged",
        "    if not _NUDGED:\n        down_weight.view(-1)[7] += 0.5\n        _NUDGED.append(1)",
    )
    m = _run(restarted, candidate)
    assert m.status == "incorrect" and m.restart_engine and m.timing is None, m.error
    assert "state changed by the end of the check: model.layers.0.mlp.down_proj.weight " in m.error
    assert "differs from its content at build" in m.error
    assert not restarted.weights_intact()


def test_a_weight_changed_between_the_check_and_verification_is_caught(
    restarted: Engine,
) -> None:
    """Zeroed at the first timed call (the check saw the real weights), so the verifying reference
    would compute the same zero MLP the candidate skips."""
    candidate = _mlp_module(
        "late_zero",
        "    if not _checked():\n        down_weight.zero_()\n        return torch.zeros_like(x)",
    )
    m = _run(restarted, candidate)
    assert m.status == "incorrect" and m.restart_engine, m.error
    assert "state changed by the end of verification: model.layers." in m.error


def test_a_kv_cache_edited_in_place_is_caught_even_when_computed_over_honestly(
    engine: Engine,
) -> None:
    """Attention computed honestly, over a measured cache the candidate halved in place at its
    first timed call: the verifying reference reads the cache as the engine filled it."""
    m = _run(engine, _halving())
    assert m.status == "incorrect", m.error
    assert "(verified after timing)" in m.error
    assert _run(engine, Candidate()).status == "ok"  # nothing left behind


WRITE_IN_PLACE = """
import ctypes

from kiln.runtime import check as _check

_OFFSET = float.__basicsize__ - ctypes.sizeof(ctypes.c_double)
for _row in _check.TOLERANCES:  # a tuple of tuples: only ctypes writes a float in place
    for _value in _row[1:]:
        ctypes.c_double.from_address(id(_value) + _OFFSET).value = 1e9
"""


def test_the_tolerance_table_written_in_place_is_seen_and_put_back(engine: Engine) -> None:
    before = list(check.TOLERANCES)
    loosen = CodeModule("loosen", HELPERS + WRITE_IN_PLACE)
    try:
        m = _run(engine, Candidate.make({}, code_modules=[loosen]))
        assert m.status == "incorrect" and m.restart_engine
        assert state_guard.TABLE_CHANGED in m.error and "now 1e+09" in m.error
        assert check.TOLERANCES == tuple(before) and state_guard.tolerance_changes() == []
        assert state_guard.rtol_for(torch.float32) == 1e-3
    finally:
        state_guard.restore_tolerances()
    assert _run(engine, Candidate()).status == "ok"


# ------------------------------------------------- the same cheats in the sandbox (the default)


@pytest.mark.parametrize(
    "body",
    [
        "    if not _NUDGED:\n        down_weight.view(-1)[7] += 0.5\n        _NUDGED.append(1)",
        "    if not _checked():\n        down_weight.zero_()\n        return torch.zeros_like(x)",
    ],
    ids=["nudged", "late_zero"],
)
def test_a_weight_written_in_the_sandbox_is_incorrect_and_the_judges_copy_is_untouched(
    sandboxed: Engine, body: str
) -> None:
    """The sandbox writes only its private copy of the weights: the verdict names the write, the
    sandbox (not the engine) is replaced, and the judge's weights keep their content."""
    m = _run(sandboxed, _mlp_module("sandboxed_write", body))
    assert m.status == "incorrect" and not m.restart_engine, m.error
    assert "state changed in the sandbox" in m.error and "of its copy of the weights" in m.error
    assert "sandbox replaced after this experiment" in m.notes
    assert sandboxed.weights_intact()
    assert _run(sandboxed, _mlp_module("plain_after", "    pass")).status == "ok"


def test_a_kv_cache_halved_in_the_sandbox_is_incorrect(sandboxed: Engine) -> None:
    m = _run(sandboxed, _halving())
    assert m.status == "incorrect", m.error
    assert "judged outside the candidate's sandbox" in m.error
    assert _run(sandboxed, Candidate()).status == "ok"


def test_the_tolerance_table_written_in_the_sandbox_leaves_the_judges_table_alone(
    sandboxed: Engine,
) -> None:
    """The write lands in the sandbox's own interpreter: the judge's table, and so the verdict on
    an honest candidate that carries it, are unchanged."""
    before = list(check.TOLERANCES)
    m = _run(
        sandboxed, Candidate.make({}, code_modules=[CodeModule("loosen", HELPERS + WRITE_IN_PLACE)])
    )
    assert m.status == "ok", m.error
    assert check.TOLERANCES == tuple(before) and state_guard.tolerance_changes() == []


# --------------------------------------------------------------------------- the parts


def test_the_table_is_immutable_and_watched_by_content() -> None:
    row = check.tolerance_for(torch.bfloat16)
    with pytest.raises(TypeError):
        check.TOLERANCES[1] = row._replace(rms_factor=1e9)  # type: ignore[index]
    with pytest.raises(AttributeError):
        row.rms_factor = 1e9  # type: ignore[misc]
    assert state_guard.tolerance_changes() == []
    namespace: dict[str, object] = {}
    try:
        exec(WRITE_IN_PLACE, namespace)
        assert check.tolerance_for(torch.bfloat16).rms_factor == 1e9  # the same objects
        (line,) = state_guard.tolerance_changes()
        assert line.startswith(state_guard.TABLE_CHANGED)
    finally:
        state_guard.restore_tolerances()
    assert state_guard.tolerance_changes() == [] and check.tolerance_for(torch.bfloat16) == row
    assert state_guard.rtol_for(torch.bfloat16) == row.rtol
    with pytest.raises(KeyError, match="no tolerance"):
        state_guard.rtol_for(torch.int8)


def test_every_tensor_the_references_bind_is_guarded(engine: Engine) -> None:
    named = dict(reference_tensors([("reference", engine.reference)], engine.weights))
    assert "model.embed_tokens.weight = lm_head.weight" in named  # tied: one tensor, two names
    assert "reference model.rotary_emb.inv_freq" in named
    bound = {
        id(v)
        for site in engine.reference.slots.sites()
        for v in site.params.values()
        if isinstance(v, torch.Tensor)
    }
    assert bound <= {id(t) for t in named.values()}
    assert {id(t) for _, t in engine.weights.items()} <= {id(t) for t in named.values()}
    assert "engine._context" in engine._state.names


@pytest.mark.parametrize("keyed", [False, True], ids=["sha256", "keyed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
def test_a_change_that_keeps_the_sum_is_seen(keyed: bool, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 100, (3, 5000), generator=g).to(dtype)  # rows + a tail of words
    b = torch.ones(7, dtype=dtype)
    guard = StateGuard([("a", a), ("b", b)], keyed=keyed)
    assert guard.changes() == []
    a.view(-1)[10] += 1
    a.view(-1)[12000] -= 1  # the sum (and any sample not at these two) is unchanged
    assert guard.changes() == ["a"]
    with pytest.raises(state_guard.StateChanged, match=r"state changed now: a differs from its"):
        guard.check("now")
    a.view(-1)[10] -= 1
    a.view(-1)[12000] += 1
    assert guard.changes() == []


def test_the_keyed_checksum_is_exact_modular_arithmetic_and_keyed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    t = torch.randn(10_007).to(torch.bfloat16)
    words = torch.randint(-(2**62), 2**62, (state_guard.KEY_WORDS,), dtype=torch.int64)
    whole = keyed_checksum(t, words, 12345)
    monkeypatch.setattr(state_guard, "CHUNK_WORDS", 1)  # one row per pass: same value
    assert torch.equal(keyed_checksum(t, words, 12345), whole)
    assert not torch.equal(keyed_checksum(t, words, 54321), whole)
    swapped = t.clone()
    swapped[[0, 5000]] = swapped[[5000, 0]]  # the same words in other places
    assert not torch.equal(keyed_checksum(swapped, words, 12345), whole)


def test_a_keyed_guard_draws_a_new_key_each_experiment() -> None:
    t = torch.arange(10_000, dtype=torch.float32)
    guard = StateGuard([("t", t)], keyed=True)
    first = guard._baseline
    guard.begin()
    assert guard._baseline != first and guard.changes() == []
    t[0] = -1.0
    assert guard.changes() == ["t"]
