"""Latent-cache MLA decode kernel (:mod:`kiln.ops.kernels.mla_decode`) and ``mla_attention``
"absorbed_triton" vs the kernel's plain reference and the op's ``absorbed`` / ``reference``,
through Triton's interpreter (``TRITON_INTERPRET=1`` set below before Triton is imported; see
tests/unit/kernel_testing.py): rows of different lengths, a cache length not a multiple of the
split, head counts that are not powers of two, GLM-5 selections with ``-1``, out-of-range and
repeated slots and K > S, strided cache views, prefill fallback, ``torch.compile`` and whole
decode steps of a tiny GLM-5. Small R (24..64) only: the real R = 512 is not exercised here.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

from typing import Any

import pytest
import torch

import kiln.ops  # noqa: F401
from kiln.ops.kernels.mla_decode import MlaDecodeConfig, mla_decode, mla_decode_reference
from kiln.ops.mla import ABSORBED, absorb
from kiln.ops.registry import get, implementations
from kiln.runtime.support import support_for
from kiln.workloads.config import parse_config
from kiln.workloads.models import OpBinding, build_model
from tests.unit.kernel_testing import assert_finite, poisoned_empty  # noqa: F401
from tests.unit.op_testing import DTYPES, assert_close, randn

CACHE_LEN, ROPE_DIM, NOPE_DIM, V_DIM = 101, 16, 16, 16  # 101: not a multiple of any split
SPLIT = MlaDecodeConfig(split_s=32)  # 4 splits, the last one partial
SEQ_LENS = [1, CACHE_LEN, 33]


def _kernel_case(
    heads: int, rank: int, dtype: torch.dtype, seq_lens: list[int]
) -> tuple[torch.Tensor, ...]:
    """q_latent, q_rope, and the caches as views of the first B rows of a wider buffer."""
    b = len(seq_lens)
    q_latent = randn(b, heads, rank, dtype=dtype, scale=rank**-0.5)
    q_rope = randn(b, heads, ROPE_DIM, dtype=dtype)
    latent = randn(b + 1, CACHE_LEN, rank, dtype=dtype)[:b]
    rope = randn(b + 1, CACHE_LEN, ROPE_DIM, dtype=dtype)[:b]
    return q_latent, q_rope, latent, rope, torch.tensor(seq_lens)


def _selection(seq_lens: list[int], k: int, seed: int) -> torch.Tensor:
    """``[B, 1, K]`` int64: random slots of the whole cache (some >= seq_len), ``-1`` entries,
    one slot repeated, and the query's own slot."""
    gen = torch.Generator().manual_seed(seed)
    sel = torch.randint(0, CACHE_LEN, (len(seq_lens), k), generator=gen)
    sel[:, 1::5] = -1
    sel[:, 2] = sel[:, 3]  # a repeat
    sel[:, 0] = torch.tensor(seq_lens) - 1  # never empty
    return sel[:, None]


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rank", [32, 64])
@pytest.mark.parametrize("heads", [6, 20])
@pytest.mark.parametrize("config", [SPLIT, MlaDecodeConfig()], ids=["split32", "auto"])
def test_kernel_matches_reference(
    config: MlaDecodeConfig, heads: int, rank: int, dtype: torch.dtype
) -> None:
    torch.manual_seed(heads * 100 + rank)
    q_latent, q_rope, latent, rope, seq_lens = _kernel_case(heads, rank, dtype, SEQ_LENS)
    out = mla_decode(q_latent, q_rope, latent, rope, seq_lens, scale=0.2, config=config)
    assert_finite(out)
    assert_close(out, mla_decode_reference(q_latent, q_rope, latent, rope, seq_lens, scale=0.2))


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("k", "config"),
    [(40, MlaDecodeConfig(split_s=64, block_s=16)), (160, SPLIT)],  # 160 > S = 101 > seq_lens
)
def test_kernel_walks_the_selection(k: int, config: MlaDecodeConfig, dtype: torch.dtype) -> None:
    torch.manual_seed(k)
    q_latent, q_rope, latent, rope, seq_lens = _kernel_case(20, 32, dtype, SEQ_LENS)
    sel = _selection(SEQ_LENS, k, seed=k)[:, 0]
    args = (q_latent, q_rope, latent, rope, seq_lens)
    want = mla_decode_reference(*args, scale=0.2, topk_indices=sel)
    assert_close(mla_decode(*args, scale=0.2, topk_indices=sel, config=config), want)


