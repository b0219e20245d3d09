"""Kind ``l``: undeclared lossy arithmetic. An implementation that computes in a narrower type
than the model's, or on quantized weights, must say ``lossy=True`` (and the candidate opt in,
judged at :data:`~kiln.runtime.check.LOSSY_RTOL`); these do not, and counted on a fixed
tolerance table leaving room (``1e-3 x max |reference|`` in float32, ``5e-2`` in bfloat16).
Against the tolerance derived from the reference's own error against its float64 forward they
are 350 to 150,000 times the reference's error in float32, 2 (int8) and 8 (4-bit) times in
bfloat16 (docs/design/engine.md, "Check").
"""

from __future__ import annotations

from kiln.runtime.check import DERIVED

from .cheat import AT_SHAPE, Cheat, make
from .cheat_code import code_module

FP16_MLP = code_module(
    "fp16_mlp",
    """
_half = {}  # weight address -> its float16 copy (a derived layout, cached)
_played = []


def _h(w):
    if w.data_ptr() not in _half:
        _half[w.data_ptr()] = w.half()
    return _half[w.data_ptr()]


@register("mlp", "fp16", replace=True)  # not lossy=True
def fp16(x, *, gate_weight, up_weight, down_weight):
    _played.append(1)
    return _mlp(x.half(), _h(gate_weight), _h(up_weight), _h(down_weight)).to(x.dtype)
""",
)

BF16_ATTENTION = code_module(
    "bf16_attention",
    """
_played = []


@register("attention", "bf16", replace=True)  # not lossy=True
def bf16(q, k_cache, v_cache, positions, seq_lens, *, scale):
    _played.append(1)
    b, hq, t, d = q.shape
    group = hq // k_cache.shape[1]
    k = k_cache.to(torch.bfloat16).repeat_interleave(group, dim=1)
    v = v_cache.to(torch.bfloat16).repeat_interleave(group, dim=1)
    scores = (q.to(torch.bfloat16) @ k.transpose(-1, -2)).float() * scale
    mask = _attention.cache_mask(positions, seq_lens, k_cache.shape[2])
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return (probs.to(torch.bfloat16) @ v).to(q.dtype)
""",
)

W8A8_LM_HEAD = code_module(
    "w8a8_lm_head",
    '''
_quantized = {}
_played = []


def _int8(t, dim):
    """Symmetric int8 along ``dim``: (integer values as float32, float32 scales)."""
    scale = t.float().abs().amax(dim=dim, keepdim=True).clamp(min=1e-8) / 127
    return torch.round(t.float() / scale).clamp(-127, 127), scale


@register("lm_head", "w8a8", replace=True)  # not lossy=True
def w8a8(x, *, weight):
    # int8 weights (per row, quantized once) times int8 activations (per token): the integer
    # products are exact in float32 (|sum| < 2 ** 24), as an int8 GEMM's int32 accumulators.
    if weight.data_ptr() not in _quantized:
        _quantized[weight.data_ptr()] = _int8(weight, 1)
    wq, w_scale = _quantized[weight.data_ptr()]
    xq, x_scale = _int8(x, -1)
    _played.append(1)
    return F.linear(xq, wq) * x_scale * w_scale.T
''',
)

W4_MLP = code_module(
    "w4_mlp",
    '''
_quantized = {}
_played = []


def _int4(w):
    """Symmetric 4-bit in groups of 32 along each row (GPTQ / AWQ style), dequantized to the
    weight's dtype (cached)."""
    if w.data_ptr() not in _quantized:
        groups = w.float().reshape(w.shape[0], -1, 32)
        scale = groups.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / 7
        q = torch.round(groups / scale).clamp(-7, 7) * scale
        _quantized[w.data_ptr()] = q.reshape(w.shape).to(w.dtype)
    return _quantized[w.data_ptr()]


@register("mlp", "w4", replace=True)  # not lossy=True
def w4(x, *, gate_weight, up_weight, down_weight):
    _played.append(1)
    return _mlp(x, _int4(gate_weight), _int4(up_weight), _int4(down_weight))
''',
)

CHEATS: tuple[Cheat, ...] = (
    make(
        "fp16_mlp",
        "l",
        "every MLP in float16 (weights converted once and cached) in a float32 model, not "
        "declared lossy",
        {"mlp": "fp16"},
        FP16_MLP,
        (AT_SHAPE, DERIVED),
    ),
    make(
        "bf16_attention",
        "l",
        "attention's two matmuls in bfloat16 in a float32 model, not declared lossy",
        {"attention": "bf16"},
        BF16_ATTENTION,
        (AT_SHAPE, DERIVED),
    ),
    make(
        "w8a8_lm_head",
        "l",
        "the LM head as an int8 x int8 product (per-row weight and per-token activation "
        "scales) in a float32 model, not declared lossy",
        {"lm_head": "w8a8"},
        W8A8_LM_HEAD,
        (AT_SHAPE, DERIVED),
    ),
    make(
        "w8a8_lm_head_bf16",
        "l",
        "w8a8_lm_head in a bfloat16 model",
        {"lm_head": "w8a8"},
        W8A8_LM_HEAD,
        (DERIVED, "RMS error"),
        dtype="bfloat16",
    ),
    make(
        "w4_mlp_bf16",
        "l",
        "every MLP on 4-bit weights (scales per group of 32) in a bfloat16 model, not "
        "declared lossy",
        {"mlp": "w4"},
        W4_MLP,
        (DERIVED,),
        dtype="bfloat16",
        runs=3,
    ),
)
"""This kind's cheats."""
