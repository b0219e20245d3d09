"""The tolerance derived from the reference's own rounding error against its float64 forward
(:func:`kiln.runtime.check.compare_exact`): the rule on synthetic errors, the library's Triton
kernels and the ``fused_decode`` transform within it (Triton's interpreter on CPU), and a declared
lossy candidate passing at ``LOSSY_RTOL`` with its accuracy reported. The undeclared lossy cheats
are rejected by the engine in tests/unit/test_red_team.py (kind l).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import pytest
import torch

from kiln.domain.candidate import Candidate, CodeModule
from kiln.ops.kernels import runtime
from kiln.runtime.check import (
    DERIVED,
    TOLERANCES,
    Tolerance,
    compare_exact,
    tolerance_for,
)
from kiln.runtime.engine import Engine
from kiln.runtime.exact import exact_step
from kiln.runtime.fused_decode import install
from kiln.runtime.request import RunRequest
from kiln.runtime.spec import EngineLimits, EngineSpec
from kiln.workloads.config import parse_config
from kiln.workloads.models import build_model
from kiln.workloads.models.binding import OpBinding
from kiln.workloads.models.decoder import DecoderModel

from .engine_testing import TINY_LLAMA, tiny_workload

BF16 = tolerance_for(torch.bfloat16)


def _noise(g: torch.Generator, like: torch.Tensor, rms: float) -> torch.Tensor:
    e = torch.randn(like.shape, generator=g, dtype=torch.float64)
    return e * rms / float(e.square().mean().sqrt())


def test_one_row_per_dtype_and_unknown_dtypes_refused() -> None:
    assert [row.dtype for row in TOLERANCES] == [torch.float32, torch.bfloat16, torch.float16]
    assert all(isinstance(row, tuple) and row.max_factor > row.rms_factor > 1 for row in TOLERANCES)
    with pytest.raises(KeyError, match="no tolerance"):
        tolerance_for(torch.int8)


def test_as_noisy_as_the_reference_passes_twice_as_noisy_fails() -> None:
    g = torch.Generator().manual_seed(0)
    exact = torch.randn(6, 512, generator=g, dtype=torch.float64) * 8
    # bfloat16 rounding of |values| near 8 alone is 8 x 2**-9 RMS: a deep model adds more
    reference = exact + _noise(g, exact, 0.1)
    honest = exact + _noise(g, exact, 0.11)  # another rounding, about as far off
    verdict = compare_exact([honest.float()], [reference.float()], [exact], BF16)
    assert verdict.correct, verdict.reason
    assert 1.0 < verdict.rms_ratio < 1.2
    lossy = exact + _noise(g, exact, 0.1 * (BF16.rms_factor + 0.3))  # no row stands out
    verdict = compare_exact([lossy.float()], [reference.float()], [exact], BF16)
    assert not verdict.correct and verdict.rms_ratio > BF16.rms_factor
    assert DERIVED in verdict.reason and "not declared lossy" in verdict.reason
    # the same candidate, as a lossy one is judged: within a fixed 0.1 x max |reference|
    assert float((lossy - reference).abs().max()) < 0.1 * float(reference.abs().max())


def test_one_row_far_off_fails_though_the_rms_would_pass() -> None:
    g = torch.Generator().manual_seed(1)
    exact = torch.randn(64, 256, generator=g, dtype=torch.float64)
    reference = exact + _noise(g, exact, 0.02)
    candidate = exact + _noise(g, exact, 0.02)
    own = float((reference[5] - exact[5]).abs().max())
    candidate[5, 7] = exact[5, 7] + 1.5 * BF16.max_factor * own
    verdict = compare_exact([candidate], [reference], [exact], BF16)
    assert (
        not verdict.correct and "in row 5 exceeds" in verdict.reason and DERIVED in verdict.reason
    )
    assert verdict.rms_ratio == 0.0  # failed before the RMS was taken


def test_a_reference_without_error_still_allows_its_dtype_rounding() -> None:
    exact = torch.linspace(-4, 4, 128, dtype=torch.float64)[None] / 3
    unit = torch.finfo(torch.float32).eps / 2
    row = tolerance_for(torch.float32)
    within = exact.float()  # each value rounded once to float32
    assert not torch.equal(within.double(), exact)
    assert compare_exact([within], [exact.clone()], [exact], row).correct
    beyond = exact.clone()
    beyond[0, 3] += 2 * row.max_factor * unit * 4
    assert not compare_exact([beyond], [exact.clone()], [exact], row).correct


def test_a_flipped_decisive_token_fails_and_skipped_rows_need_only_be_finite() -> None:
    exact = torch.zeros(2, 8, dtype=torch.float64)
    exact[:, 2] = 5.0
    reference = exact + 1e-3
    flipped = reference.clone()
    flipped[1, 6] = 9.0
    verdict = compare_exact([flipped], [reference], [exact], BF16)
    assert not verdict.correct  # by the row bound or the argmax: either is a failure
    rows = [torch.tensor([True, False])]
    assert compare_exact([flipped], [reference], [exact], BF16, rows).correct
    broken = flipped.clone()
    broken[1, 0] = float("nan")
    assert "non-finite" in compare_exact([broken], [reference], [exact], BF16, rows).reason


# --------------------------------------------------------------- the library's kernels

needs_triton = pytest.mark.skipif(
    not runtime.can_run("cpu"), reason="needs Triton with TRITON_INTERPRET=1"
)
SMALL = {
    **TINY_LLAMA,
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "head_dim": 16,
    "intermediate_size": 96,
    "vocab_size": 96,
}
WIDE = {
    "qkv_block": "32", "o_block_n": "64", "gate_up_block_n": "64", "down_block_n": "64",
    "lm_block_n": "64",
}  # fmt: skip


def _derived_verdicts(
    dtype: torch.dtype, setup: Callable[[DecoderModel], Callable[[], None] | None]
) -> list[float]:
    """RMS ratios of 2 decode steps of a candidate model (``setup`` applied) against a
    reference with the same weights and prompts; asserts each passes the derived rule."""
    config = parse_config(SMALL, "tiny-small")
    ref = build_model(config, dtype=dtype, seed=5, max_batch=3, max_seq_len=32)
    cand = build_model(config, dtype=dtype, weights=ref.weights, max_batch=3, max_seq_len=32)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, SMALL["vocab_size"], (3, 11), generator=g)
    lens = torch.tensor([11, 6, 9])
    ref.prefill(tokens, lens)
    cand.prefill(tokens, lens)
    undo = setup(cand)
    ratios = []
    try:
        for _ in range(2):
            step = torch.randint(0, SMALL["vocab_size"], (3, 1), generator=g)
            exact = exact_step(ref, step)
            want, got = ref.decode_step(step).float(), cand.decode_step(step).float()
            verdict = compare_exact([got], [want], [exact], tolerance_for(dtype))
            assert verdict.correct, verdict.reason
            ratios.append(verdict.rms_ratio)
    finally:
        if undo is not None:
            undo()
    return ratios


TRITON_OPS = [
    ("qkv_proj", "triton_gemv"),
    ("o_proj", "triton_gemv"),
    ("mlp", "triton_gate_up"),
    ("lm_head", "triton_gemv"),
    ("attention", "flash_decoding"),
    ("rms_norm", "triton"),
]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_triton_kernels_and_fused_decode_pass_the_derived_tolerance(dtype: torch.dtype) -> None:
    def rebind(op: str, impl: str) -> Callable[[DecoderModel], None]:
        def setup(model: DecoderModel) -> None:
            model.rebind(OpBinding.from_recipe({op: impl}))

        return setup

    for op, impl in TRITON_OPS:
        _derived_verdicts(dtype, rebind(op, impl))
    for params in ({"split_s": "16"}, {"projections": "tensor_core"}):
        _derived_verdicts(dtype, lambda m, p=params: install(m, {**WIDE, **p}))  # type: ignore[misc]


# --------------------------------------------------------------- declared lossy

W4_DECLARED = CodeModule(
    "w4_declared",
    """