def test_repeats_count_once_with_dedupe_and_per_occurrence_without() -> None:
    torch.manual_seed(1)
    q_latent, q_rope, latent, rope, seq_lens = _kernel_case(6, 32, torch.float32, [50, 60])
    sel = torch.tensor([[7, 3, 7, 7, -1, 49], [59, 0, 0, 12, 80, -1]])
    once = torch.tensor([[7, 3, 49, -1, -1, -1], [59, 0, 12, -1, -1, -1]])
    args = (q_latent, q_rope, latent, rope, seq_lens)
    want = mla_decode_reference(*args, scale=0.3, topk_indices=once)
    assert_close(mla_decode(*args, scale=0.3, topk_indices=sel, config=SPLIT), want)
    # Without dedupe, row 0's slot 7 weighs 3x and row 1's slot 0 2x: as a cache holding the
    # repeats as copies at new slots 101 and 102 (all that is named stays visible).
    extra = torch.stack((latent[0, [7, 7]], latent[1, [0, 0]]))
    extra_rope = torch.stack((rope[0, [7, 7]], rope[1, [0, 0]]))
    cache = (torch.cat((latent, extra), dim=1), torch.cat((rope, extra_rope), dim=1))
    copies = torch.tensor([[7, 3, 101, 102, -1, 49], [59, 0, 101, 12, -1, -1]])
    lens = torch.tensor([103, 103])
    want = mla_decode_reference(q_latent, q_rope, *cache, lens, scale=0.3, topk_indices=copies)
    got = mla_decode(*args, scale=0.3, topk_indices=sel, dedupe=False, config=SPLIT)
    assert_close(got, want)


def test_empty_rows_are_zero() -> None:
    q_latent, q_rope, latent, rope, _ = _kernel_case(6, 32, torch.float32, [5, 5])
    args = (q_latent, q_rope, latent, rope)
    out = mla_decode(*args, torch.tensor([0, 5]), scale=0.2, config=SPLIT)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    sel = torch.tensor([[-1, 3], [7, 9]])  # row 1 names only slots beyond its length
    lens = torch.tensor([5, 5])
    out = mla_decode(*args, lens, scale=0.2, topk_indices=sel)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert_close(out[:1], mla_decode_reference(*args, lens, scale=0.2, topk_indices=sel)[:1])


def test_split_count_depends_on_shapes_only_and_is_bounded() -> None:
    config = MlaDecodeConfig(block_s=32, target_programs=264, max_splits=64)
    for slots, batch, head_blocks in [(101, 1, 1), (4096, 1, 8), (4096, 64, 8), (2048, 3, 4)]:
        split_s, splits = config.splits(slots, batch, head_blocks)
        assert split_s % 32 == 0 and (split_s // 32) & (split_s // 32 - 1) == 0
        assert (splits - 1) * split_s < slots <= splits * split_s and splits <= 64
    assert config.splits(4096, 64, 8)[1] == 1  # enough programs without splitting
    assert MlaDecodeConfig(split_s=32).splits(101, 64, 8) == (32, 4)
    for bad in ({"block_h": 8}, {"block_s": 24}, {"split_s": 16}, {"num_warps": 3}):
        with pytest.raises(ValueError):
            MlaDecodeConfig(**bad)


# --- the op: absorbed_triton vs absorbed and reference --------------------------------------


def _op_case(
    heads: int, rank: int, dtype: torch.dtype, tokens: int = 1
) -> tuple[tuple[torch.Tensor, ...], dict[str, Any]]:
    """Op args (the rope cache a strided view, as GLM-5's ``[rope | index key]`` tail) and base
    params."""
    b = len(SEQ_LENS)
    seq_lens = torch.tensor(SEQ_LENS)
    positions = (seq_lens - 1)[:, None] if tokens == 1 else torch.arange(tokens).expand(b, tokens)
    if tokens > 1:
        seq_lens = torch.full((b,), tokens)
    tail = randn(b, 1, CACHE_LEN, ROPE_DIM + 8, dtype=dtype)
    args = (
        randn(b, heads, tokens, NOPE_DIM, dtype=dtype),
        randn(b, heads, tokens, ROPE_DIM, dtype=dtype),
        randn(b, 1, CACHE_LEN, rank, dtype=dtype),
        tail[..., :ROPE_DIM],
        positions,
        seq_lens,
    )
    kv_b = randn(heads * (NOPE_DIM + V_DIM), rank, dtype=dtype, scale=0.3)
    return args, {"kv_b_weight": kv_b, "nope_dim": NOPE_DIM, "v_dim": V_DIM, "scale": 0.2}


def test_registered_as_a_cuda_library_move() -> None:
    impl = get("mla_attention", "absorbed_triton")
    assert "absorbed_triton" in implementations("mla_attention")
    assert impl.runs_on("cuda") and not impl.runs_on("cpu")
    assert impl.derived is ABSORBED and impl.capturable and not impl.lossy
    # It takes GLM-5's selection: a CUDA engine offers it; a CPU one refuses it for the device.
    assert support_for(TINY_GLM, "cuda", name="g").op_reason("mla_attention", impl.name) is None
    assert "cuda" in (
        support_for(TINY_GLM, "cpu", name="g").op_reason("mla_attention", impl.name) or ""
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "rank"), [(6, 64), (20, 32)])
@pytest.mark.parametrize("selected", [False, True])
def test_op_matches_absorbed_and_reference(
    selected: bool, heads: int, rank: int, dtype: torch.dtype
) -> None:
    torch.manual_seed(heads + rank + selected)
    args, base = _op_case(heads, rank, dtype)
    extra = {"topk_indices": _selection(SEQ_LENS, 120, seed=heads)} if selected else {}
    derived = absorb(base)
    got = get("mla_attention", "absorbed_triton")(*args, **derived, **extra)
    assert got.shape == (len(SEQ_LENS), heads, 1, V_DIM)
    assert_close(got, get("mla_attention", "absorbed")(*args, **derived, **extra))
    want = get("mla_attention", "reference")(*args, **base, **extra)
    if dtype == torch.float32:
        assert_close(got, want)
    else:  # the reference rounds expanded per-head K/V to bfloat16: another rounding point
        torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)


