"""``attention`` "flash_decoding": split-KV Triton decode attention (CUDA only).

At decode (``T == 1``) it runs :func:`kiln.ops.kernels.decode_attention.decode_attention` on
``q[:, :, 0]``: the query of sequence b sits at position ``seq_lens[b] - 1`` (the op contract at
decode), so the causal mask adds nothing to the length mask the kernel applies and
``positions`` is not read. Prefill (``T > 1``) falls back to the ``sdpa`` implementation. Same
contract as :func:`kiln.ops.attention.reference`.

The kernel module is imported on first call, not here: Triton decides between compiling and
interpreting (``TRITON_INTERPRET``) when it decorates the kernels, and importing :mod:`kiln.ops`
must not fix that choice.
"""

from __future__ import annotations

import torch

from kiln.ops.attention import sdpa
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
) -> Tensor:
    """Decode via the split-KV Triton kernel (default :class:`DecodeAttentionConfig`), prefill
    via ``sdpa``.

    Args:
        q: ``[B, Hq, T, D]`` (model dtype).
        k_cache, v_cache: ``[B, Hkv, S, D]`` (views of the first B rows of the cache buffers).
        positions: ``[B, T]`` int64; at decode ``positions[b, 0] == seq_lens[b] - 1``.
        seq_lens: ``[B]`` int64 valid cache length after this step's write.
        scale: score multiplier.

    Returns:
        ``[B, Hq, T, D]`` in ``q.dtype``.

    Raises:
        KernelUnavailableError: at decode without CUDA (or ``TRITON_INTERPRET=1``).
    """
    if q.shape[2] != 1:
        return sdpa(q, k_cache, v_cache, positions, seq_lens, scale=scale)
    from kiln.ops.kernels.decode_attention import decode_attention

    return decode_attention(q[:, :, 0], k_cache, v_cache, seq_lens, scale=scale).unsqueeze(2)