import torch
import torch.nn.functional as F
from kiln.ops.registry import register

_quantized = {}


def _int4(w):
    if w.data_ptr() not in _quantized:
        groups = w.float().reshape(w.shape[0], -1, 32)
        scale = groups.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / 7
        q = torch.round(groups / scale).clamp(-7, 7) * scale
        _quantized[w.data_ptr()] = q.reshape(w.shape).to(w.dtype)
    return _quantized[w.data_ptr()]


@register("mlp", "w4_declared", lossy=True, replace=True)
def w4(x, *, gate_weight, up_weight, down_weight):
    g, u, d = _int4(gate_weight), _int4(up_weight), _int4(down_weight)
    return F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), d)
""",
)


@pytest.fixture(scope="module")
def bf16_engine() -> Iterator[Engine]:
    limits = EngineLimits(max_batch=4, max_context=32, fast_layers=2, prompt_len=8, check_steps=2)
    workload = tiny_workload(batch=3, context=24, dtype="bfloat16")
    workload["model"]["config_json"] = json.dumps({**TINY_LLAMA, "vocab_size": 1024})
    yield Engine(EngineSpec.from_workload(workload, "fast", limits), engine_id="derived-bf16")


def test_declared_lossy_passes_at_its_own_bound_with_its_accuracy_reported(
    bf16_engine: Engine,
) -> None:
    declared = Candidate.make({"mlp": "w4_declared"}, code_modules=[W4_DECLARED], lossy=True)
    m = bf16_engine.run(RunRequest("derived", declared, warmup=1, repeats=3))
    assert m.status == "ok", m.error
    (note,) = [n for n in m.notes if n.startswith("lossy accuracy against the float64 forward")]
    ratio = float(note.split("RMS error ")[1].split(" ")[0])
    assert ratio > BF16.rms_factor  # what would fail were it not declared
    undeclared = Candidate.make({"mlp": "w4_declared"}, code_modules=[W4_DECLARED])
    refused = bf16_engine.run(RunRequest("derived", undeclared, warmup=1, repeats=3))
    assert refused.status == "rejected" and "lossy" in refused.error
    honest = bf16_engine.run(RunRequest("derived", Candidate(), warmup=1, repeats=3))
    assert honest.status == "ok", honest.error
    (note,) = [n for n in honest.notes if "check against the float64 forward" in n]
    assert note.startswith("bfloat16 check against the float64 forward: RMS error 1.00")


def test_tolerance_is_a_named_tuple_row() -> None:
    row = Tolerance(torch.float32, 2.0, 3.0, 1e-3)
    with pytest.raises(AttributeError):
        row.rms_factor = 9.0  # type: ignore[misc]