def test_prefill_runs_absorbed() -> None:
    args, base = _op_case(6, 32, torch.bfloat16, tokens=4)
    derived = absorb(base)
    got = get("mla_attention", "absorbed_triton")(*args, **derived)
    assert torch.equal(got, get("mla_attention", "absorbed")(*args, **derived))


@pytest.mark.parametrize("selected", [False, True])
def test_op_under_torch_compile_calls_the_kernel_as_an_opaque_op(selected: bool) -> None:
    torch.manual_seed(7)
    args, base = _op_case(6, 32, torch.float32)
    extra = {"topk_indices": _selection(SEQ_LENS, 40, seed=3)} if selected else {}
    derived = absorb(base)
    calls: list[str] = []

    def backend(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        calls.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    impl = get("mla_attention", "absorbed_triton")
    compiled = torch.compile(impl.fn, backend=backend, fullgraph=True)
    out = compiled(*args, **derived, **extra)
    assert "kiln.mla_decode.default" in calls  # Dynamo never traced into the kernel
    assert_close(out, get("mla_attention", "absorbed")(*args, **derived, **extra))


TINY_GLM: dict[str, Any] = {
    "model_type": "glm_moe_dsa",
    "architectures": ["GlmMoeDsaForCausalLM"],
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 6,
    "num_key_value_heads": 6,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "q_lora_rank": 32,
    "kv_lora_rank": 24,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "head_dim": 8,
    "index_n_heads": 4,
    "index_head_dim": 16,
    "index_topk": 3,
    "indexer_rope_interleave": True,
    "rope_interleave": True,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def test_glm5_decode_steps_with_the_kernel_match_the_reference_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tiny GLM-5 (R = 24, Dr = 8: padded tiles; top-3 of up to 9 slots) decoding 3 steps
    with ``absorbed_triton`` gives the reference model's logits, through the kernel."""
    from kiln.ops.kernels import mla_decode as kernel

    selections: list[int] = []

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        selections.append(kwargs["topk_indices"].shape[-1])
        return mla_decode(*args, **kwargs)

    monkeypatch.setattr(kernel, "mla_decode", spy)
    config = parse_config(TINY_GLM, "tiny-glm")
    ref, model = (
        build_model(config, dtype=torch.float32, seed=3, max_batch=2, max_seq_len=12)
        for _ in range(2)
    )
    model.rebind(OpBinding.from_recipe({"mla_attention": "absorbed_triton"}))
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, TINY_GLM["vocab_size"], (2, 6), generator=gen)
    assert (model.prefill(prompt) - ref.prefill(prompt)).abs().max().item() < 1e-5
    token = prompt[:, -1:]
    for _ in range(3):
        want, got = ref.decode_step(token), model.decode_step(token)
        assert (got - want).abs().max().item() < 1e-5
        token = want.argmax(-1, keepdim=True)
    assert selections == [3] * (3 * TINY_GLM["num_hidden_layers"])  # decode steps only


def test_op_compiles_with_inductor() -> None:
    torch.manual_seed(8)
    args, base = _op_case(6, 32, torch.float32)
    extra = {"topk_indices": _selection(SEQ_LENS, 40, seed=4)}
    derived = absorb(base)
    impl = get("mla_attention", "absorbed_triton")
    out = torch.compile(impl.fn, fullgraph=True)(*args, **derived, **extra)
    assert_close(out, get("mla_attention", "absorbed")(*args, **derived, **extra))


def test_inconsistent_inputs_are_refused() -> None:
    q_latent, q_rope, latent, rope, seq_lens = _kernel_case(6, 32, torch.float32, [5, 5])
    for bad in (
        (q_latent, q_rope, latent[..., :16], rope, seq_lens),
        (q_latent, q_rope.to(torch.bfloat16), latent, rope, seq_lens),
        (q_latent, q_rope, latent, rope, seq_lens[:1]),
    ):
        with pytest.raises(ValueError):
            mla_decode(*bad, scale=0.2)
    with pytest.raises(ValueError, match="topk_indices"):
        mla_decode(q_latent, q_rope, latent, rope, seq_lens, scale=0.2, topk_indices=seq_lens)
