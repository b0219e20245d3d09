"""``attention`` "flash_decoding": split-KV Triton decode attention (CUDA only). Same contract as
:func:`kiln.ops.attention.reference`, ``sinks`` and ``window`` included (gpt-oss).

At decode (``T == 1``) it runs :func:`kiln.ops.kernels.decode_attention.decode_attention` on ``q[:,
:, 0]``; the query sits at ``seq_lens[b] - 1``, so the length mask is the causal mask and
``positions`` is not read. Prefill (``T > 1``) runs ``sdpa`` (its mask carries a window), or
``reference`` with sinks (``scaled_dot_product_attention`` has no sink logit). Under
``torch.compile`` the kernel is called through the custom op ``kiln::decode_attention`` (Inductor
failed to compile it inline on an H200). The kernel module is imported on first call: importing
:mod:`kiln.ops` must not fix Triton's compile-or-interpret choice.
"""

from __future__ import annotations

import torch

from kiln.ops.attention import reference, sdpa
from kiln.ops.registry import register

Tensor = torch.Tensor


@register("attention", "flash_decoding", devices=("cuda",))
def flash_decoding(
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
    """Decode via the split-KV Triton kernel (default :class:`DecodeAttentionConfig`), prefill via
    ``sdpa`` (``reference`` with sinks).

    Args:
        q: ``[B, Hq, T, D]`` (model dtype).
        k_cache, v_cache: ``[B, Hkv, S, D]`` (views of the first B rows of the cache buffers).
        positions: ``[B, T]`` int64; at decode ``positions[b, 0] == seq_lens[b] - 1``.
        seq_lens: ``[B]`` int64 valid cache length after this step's write.
        scale: score multiplier.
        sinks: ``[Hq]`` float or None; window: int >= 1 or None (:mod:`kiln.ops.attention`).

    Returns:
        ``[B, Hq, T, D]`` in ``q.dtype``.

    Raises:
        KernelUnavailableError: at decode without CUDA (or ``TRITON_INTERPRET=1``).
    """
    if q.shape[2] != 1:
        if sinks is not None:
            return reference(
                q, k_cache, v_cache, positions, seq_lens, scale=scale, sinks=sinks, window=window
            )
        return sdpa(q, k_cache, v_cache, positions, seq_lens, scale=scale, window=window)
    if torch.compiler.is_compiling():
        out = decode_attention_op(q[:, :, 0], k_cache, v_cache, seq_lens, scale, sinks, window)
    else:
        out = _decode(q[:, :, 0], k_cache, v_cache, seq_lens, scale, sinks, window)
    return out.unsqueeze(2)


def _decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    seq_lens: Tensor,
    scale: float,
    sinks: Tensor | None,
    window: int | None,
) -> Tensor:
    from kiln.ops.kernels.decode_attention import decode_attention

    return decode_attention(q, k_cache, v_cache, seq_lens, scale=scale, sinks=sinks, window=window)


@torch.library.custom_op("kiln::decode_attention", mutates_args=())
def decode_attention_op(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    seq_lens: Tensor,
    scale: float,
    sinks: Tensor | None = None,
    window: int | None = None,
) -> Tensor:
    """:func:`kiln.ops.kernels.decode_attention.decode_attention` as an op ``torch.compile``
    does not trace into: ``q`` ``[B, Hq, D]``, caches ``[B, Hkv, S, D]``, ``seq_lens`` ``[B]``
    int64, ``sinks`` ``[Hq]`` or None, ``window`` or None; returns a new ``[B, Hq, D]`` tensor in
    q's dtype."""
    return _decode(q, k_cache, v_cache, seq_lens, scale, sinks, window)


@decode_attention_op.register_fake
def _decode_attention_fake(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    seq_lens: Tensor,
    scale: float,
    sinks: Tensor | None = None,
    window: int | None = None,
) -> Tensor:
    return q.new_empty(q.shape)
