"""The ``fused_decode`` transform against the reference decode step, through Triton's interpreter
on CPU (tests/conftest.py sets ``TRITON_INTERPRET=1`` on hosts without CUDA; the same checks run
on CUDA under tests/gpu).

A tiny Llama (:data:`TINY_LLAMA`: GQA 4/2 heads, llama3 RoPE, tied embeddings) and tiny variants
of every family the path takes (Qwen3 Q/K norms, head_dim 64..256, GQA ratios, untied heads) are
prefilled with random prompts of different lengths, then several decode steps run through the
fused kernels (matrix-vector and tensor-core products) and, on a copy of the same weights and
cache, through the reference ops: logits and the KV cache must agree within the dtype's
tolerance at every step.
"""

from __future__ import annotations

import copy

import pytest
import torch

from kiln.domain.candidate import Transform
from kiln.ops.kernels import runtime
from kiln.runtime.fused_decode import FusedDecodeUnsupported, install
from kiln.runtime.transforms import RejectedCandidate, apply_transforms
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

# Wide tiles: the interpreter runs every program in Python, so fewer programs keep these tests
# quick (the default launch rule gives one output row per program at these widths).
WIDE = {
    "qkv_block": "32", "o_block_n": "64", "gate_up_block_n": "64", "down_block_n": "64",
    "lm_block_n": "64",
}  # fmt: skip


def _pair(dtype: torch.dtype, batch: int, prompt: int, seed: int, raw: dict | None = None):
    raw = raw or SMALL
    config = parse_config(raw, f"tiny-{raw['model_type']}")
    ref = build_model(config, dtype=dtype, seed=seed, max_batch=batch, max_seq_len=64)
    fused = build_model(config, dtype=dtype, weights=ref.weights, max_batch=batch, max_seq_len=64)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, raw["vocab_size"], (batch, prompt), generator=gen)
    lens = torch.randint(1, prompt + 1, (batch,), generator=gen)
    lens[0] = prompt
    ref.prefill(tokens, lens)
    fused.prefill(tokens, lens)
    return ref, fused, gen


def _steps_match(ref, fused, gen, dtype: torch.dtype, steps: int = 2) -> None:
    """``steps`` decode steps of ``fused`` equal ``ref``'s within the dtype's tolerance (logits
    and every written KV-cache slot)."""
    batch, vocab = fused.cache.batch, fused.config.vocab_size
    for _ in range(steps):
        step = torch.randint(0, vocab, (batch, 1), generator=gen)
        expected = ref.decode_step(step)
        got = fused.decode_step(step)
        assert got.dtype == torch.float32 and got.shape == expected.shape
        assert torch.isfinite(got).all()
        scale = expected.abs().max().item()
        assert (got - expected).abs().max().item() <= TOL[dtype] * max(scale, 1.0)
    assert torch.equal(fused.cache.lengths, ref.cache.lengths)
    n = int(ref.cache.lengths.max())
    for i in range(len(ref.cache.k)):
        for a, b in ((ref.cache.k[i], fused.cache.k[i]), (ref.cache.v[i], fused.cache.v[i])):
            diff = (a[:batch, :, :n].float() - b[:batch, :, :n].float()).abs().max().item()
            assert diff <= TOL[dtype] * 4


@pytest.mark.parametrize(
    ("dtype", "batch"), [(torch.float32, 3), (torch.bfloat16, 1), (torch.bfloat16, 2)]
)
def test_fused_steps_match_the_reference(dtype: torch.dtype, batch: int) -> None:
    ref, fused, gen = _pair(dtype, batch, prompt=21, seed=batch)
    undo = install(fused, {**WIDE, "split_s": "16"})  # several attention splits at these lengths
    try:
        _steps_match(ref, fused, gen, dtype)
    finally:
        undo()
    assert "decode_step" not in fused.__dict__


