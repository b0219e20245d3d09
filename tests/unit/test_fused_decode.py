"""The ``fused_decode`` transform against the reference decode step, through Triton's interpreter
on CPU (tests/conftest.py sets ``TRITON_INTERPRET=1`` on hosts without CUDA; the same checks run
on CUDA under tests/gpu).

A tiny Llama (:data:`TINY_LLAMA`: GQA 4/2 heads, llama3 RoPE, tied embeddings) is prefilled with
random prompts of different lengths, then several decode steps run through the fused kernels and,
on a copy of the same weights and cache, through the reference ops: logits and the KV cache must
agree within the dtype's tolerance at every step.
"""

from __future__ import annotations

import copy

import pytest
import torch

from kiln.engine_pool.fused_decode import FusedDecodeUnsupported, install
from kiln.engine_pool.transforms import RejectedCandidate, apply_transforms
from kiln.ops.kernels import runtime
from kiln.workloads.candidate import Transform
from kiln.workloads.config import parse_config
from kiln.workloads.models import build_model

from .engine_testing import TINY_LLAMA

pytestmark = pytest.mark.skipif(
    not runtime.can_run("cpu"), reason="needs Triton with TRITON_INTERPRET=1"
)

# Small enough for the interpreter (it runs every program in Python): 2 layers, GQA 4/2 heads of
# 16, vocab 96 (not a multiple of the LM head's block).
SMALL = {
    **TINY_LLAMA,
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "head_dim": 16,
    "intermediate_size": 96,
    "vocab_size": 96,
}
TOL = {torch.float32: 2e-4, torch.bfloat16: 3e-2}


def _pair(dtype: torch.dtype, batch: int, prompt: int, seed: int):
    config = parse_config(SMALL, "tiny-llama")
    ref = build_model(config, dtype=dtype, seed=seed, max_batch=batch, max_seq_len=64)
    fused = build_model(config, dtype=dtype, weights=ref.weights, max_batch=batch, max_seq_len=64)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, SMALL["vocab_size"], (batch, prompt), generator=gen)
    lens = torch.randint(1, prompt + 1, (batch,), generator=gen)
    lens[0] = prompt
    ref.prefill(tokens, lens)
    fused.prefill(tokens, lens)
    return ref, fused, gen


@pytest.mark.parametrize(
    ("dtype", "batch"), [(torch.float32, 3), (torch.bfloat16, 1), (torch.bfloat16, 2)]
)
def test_fused_steps_match_the_reference(dtype: torch.dtype, batch: int) -> None:
    ref, fused, gen = _pair(dtype, batch, prompt=21, seed=batch)
    undo = install(fused, {"split_s": "16"})  # several attention splits at these lengths
    try:
        for _ in range(2):
            step = torch.randint(0, SMALL["vocab_size"], (batch, 1), generator=gen)
            expected = ref.decode_step(step)
            got = fused.decode_step(step)
            assert got.dtype == torch.float32 and got.shape == expected.shape
            assert torch.isfinite(got).all()
            scale = expected.abs().max().item()
            assert (got - expected).abs().max().item() <= TOL[dtype] * max(scale, 1.0)
        assert torch.equal(fused.cache.lengths, ref.cache.lengths)
        for i in range(len(ref.cache.k)):
            n = int(ref.cache.lengths.max())
            for a, b in ((ref.cache.k[i], fused.cache.k[i]), (ref.cache.v[i], fused.cache.v[i])):
                diff = (a[:batch, :, :n].float() - b[:batch, :, :n].float()).abs().max().item()
                assert diff <= TOL[dtype] * 4
    finally:
        undo()
    assert "decode_step" not in fused.__dict__


def test_kernel_parameters_change_nothing_but_speed() -> None:
    _, fused, gen = _pair(torch.float32, 2, prompt=5, seed=11)
    other = copy.copy(fused)  # same weights; its own cache below
    other.cache = copy.deepcopy(fused.cache)
    step = torch.randint(0, SMALL["vocab_size"], (2, 1), generator=gen)
    undo_a = install(fused, {})
    undo_b = install(other, {"block_k": "256", "num_warps": "2", "o_block_n": "4", "pdl": "0"})
    try:
        a, b = fused.decode_step(step), other.decode_step(step)
    finally:
        undo_a()
        undo_b()
    assert (a - b).abs().max().item() <= 1e-4


def test_pdl_defaults_to_the_measured_mode_on_every_kernel() -> None:
    from kiln.engine_pool.fused_decode import DEFAULT_PDL, FusedDecode

    _, model, _ = _pair(torch.float32, 1, prompt=3, seed=2)
    for params, want in (({}, DEFAULT_PDL), ({"pdl": "0"}, 0), ({"pdl": "1"}, 1)):
        fused = FusedDecode(model, params)
        configs = [
            fused.qkv_config,
            fused.attention_config,
            fused.o_config,
            fused.gate_up_config,
            fused.down_config,
            fused.lm_config,
        ]
        assert [c.pdl for c in configs] == [want] * 6, params


def test_prefill_and_other_shapes_take_the_bound_ops() -> None:
    ref, fused, gen = _pair(torch.float32, 2, prompt=4, seed=5)
    undo = install(fused, {})
    try:
        tokens = torch.randint(0, SMALL["vocab_size"], (2, 6), generator=gen)
        assert torch.allclose(fused.prefill(tokens), ref.prefill(tokens), atol=1e-4)
    finally:
        undo()


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"block_q": "4"}, "unknown parameter"),
        ({"block_k": "big"}, "not an integer"),
        ({"num_warps": "0"}, "must be positive"),
        ({"pdl": "3"}, "pdl=3 is not 0, 1 or 2"),
    ],
)
def test_bad_parameters_are_rejected_with_the_reason(params: dict, message: str) -> None:
    _, fused, _ = _pair(torch.float32, 1, prompt=3, seed=1)
    with pytest.raises(FusedDecodeUnsupported, match=message):
        install(fused, params)
    with pytest.raises(RejectedCandidate, match=message):
        apply_transforms(fused, [Transform.of("fused_decode", **params)])
    assert "decode_step" not in fused.__dict__


def test_models_outside_the_fused_path_are_rejected() -> None:
    qwen3 = {**SMALL, "model_type": "qwen3", "rope_scaling": None}
    model = build_model(parse_config(qwen3, "tiny-qwen3"), dtype=torch.float32, max_seq_len=16)
    with pytest.raises(FusedDecodeUnsupported, match="normalises queries and keys"):
        install(model, {})
