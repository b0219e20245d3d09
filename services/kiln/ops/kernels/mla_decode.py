"""Latent-cache MLA decode attention (one query token per sequence; FlashMLA's shape): split-KV
flash-decoding over a cache holding, per slot, one latent row ``c [R]`` shared by every query head
as key and value, plus one rope key row ``k_r [Dr]``, in two Triton kernels.

Stage 1: one program per (sequence, block of ``block_h`` query heads, split of the slots): scores
``q_lat . c + q_rope . k_r`` of ``block_h x block_s`` tiles by ``tl.dot`` (float32 accumulation),
online softmax in float32 (``exp2``), ``p @ c`` accumulated in float32 (``p`` rounded to the cache
dtype for the tensor cores, as FlashAttention does). With a selection (GLM-5's ``topk_indices``)
the splits run over its K entries instead of the cache and each tile gathers the named rows.
Stage 2 combines a row's splits by log-sum-exp. The split count depends on shapes only (cache
length or K, batch, heads; :meth:`MlaDecodeConfig.splits`), never on ``seq_lens``: CUDA-graph
safe. On CPU set ``TRITON_INTERPRET`` before importing this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kiln.ops.kernels import runtime
from kiln.ops.kernels.decode_combine import stage2
from kiln.ops.kernels.rounding import emulate_rounding
from kiln.ops.kernels.tiles import LOG2E, MMA_MIN, NUM_WARPS, is_pow2

Tensor = torch.Tensor

#: The dtypes the kernel takes (float64 is the callers' business).
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class MlaDecodeConfig:
    """Launch configuration of :func:`mla_decode` (no autotuning at call time).

    Attributes:
        block_h: query heads per program (a power of two >= 16; fewer heads are masked).
        block_s: slots per inner iteration (a power of two >= 16).
        split_s: slots per split (a power of two multiple of ``block_s``), or None: enough splits
            for about ``target_programs`` programs, at most ``max_splits``.
        target_programs: the program count the automatic split aims at (2 waves of 132 SMs).
        max_splits: the most splits (bounds the float32 partials, ``B x Hq x splits x R``).
        num_warps: 1, 2, 4, 8 or 16; num_stages: stage-1 pipelining (1..4), None: Triton's.

    Raises:
        ValueError: a value outside those ranges.
    """

    block_h: int = 16
    block_s: int = 32
    split_s: int | None = None
    target_programs: int = 264
    max_splits: int = 64
    num_warps: int = 4
    num_stages: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_h", "block_s"):
            value = getattr(self, name)
            if not is_pow2(value) or value < MMA_MIN:
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.split_s is not None and (not is_pow2(self.split_s) or self.split_s < self.block_s):
            raise ValueError(
                f"split_s must be a power of two >= block_s ({self.block_s}), got {self.split_s}"
            )
        if self.target_programs < 1 or self.max_splits < 1:
            raise ValueError("target_programs and max_splits must be >= 1")
        if self.num_warps not in NUM_WARPS:
            raise ValueError(f"num_warps must be one of {NUM_WARPS}, got {self.num_warps}")
        if self.num_stages is not None and self.num_stages not in range(1, 5):
            raise ValueError(f"num_stages must be 1..4 or None, got {self.num_stages}")

    def splits(self, slots: int, batch: int, head_blocks: int) -> tuple[int, int]:
        """``(split_s, splits)`` for ``slots`` cache slots (or selection entries): a power-of-two
        number of ``block_s`` blocks a split (few distinct compiled kernels), shapes only."""
        blocks = max(1, triton.cdiv(slots, self.block_s))
        if self.split_s is not None:
            split_s = self.split_s
        else:
            want = triton.cdiv(self.target_programs, batch * head_blocks)
            want = max(1, min(want, self.max_splits, blocks))
            split_s = triton.next_power_of_2(triton.cdiv(blocks, want)) * self.block_s
        return split_s, max(1, triton.cdiv(slots, split_s))


@triton.jit
def _stage1(
    ql_ptr,
    qr_ptr,
    lat_ptr,
    rope_ptr,
    seq_lens_ptr,
    sel_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    stride_qlb,
    stride_qlh,
    stride_qld,
    stride_qrb,
    stride_qrh,
    stride_qrd,
    stride_lb,
    stride_ls,
    stride_ld,
    stride_rb,
    stride_rs,
    stride_rd,
    stride_selb,
    stride_selk,
    num_heads,
    head_blocks,
    num_splits,
    cache_len,
    num_entries,
    qk_scale,
    R: tl.constexpr,
    R_PAD: tl.constexpr,
    DR: tl.constexpr,
    DR_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SPLIT_S: tl.constexpr,
    BLOCK_S: tl.constexpr,
    SELECTED: tl.constexpr,
    DEDUPE: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid // head_blocks).to(tl.int64)
    hb = pid % head_blocks
    seq_len = tl.minimum(tl.load(seq_lens_ptr + b).to(tl.int32), cache_len)
    start = split * SPLIT_S
    # Dense: the first seq_len slots. Selected: the K entries (each then checked against seq_len).
    if SELECTED:
        end = tl.minimum(start + SPLIT_S, num_entries)
    else:
        end = tl.minimum(start + SPLIT_S, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, R_PAD)
    offs_e = tl.arange(0, DR_PAD)
    offs_s = tl.arange(0, BLOCK_S)
    heads = hb * BLOCK_H + offs_h
    mask_h = heads < num_heads
    mask_r = offs_r < R
    mask_e = offs_e < DR
    ql = tl.load(
        ql_ptr + b * stride_qlb + heads[:, None] * stride_qlh + offs_r[None, :] * stride_qld,
        mask=mask_h[:, None] & mask_r[None, :],
        other=0.0,
    )
    qr = tl.load(
        qr_ptr + b * stride_qrb + heads[:, None] * stride_qrh + offs_e[None, :] * stride_qrd,
        mask=mask_h[:, None] & mask_e[None, :],
        other=0.0,
    )
    if UPCAST:  # the interpreter has no bfloat16 arithmetic (numpy)
        ql = ql.to(tl.float32)
        qr = qr.to(tl.float32)
    lat_base = lat_ptr + b * stride_lb + offs_r[None, :] * stride_ld
    rope_base = rope_ptr + b * stride_rb + offs_e[None, :] * stride_rd
    sel_base = sel_ptr + b * stride_selb

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, R_PAD], tl.float32)
    # A constant trip count with masks: the interpreter cannot loop over tensor bounds.
    if start < end:
        for it in range(0, SPLIT_S // BLOCK_S):
            pos = start + it * BLOCK_S + offs_s
            live = pos < end
            if SELECTED:
                slot = tl.load(sel_base + pos * stride_selk, mask=live, other=-1).to(tl.int32)
                live = live & (slot >= 0) & (slot < seq_len)
                if DEDUPE:  # sorted entries: a repeat equals its left neighbour
                    prev = tl.load(
                        sel_base + (pos - 1) * stride_selk, mask=live & (pos > 0), other=-1
                    ).to(tl.int32)
                    live = live & (slot != prev)
            else:
                slot = pos
            lat = tl.load(
                lat_base + slot[:, None] * stride_ls,
                mask=live[:, None] & mask_r[None, :],
                other=0.0,
            )
            rope = tl.load(
                rope_base + slot[:, None] * stride_rs,
                mask=live[:, None] & mask_e[None, :],
                other=0.0,
            )
            if UPCAST:
                lat = lat.to(tl.float32)
                rope = rope.to(tl.float32)
            scores = tl.dot(ql, tl.trans(lat), input_precision=PRECISION)
            scores = tl.dot(qr, tl.trans(rope), acc=scores, input_precision=PRECISION)
            scores = tl.where(live[None, :], scores * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            # A tile with nothing live (possible with a selection) before any live slot leaves
            # m at -inf: subtract 0 instead so exp2 gives 0, never NaN.
            m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)
            alpha = tl.exp2(m_i - m_ref)
            p = tl.exp2(scores - m_ref[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            pv = tl.dot(p.to(lat.dtype), lat, input_precision=PRECISION)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

    rows = (b * num_heads + heads) * num_splits + split
    tl.store(m_ptr + rows, m_i, mask=mask_h)
    tl.store(l_ptr + rows, l_i, mask=mask_h)
    tl.store(
        acc_ptr + rows[:, None] * R + offs_r[None, :], acc, mask=mask_h[:, None] & mask_r[None, :]
    )


def _check(
    q_latent: Tensor,
    q_rope: Tensor,
    latent_cache: Tensor,
    rope_cache: Tensor,
    seq_lens: Tensor,
    topk_indices: Tensor | None,
) -> None:
    if q_latent.dim() != 3 or q_rope.dim() != 3 or latent_cache.dim() != 3 or rope_cache.dim() != 3:
        raise ValueError(
            "expected q_latent [B, H, R], q_rope [B, H, Dr], latent_cache [B, S, R], rope_cache "
            f"[B, S, Dr], got {tuple(q_latent.shape)}, {tuple(q_rope.shape)}, "
            f"{tuple(latent_cache.shape)}, {tuple(rope_cache.shape)}"
        )
    b, h, r = q_latent.shape
    s, dr = latent_cache.shape[1], q_rope.shape[2]
    want = ((b, h, dr), (b, s, r), (b, s, dr))
    if (tuple(q_rope.shape), tuple(latent_cache.shape), tuple(rope_cache.shape)) != want:
        raise ValueError(
            f"shapes do not match: q_latent {tuple(q_latent.shape)}, q_rope "
            f"{tuple(q_rope.shape)}, latent_cache {tuple(latent_cache.shape)}, rope_cache "
            f"{tuple(rope_cache.shape)}"
        )
    dtypes = {q_latent.dtype, q_rope.dtype, latent_cache.dtype, rope_cache.dtype}
    if len(dtypes) != 1 or q_latent.dtype not in DTYPES:
        raise ValueError(f"need one dtype of {DTYPES}, got {sorted(map(str, dtypes))}")
    if seq_lens.shape != (b,) or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seq_lens must be [B={b}] int64, got {tuple(seq_lens.shape)}")
    tensors = [q_latent, q_rope, latent_cache, rope_cache, seq_lens]
    if topk_indices is not None:
        shape = tuple(topk_indices.shape)
        if len(shape) != 2 or shape[0] != b or topk_indices.is_floating_point():
            raise ValueError(f"topk_indices must be [B={b}, K] int, got {shape}")
        tensors.append(topk_indices)
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"tensors on different devices: {sorted(map(str, devices))}")


def mla_decode(
    q_latent: Tensor,
    q_rope: Tensor,
    latent_cache: Tensor,
    rope_cache: Tensor,
    seq_lens: Tensor,
    *,
    scale: float,
    topk_indices: Tensor | None = None,
    dedupe: bool = True,
    config: MlaDecodeConfig | None = None,
) -> Tensor:
    """``softmax(scale * (q_latent . c + q_rope . k_r)) @ c`` of each sequence's decode query
    over its first ``seq_lens[b]`` slots (or the selected ones among them).

    Args:
        q_latent: ``[B, H, R]`` absorbed query ``q_nope W_UK``; q_rope: ``[B, H, Dr]``; one dtype of
            :data:`DTYPES` for all four tensors.
        latent_cache: ``[B, S, R]``; rope_cache: ``[B, S, Dr]``; any strides (cache views).
        seq_lens: ``[B]`` int64, the query sits at ``seq_lens[b] - 1`` (larger than S: clamped;
            a row with no visible slot is zero).
        scale: the softmax scale.
        topk_indices: ``[B, K]`` int slots a query may see (``-1``, or ``>= seq_lens[b]``:
            none), or None: all ``seq_lens[b]``. K may exceed S. A slot named twice is attended
            once with ``dedupe`` (the entries are sorted on the device first, as a set, the way
            :func:`kiln.ops.mla.selection_mask` reads them), once per occurrence without.
        config: launch configuration (default :class:`MlaDecodeConfig`).

    Returns ``[B, H, R]`` in q's dtype. Raises ValueError on inconsistent shapes, dtypes or
    devices, KernelUnavailableError without CUDA or ``TRITON_INTERPRET=1``.
    """
    _check(q_latent, q_rope, latent_cache, rope_cache, seq_lens, topk_indices)
    runtime.require(q_latent.device)
    config = config or MlaDecodeConfig()
    b, h, r = q_latent.shape
    cache_len, dr = latent_cache.shape[1], q_rope.shape[2]
    selected = topk_indices is not None
    if topk_indices is not None and dedupe:
        topk_indices = topk_indices.sort(dim=-1).values
    sel = topk_indices if topk_indices is not None else seq_lens  # unread when not selected
    entries = sel.shape[1] if topk_indices is not None else cache_len
    head_blocks = triton.cdiv(h, config.block_h)
    split_s, splits = config.splits(entries, b, head_blocks)
    r_pad = max(triton.next_power_of_2(r), MMA_MIN)
    m = torch.empty((b, h, splits), dtype=torch.float32, device=q_latent.device)
    ell = torch.empty((b, h, splits), dtype=torch.float32, device=q_latent.device)
    acc = torch.empty((b, h, splits, r), dtype=torch.float32, device=q_latent.device)
    out = torch.empty((b, h, r), dtype=q_latent.dtype, device=q_latent.device)
    sel_strides = sel.stride() if topk_indices is not None else (0, 0)
    _stage1[(b * head_blocks, splits)](
        q_latent,
        q_rope,
        latent_cache,
        rope_cache,
        seq_lens,
        sel,
        m,
        ell,
        acc,
        *q_latent.stride(),
        *q_rope.stride(),
        *latent_cache.stride(),
        *rope_cache.stride(),
        *sel_strides,
        h,
        head_blocks,
        splits,
        cache_len,
        entries,
        scale * LOG2E,
        R=r,
        R_PAD=r_pad,
        DR=dr,
        DR_PAD=max(triton.next_power_of_2(dr), MMA_MIN),
        BLOCK_H=config.block_h,
        SPLIT_S=split_s,
        BLOCK_S=config.block_s,
        SELECTED=selected,
        DEDUPE=selected and dedupe,
        UPCAST=runtime.interpreting(),
        PRECISION="ieee" if q_latent.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        **({} if config.num_stages is None else {"num_stages": config.num_stages}),
    )
    stage2[(b * h,)](  # the same partials' layout as decode attention's: its combine
        m,
        ell,
        acc,
        out,
        out,  # no sinks: never read
        *out.stride(),
        h,
        NUM_SPLITS=splits,
        HEAD_DIM=r,
        D_PAD=r_pad,
        BLOCK_SPLITS=min(triton.next_power_of_2(splits), 16),
        EMULATE=emulate_rounding(q_latent.dtype),
        HAS_SINKS=False,
        PDL=0,
        num_warps=4 if r_pad >= 256 else 2,
    )
    return out


def mla_decode_reference(
    q_latent: Tensor,
    q_rope: Tensor,
    latent_cache: Tensor,
    rope_cache: Tensor,
    seq_lens: Tensor,
    *,
    scale: float,
    topk_indices: Tensor | None = None,
) -> Tensor:
    """Plain-PyTorch :func:`mla_decode` (float32 scores and softmax, repeats attended once);
    same arguments, result and ValueError."""
    _check(q_latent, q_rope, latent_cache, rope_cache, seq_lens, topk_indices)
    cache_len = latent_cache.shape[1]
    lat, rope = latent_cache.float(), rope_cache.float()
    scores = torch.einsum("bhr,bsr->bhs", q_latent.float(), lat)
    scores = (scores + torch.einsum("bhd,bsd->bhs", q_rope.float(), rope)) * scale
    visible = torch.arange(cache_len, device=q_latent.device)[None, :] < seq_lens[:, None]
    if topk_indices is not None:
        slots = topk_indices.long()
        slots = slots.masked_fill((slots < 0) | (slots >= cache_len), cache_len)
        picked = visible.new_zeros((visible.shape[0], cache_len + 1)).scatter_(1, slots, True)
        visible = visible & picked[:, :cache_len]
    probs = torch.softmax(scores.masked_fill(~visible[:, None, :], float("-inf")), dim=-1)
    probs = torch.where(visible.any(-1)[:, None, None], probs, 0.0)
    return torch.einsum("bhs,bsr->bhr", probs, lat).to(q_latent.dtype)
