"""``attention``: causal grouped-query attention over a static KV cache.

Call: ``attention(q, k_cache, v_cache, positions, seq_lens) -> out``; params ``scale``. Query
``t`` of sequence ``b`` at ``positions[b, t]`` sees cache slot ``s`` when ``s <= positions[b,
t]`` and ``s < seq_lens[b]``; this step's keys are already written. Padded queries give unused
finite output. Query head ``h`` reads KV head ``h // (Hq // Hkv)``.

gpt-oss sites add two params: ``window`` (int or None: a query also sees only slots ``s >
positions[b, t] - window``) and ``sinks`` (``[Hq]`` or None: per head one more logit in the
softmax denominator, with no value, as transformers' ``GptOssAttention``). ``reference`` and
``flash_decoding`` (:mod:`kiln.ops.attention_triton`) take both; ``sdpa`` takes ``window`` only,
so it is refused for gpt-oss by its signature, as every implementation lacking one of them is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.ops.precision import widened
from kiln.ops.registry import register

Tensor = torch.Tensor


def cache_mask(
    positions: Tensor, seq_lens: Tensor, cache_len: int, window: int | None = None
) -> Tensor:
    """``[B, 1, T, S]`` bool, True where query (``positions [B, T]``) may see a slot (within
    ``window`` when given)."""
    slots = torch.arange(cache_len, device=positions.device)
    causal = slots[None, None, :] <= positions[:, :, None]
    valid = slots[None, None, :] < seq_lens[:, None, None]
    mask = causal & valid
    if window is not None:
        mask = mask & (slots[None, None, :] > positions[:, :, None] - window)
    return mask[:, None]


SCORES_BUDGET = 1 << 28
"""Most float32 scores (1 GiB) the reference holds at once: a longer prompt is attended in query
chunks (a batch of 34 Mooncake prompts of 7,084 tokens would otherwise need 203 GiB)."""


@register("attention", "reference")
def reference(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    positions: Tensor,
    seq_lens: Tensor,
    *,
    scale: float,
    sinks: Tensor | None = None,
    window: int | None = None,
) -> Tensor:
    """Explicit ``softmax(q k^T * scale + mask) v`` in float32 (float64 for float64 ``q``), over
    query chunks of at most :data:`SCORES_BUDGET` scores; ``sinks`` and ``window``: the module
    docstring.

    Args:
        q: ``[B, Hq, T, D]`` (model dtype).
        k_cache, v_cache: ``[B, Hkv, S, D]``, Hq a multiple of Hkv.
        positions: ``[B, T]`` int64; seq_lens: ``[B]`` int64 valid lengths after this step.

    Returns ``[B, Hq, T, D]`` in ``q.dtype``.
    """
    b, hq, t, _ = q.shape
    chunk = max(1, SCORES_BUDGET // max(1, b * hq * k_cache.shape[2]))
    if t <= chunk:
        return _attend(q, k_cache, v_cache, positions, seq_lens, scale, sinks, window)
    parts = [
        _attend(q[:, :, i : i + chunk], k_cache, v_cache, positions[:, i : i + chunk], seq_lens,
                scale, sinks, window)
        for i in range(0, t, chunk)
    ]  # fmt: skip
    return torch.cat(parts, dim=2)


def _attend(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, positions: Tensor, seq_lens: Tensor,
    scale: float, sinks: Tensor | None = None, window: int | None = None,
) -> Tensor:  # fmt: skip
    b, hq, t, d = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    # Query head h reads KV head h // group (transformers' repeat_kv), computed by grouping the
    # queries as [B, Hkv, group * T, D] instead of copying the cache group times.
    qg = widened(q).reshape(b, hkv, group * t, d)
    scores = torch.matmul(qg, k_cache.to(qg.dtype).transpose(-1, -2)) * scale
    mask = cache_mask(positions, seq_lens, k_cache.shape[2], window)  # [B, 1, T, S]
    scores = scores.view(b, hkv, group, t, -1).masked_fill(~mask[:, :, None], float("-inf"))
    if sinks is not None:  # one more logit per head, dropped after the softmax
        sink = sinks.to(scores.dtype).view(1, hkv, group, 1, 1).expand(b, hkv, group, t, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        probs = probs.reshape(b, hkv, group * t, -1)
    else:
        probs = torch.softmax(scores, dim=-1).view(b, hkv, group * t, -1)
        if window is not None:  # a padded query past its window sees no slot: 0, not NaN
            probs = probs.nan_to_num(0.0)
    return torch.matmul(probs, v_cache.to(qg.dtype)).view(b, hq, t, d).to(q.dtype)


def _whole_prompt(positions: Tensor, seq_lens: Tensor, cache_len: int) -> bool:
    """True when every row is a whole prompt from position 0 (a host sync; False while capturing
    or compiling).
    """
    t = positions.shape[1]
    if t > cache_len or torch.compiler.is_compiling():
        return False
    if positions.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    steps = torch.arange(t, device=positions.device)
    return bool(((positions == steps).all() & (seq_lens == t).all()).item())


@register("attention", "sdpa")
def sdpa(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    positions: Tensor,
    seq_lens: Tensor,
    *,
    scale: float,
    window: int | None = None,
) -> Tensor:
    """``scaled_dot_product_attention`` with ``enable_gqa``; the contract of :func:`reference`
    (``window`` too, no ``sinks``).

    A whole-prompt prefill without a window runs causally without a mask tensor, so PyTorch may
    pick a flash or memory-efficient kernel; other steps use the boolean cache mask.
    """
    t = q.shape[2]
    if t > 1 and window is None and _whole_prompt(positions, seq_lens, k_cache.shape[2]):
        return F.scaled_dot_product_attention(
            q,
            k_cache[:, :, :t],
            v_cache[:, :, :t],
            is_causal=True,
            scale=scale,
            enable_gqa=q.shape[1] != k_cache.shape[1],
        )
    mask = cache_mask(positions, seq_lens, k_cache.shape[2], window)
    return F.scaled_dot_product_attention(
        q,
        k_cache,
        v_cache,
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != k_cache.shape[1],
    )
