"""Decode attention (one query token per sequence) over a static KV cache: split-KV
flash-decoding in two Triton kernels (design: docs/design/kernels.md).

Stage 1: one program per (sequence, KV head, split of ``split_s`` positions) over all query heads
of the group, online softmax in float32; stage 2 (:mod:`kiln.ops.kernels.decode_combine`)
combines the splits by log-sum-exp. The split count is fixed by the cache length (CUDA-graph
safe). Optional gpt-oss semantics, compiled in only when given (constexpr flags): a sliding
``window`` (splits before it write the empty partial) and per-head attention ``sinks`` (one more
logit in the combine's denominator). On CPU set ``TRITON_INTERPRET`` before importing this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kiln.ops.kernels import runtime
from kiln.ops.kernels.decode_combine import combine_row, load_sink, stage2
from kiln.ops.kernels.pdl import PDL_MODES, launch_mode, pdl_enter, pdl_options
from kiln.ops.kernels.rounding import emulate_rounding
from kiln.ops.kernels.tiles import LOG2E, MMA_MIN, NUM_WARPS, is_pow2

Tensor = torch.Tensor


@dataclass(frozen=True)
class DecodeAttentionConfig:
    """Launch configuration of :func:`decode_attention` (no autotuning at call time).

    Attributes:
        split_s: cache positions per stage-1 program (a power of two, a multiple of ``block_s``).
        block_s: positions per inner iteration (a power of two >= 16).
        num_warps: 1, 2, 4, 8 or 16.
        use_dot: ``tl.dot`` for scores and ``p @ v`` (``p`` rounded to the cache dtype) or
            float32 multiply-sum; None: ``tl.dot``.
        fused_combine: the last stage-1 program of each (sequence, KV head) combines the splits.
        pdl: programmatic dependent launch (0 off, 1 or 2).
        num_stages: pipelining depth of stage 1 (1..4), None for Triton's default.

    Raises:
        ValueError: a value outside those ranges.
    """

    split_s: int = 256
    block_s: int = 64
    num_warps: int = 4
    use_dot: bool | None = None
    fused_combine: bool = False
    pdl: int = 0
    num_stages: int | None = None

    def __post_init__(self) -> None:
        if not is_pow2(self.block_s) or self.block_s < MMA_MIN:
            raise ValueError(f"block_s must be a power of two >= 16, got {self.block_s}")
        if not is_pow2(self.split_s) or self.split_s < self.block_s:
            raise ValueError(
                f"split_s must be a power of two >= block_s ({self.block_s}), got {self.split_s}"
            )
        if self.num_warps not in NUM_WARPS:
            raise ValueError(f"num_warps must be one of {NUM_WARPS}, got {self.num_warps}")
        if self.pdl not in range(PDL_MODES):
            raise ValueError(f"pdl must be 0, 1 or 2, got {self.pdl}")
        if self.num_stages is not None and self.num_stages not in range(1, 5):
            raise ValueError(f"num_stages must be 1..4 or None, got {self.num_stages}")


@triton.jit
def _stage1(
    q_ptr,
    k_ptr,
    v_ptr,
    seq_lens_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_vd,
    num_kv_heads,
    num_splits,
    cache_len,
    qk_scale,
    counter_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    stride_od,
    sinks_ptr,
    window,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    SPLIT_S: tl.constexpr,
    BLOCK_S: tl.constexpr,
    USE_DOT: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    FUSED_COMBINE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
    EMULATE: tl.constexpr,
    WINDOWED: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = (bh // num_kv_heads).to(tl.int64)
    kvh = bh % num_kv_heads
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    start = split * SPLIT_S
    end = tl.minimum(tl.minimum(start + SPLIT_S, seq_len), cache_len)
    first = start
    if WINDOWED:
        # The query (at seq_len - 1) sees slots >= lo: a split with none (lo >= end) is empty;
        # the others loop from the block holding their first visible slot, so that the first
        # iteration has a valid position, as without a window.
        lo = tl.maximum(seq_len - window, 0)
        first = start + (tl.maximum(lo - start, 0) // BLOCK_S) * BLOCK_S
        end = tl.where(lo < end, end, start)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_s = tl.arange(0, BLOCK_S)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=mask_g[:, None] & mask_d[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    k_base = k_ptr + b * stride_kb + kvh * stride_kh + offs_d[None, :] * stride_kd
    v_base = v_ptr + b * stride_vb + kvh * stride_vh + offs_d[None, :] * stride_vd

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    # Splits past the sequence (or the cache) do no work and write the empty partial.
    # A constant trip count with masks (not range(start, end)): the interpreter cannot
    # loop over tensor bounds, and the compiled loop unrolls/pipelines better.
    if start < end:
        for it in range(0, SPLIT_S // BLOCK_S):
            pos = first + it * BLOCK_S + offs_s
            mask_s = pos < end
            if WINDOWED:
                mask_s = mask_s & (pos >= lo)
            kv_mask = mask_s[:, None] & mask_d[None, :]
            k = tl.load(k_base + pos[:, None] * stride_ks, mask=kv_mask, other=0.0)
            v = tl.load(v_base + pos[:, None] * stride_vs, mask=kv_mask, other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            if USE_DOT:
                scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            else:
                scores = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
            scores = tl.where(mask_s[None, :], scores * qk_scale, float("-inf"))
            # The first iteration has a valid position (start < end), so m_new is finite
            # from then on; fully masked later iterations leave the state unchanged.
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if USE_DOT:
                pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            else:
                pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

    rows = (b * num_kv_heads * GROUP + heads) * num_splits + split
    tl.store(m_ptr + rows, m_i, mask=mask_g)
    tl.store(l_ptr + rows, l_i, mask=mask_g)
    tl.store(
        acc_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :],
        acc,
        mask=mask_g[:, None] & mask_d[None, :],
    )
    if FUSED_COMBINE:
        # Release our partials, count ourselves in; the last program of the group combines.
        done = tl.atomic_add(counter_ptr + bh, 1, sem="acq_rel")
        if done == NUM_SPLITS - 1:
            for g in tl.static_range(GROUP):
                head = kvh * GROUP + g
                combine_row(
                    m_ptr,
                    l_ptr,
                    acc_ptr,
                    out_ptr,
                    (b * num_kv_heads * GROUP + head) * NUM_SPLITS,
                    b * stride_ob + head * stride_oh,
                    stride_od,
                    load_sink(sinks_ptr, head, HAS_SINKS),
                    NUM_SPLITS,
                    HEAD_DIM,
                    D_PAD,
                    BLOCK_SPLITS,
                    EMULATE,
                    HAS_SINKS,
                )
            tl.atomic_xchg(counter_ptr + bh, 0)


def _check(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    seq_lens: Tensor,
    sinks: Tensor | None = None,
    window: int | None = None,
) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError(
            f"expected q [B, Hq, D] and caches [B, Hkv, S, D], got {tuple(q.shape)}, "
            f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    b, hq, d = q.shape
    if k_cache.shape != v_cache.shape or k_cache.shape[0] != b or k_cache.shape[3] != d:
        raise ValueError(
            f"cache shapes {tuple(k_cache.shape)}/{tuple(v_cache.shape)} do not match q "
            f"{tuple(q.shape)}"
        )
    if hq % k_cache.shape[1]:
        raise ValueError(f"query heads {hq} are not a multiple of KV heads {k_cache.shape[1]}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"dtypes differ: q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")
    if seq_lens.shape != (b,) or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seq_lens must be [B={b}] int64, got {tuple(seq_lens.shape)}")
    if sinks is not None and (sinks.shape != (hq,) or not sinks.is_floating_point()):
        raise ValueError(f"sinks must be [Hq={hq}] float, got {tuple(sinks.shape)} {sinks.dtype}")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}")
    extra = () if sinks is None else (sinks,)
    devices = {t.device for t in (q, k_cache, v_cache, seq_lens, *extra)}
    if len(devices) != 1:
        raise ValueError(f"tensors on different devices: {sorted(map(str, devices))}")


def decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    seq_lens: Tensor,
    *,
    scale: float,
    sinks: Tensor | None = None,
    window: int | None = None,
    config: DecodeAttentionConfig | None = None,
) -> Tensor:
    """Attention of each sequence's decode query (at ``seq_lens[b] - 1``) over its first
    ``seq_lens[b]`` cache slots, with ``window`` only the last ``window`` of them.

    Args:
        q: ``[B, Hq, D]`` (model dtype).
        k_cache, v_cache: ``[B, Hkv, S, D]`` in q's dtype, any strides; query head h reads KV
            head ``h // (Hq // Hkv)``.
        seq_lens: ``[B]`` int64 on q's device in ``[1, S]`` (larger clamped; 0 gives a zero row).
        scale: score multiplier.
        sinks: ``[Hq]`` float (any float dtype) or None: per head one more logit (natural-log
            units, not scaled) in the softmax denominator, with no value.
        window: int >= 1 or None: slots ``s >= seq_lens[b] - window`` only.

    Returns ``[B, Hq, D]`` in q's dtype. Raises ValueError on inconsistent shapes, dtypes or
    devices, KernelUnavailableError without CUDA or ``TRITON_INTERPRET=1``.
    """
    _check(q, k_cache, v_cache, seq_lens, sinks, window)
    runtime.require(q.device)
    config = config or DecodeAttentionConfig()
    b, hq, d = q.shape
    hkv, cache_len = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    use_dot = config.use_dot if config.use_dot is not None else True
    group_pad = triton.next_power_of_2(group)
    d_pad = triton.next_power_of_2(d)
    if use_dot:
        group_pad, d_pad = max(group_pad, MMA_MIN), max(d_pad, MMA_MIN)
    splits = triton.cdiv(cache_len, config.split_s)
    block_splits = min(triton.next_power_of_2(splits), 64)
    emulate = emulate_rounding(q.dtype)
    m = torch.empty((b, hq, splits), dtype=torch.float32, device=q.device)
    ell = torch.empty((b, hq, splits), dtype=torch.float32, device=q.device)
    acc = torch.empty((b, hq, splits, d), dtype=torch.float32, device=q.device)
    out = torch.empty((b, hq, d), dtype=q.dtype, device=q.device)
    counters = _counters(q.device, b * hkv) if config.fused_combine else m
    pdl = launch_mode(config.pdl, q.device)
    # A window covering the whole cache masks nothing: the full-attention kernel, unchanged.
    win = window if window is not None and window < cache_len else 0
    _stage1[(b * hkv, splits)](
        q,
        k_cache,
        v_cache,
        seq_lens,
        m,
        ell,
        acc,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        hkv,
        splits,
        cache_len,
        scale * LOG2E,
        counters,
        out,
        *out.stride(),
        q if sinks is None else sinks,  # not read without sinks
        win,
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=d,
        D_PAD=d_pad,
        SPLIT_S=config.split_s,
        BLOCK_S=config.block_s,
        USE_DOT=use_dot,
        # The interpreter has no bfloat16 arithmetic (numpy): upcast the tiles there.
        UPCAST=runtime.interpreting(),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FUSED_COMBINE=config.fused_combine,
        NUM_SPLITS=splits,
        BLOCK_SPLITS=block_splits,
        EMULATE=emulate,
        WINDOWED=win > 0,
        HAS_SINKS=sinks is not None,
        PDL=pdl,
        num_warps=config.num_warps,
        **({} if config.num_stages is None else {"num_stages": config.num_stages}),
        **pdl_options(pdl),
    )
    if config.fused_combine:
        return out
    stage2[(b * hq,)](
        m,
        ell,
        acc,
        out,
        q if sinks is None else sinks,
        *out.stride(),
        hq,
        NUM_SPLITS=splits,
        HEAD_DIM=d,
        D_PAD=d_pad,
        BLOCK_SPLITS=block_splits,
        EMULATE=emulate,
        HAS_SINKS=sinks is not None,
        PDL=pdl,
        num_warps=4 if d_pad >= 128 else 2,
        **pdl_options(pdl),
    )
    return out


_COUNTERS: dict[tuple[str, int], Tensor] = {}


def _counters(device: torch.device, n: int) -> Tensor:
    """Per-(sequence, KV head) ``[n]`` int32 counters on ``device``, kept between calls."""
    key = (str(device), n)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(n, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def decode_attention_reference(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, seq_lens: Tensor, *, scale: float
) -> Tensor:
    """Plain-PyTorch :func:`decode_attention` without sinks or window (float32 softmax; for
    those, :func:`kiln.ops.attention.reference`); same other arguments, result and ValueError.
    """
    _check(q, k_cache, v_cache, seq_lens)
    b, hq, d = q.shape
    hkv, cache_len = k_cache.shape[1], k_cache.shape[2]
    qg = q.float().reshape(b, hkv, hq // hkv, d)
    scores = torch.matmul(qg, k_cache.float().transpose(-1, -2)) * scale  # [B, Hkv, G, S]
    valid = torch.arange(cache_len, device=q.device)[None, :] < seq_lens[:, None]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v_cache.float()).reshape(b, hq, d).to(q.dtype)