# Every family variant the fused path promises (one parameterized chain): Qwen3's per-head Q/K
# norms with heads x head_dim != hidden, head_dim 64/128/256, GQA ratios 1..8, tied and untied
# LM heads, llama3 RoPE scaling (SMALL has it) and plain RoPE.
QWEN3 = {
    **SMALL,
    "model_type": "qwen3",
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # 4 x 32 = 128 != hidden 64
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
FAMILIES = {
    "qwen3-qk-norm-wide-heads": QWEN3,
    "qwen3-tied-gqa-4": {**QWEN3, "num_key_value_heads": 1, "tie_word_embeddings": True},
    "llama-untied-head-dim-64": {
        **SMALL, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64,
        "tie_word_embeddings": False,
    },
    "llama-mha-head-dim-128": {
        **SMALL, "hidden_size": 128, "num_attention_heads": 1, "num_key_value_heads": 1,
        "head_dim": 128, "rope_scaling": None,
    },
    "qwen3-head-dim-256-gqa-8": {
        **QWEN3, "hidden_size": 96, "num_attention_heads": 8, "num_key_value_heads": 1,
        "head_dim": 256, "num_hidden_layers": 1,
    },
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_variant_matches_the_reference(family: str) -> None:
    raw = FAMILIES[family]
    dtype = torch.bfloat16 if family.startswith("qwen3-qk") else torch.float32
    ref, fused, gen = _pair(dtype, 2, prompt=9, seed=3, raw=raw)
    undo = install(fused, WIDE)
    try:
        _steps_match(ref, fused, gen, dtype)
    finally:
        undo()


@pytest.mark.parametrize(
    ("raw", "batch", "params"),
    [
        (SMALL, 2, {"projections": "tensor_core"}),
        (QWEN3, 2, {"projections": "tensor_core"}),
        (QWEN3, 18, {}),  # over the matrix-vector kernels' MAX_M: tensor cores whatever is asked
        (SMALL, 17, {"projections": "gemv"}),
    ],
)
def test_tensor_core_projections_match_the_reference(raw: dict, batch: int, params: dict) -> None:
    from kiln.runtime.fused_decode import FusedDecode

    ref, fused, gen = _pair(torch.bfloat16, batch, prompt=7, seed=batch, raw=raw)
    assert FusedDecode(fused, params).uses_tensor_cores(batch)
    undo = install(fused, {**WIDE, **params})
    try:
        _steps_match(ref, fused, gen, torch.bfloat16)
    finally:
        undo()


def test_projections_choose_the_product_kernels_by_batch() -> None:
    from kiln.runtime.fused_decode import TENSOR_CORE_BATCH, FusedDecode

    _, model, _ = _pair(torch.float32, 1, prompt=3, seed=2)
    auto, gemv, tc = (
        FusedDecode(model, p) for p in ({}, {"projections": "gemv"}, {"projections": "tensor_core"})
    )
    assert not auto.uses_tensor_cores(TENSOR_CORE_BATCH - 1)
    assert auto.uses_tensor_cores(TENSOR_CORE_BATCH)
    assert not gemv.uses_tensor_cores(16) and gemv.uses_tensor_cores(17)
    assert tc.uses_tensor_cores(1)


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


def test_every_value_agents_may_propose_is_accepted() -> None:
    """The search space's fused_decode parameter values (kiln.agent_runner.space) are all
    values the transform takes: an agent never spends an experiment on a refused one."""
    from kiln.agent_runner.space import FUSED_DECODE_PARAMS
    from kiln.runtime.fused_decode import PARAMS, FusedDecode

    _, model, _ = _pair(torch.float32, 1, prompt=3, seed=2)
    assert set(FUSED_DECODE_PARAMS) <= set(PARAMS)
    for key, values in FUSED_DECODE_PARAMS.items():
        for value in values:
            FusedDecode(model, {key: value})  # raises FusedDecodeUnsupported when refused


def test_pdl_defaults_to_the_measured_mode_on_every_kernel() -> None:
    from kiln.runtime.fused_decode import DEFAULT_PDL, FusedDecode

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
        ({"projections": "cublas"}, "projections='cublas' is not one of"),
    ],
)
def test_bad_parameters_are_rejected_with_the_reason(params: dict, message: str) -> None:
    _, fused, _ = _pair(torch.float32, 1, prompt=3, seed=1)
    with pytest.raises(FusedDecodeUnsupported, match=message):
        install(fused, params)
    with pytest.raises(RejectedCandidate, match=message):
        apply_transforms(fused, [Transform.of("fused_decode", **params)])
    assert "decode_step" not in fused.__dict__


# Expert layers: the attention half fused, the ffn through the bound ``moe`` op. Qwen3-MoE with a
# dense layer among expert layers (``mlp_only_layers``), and Mixtral (every layer routes).
MOE_FAMILIES = {
    "qwen3-moe-mixed": {
        **QWEN3, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "norm_topk_prob": True, "mlp_only_layers": [1],
    },
    "mixtral": {
        **SMALL, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2,
        "rope_scaling": None,
    },
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
@pytest.mark.parametrize("projections", ["gemv", "tensor_core"])
@pytest.mark.parametrize("moe", ["reference", "dense", "triton_gather"])
def test_expert_layers_run_the_bound_moe_op(family: str, projections: str, moe: str) -> None:
    from kiln.workloads.models.binding import OpBinding

    raw = MOE_FAMILIES[family]
    ref, fused, gen = _pair(torch.float32, 2, prompt=9, seed=5, raw=raw)
    assert any(layer.ffn.op == "moe" for layer in fused.slots.layers)
    fused.rebind(OpBinding.from_recipe({"moe": moe}))
    called: list[int] = []
    inner = fused.ops.layers[0].ffn

    def counted(x: torch.Tensor) -> torch.Tensor:
        called.append(x.shape[0])
        return inner(x)

    if fused.slots.layers[0].ffn.op == "moe":
        fused.ops = _with_first_ffn(fused.ops, counted)
    undo = install(fused, {**WIDE, "projections": projections})
    try:
        _steps_match(ref, fused, gen, torch.float32)
    finally:
        undo()
    if fused.slots.layers[0].ffn.op == "moe":
        assert called == [2, 2]  # one call per step, the whole batch at once


def _with_first_ffn(ops, ffn):
    import dataclasses

    first = dataclasses.replace(ops.layers[0], ffn=ffn)
    return dataclasses.replace(ops, layers=(first, *ops.layers[1:]))


def test_models_outside_the_fused_path_are_rejected() -> None:
    from kiln.runtime.fused_decode import unsupported_reason

    for raw in MOE_FAMILIES.values():
        assert unsupported_reason(parse_config(raw, "tiny-moe")) is None
    biased = parse_config({**SMALL, "attention_bias": True}, "tiny-biased")
    assert "biases" in (unsupported_reason(biased) or "")
    for raw in (SMALL, *FAMILIES.values()):
        assert unsupported_reason(parse_config(raw, "x")) is None
