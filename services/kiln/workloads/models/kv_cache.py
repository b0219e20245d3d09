"""A static KV cache: fixed-size K and V buffers per layer and each sequence's length; buffers
never change shape or address (CUDA-graph friendly).

A latent (MLA) cache is the same object with one "head": ``k[l]`` holds each token's normalised
latent ``[B, 1, S, kv_lora_rank]`` and ``v[l]`` its rotated rope key ``[B, 1, S,
qk_rope_head_dim]``, so a token costs ``kv_lora_rank + qk_rope_head_dim`` values per layer
(:meth:`kiln.workloads.config.ModelConfig.kv_elements_per_layer`), no per-head K/V. A GLM-5
cache (sparse-attention indexer) widens ``v[l]`` to ``[B, 1, S, qk_rope_head_dim +
index_head_dim]``: the rope key, then the indexer's key (transformers' ``update_indexer``), so
one ``write`` stores both and every reader of ``k``/``v`` sees the whole cache.
"""

from __future__ import annotations

import torch

from kiln.workloads.config import ModelConfig

Tensor = torch.Tensor


class CacheCapacityError(ValueError):
    """A batch or sequence longer than the cache was built for."""


class StaticKVCache:
    """Per-layer ``k[l]``: ``[max_batch, Hkv, max_len, D]`` and ``v[l]``: ``[max_batch, Hkv,
    max_len, Dv]`` (``Dv = value_dim``, default D) in the model dtype, and ``lengths
    [max_batch]`` int64, on ``device``; the active batch is the first ``batch`` rows.
    """

    def __init__(
        self,
        *,
        layers: int,
        max_batch: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        value_dim: int | None = None,
    ) -> None:
        if max_batch < 1 or max_len < 1:
            raise ValueError("max_batch and max_len must be positive")
        shape = (max_batch, kv_heads, max_len, head_dim)
        v_shape = (max_batch, kv_heads, max_len, head_dim if value_dim is None else value_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(v_shape, dtype=dtype, device=device) for _ in range(layers)]
        self.lengths = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.max_batch = max_batch
        self.max_len = max_len
        self.batch = 0
        self._longest = 0

    @staticmethod
    def for_config(
        config: ModelConfig,
        *,
        max_batch: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> StaticKVCache:
        """A cache for every layer of ``config`` (its KV heads and head dim; for MLA the latent
        cache of the module docstring).

        Raises:
            ValueError: ``max_batch`` or ``max_len`` below 1.
        """
        if config.mla is not None:
            index = config.dsa.head_dim if config.dsa is not None else 0
            return StaticKVCache(
                layers=config.num_hidden_layers,
                max_batch=max_batch,
                kv_heads=1,
                max_len=max_len,
                head_dim=config.mla.kv_lora_rank,
                value_dim=config.mla.qk_rope_head_dim + index,
                dtype=dtype,
                device=device,
            )
        return StaticKVCache(
            layers=config.num_hidden_layers,
            max_batch=max_batch,
            kv_heads=config.num_key_value_heads,
            max_len=max_len,
            head_dim=config.head_dim,
            dtype=dtype,
            device=device,
        )

    def nbytes(self) -> int:
        """Bytes of the K and V buffers."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def reset(self, *, zero: bool = False) -> None:
        """Forget every sequence (lengths 0); ``zero=True`` also clears the buffers."""
        self.lengths.zero_()
        self.batch = 0
        self._longest = 0
        if zero:
            for t in self.k + self.v:
                t.zero_()

    def start(self, seq_lens: Tensor, tokens: int) -> Tensor:
        """Begin ``B`` new sequences (``seq_lens [B]`` int64, each in ``[1, tokens]``) from
        right-padded prompts of ``tokens`` slots, replacing what the cache held; returns
        positions ``[B, T]`` int64.

        Raises:
            CacheCapacityError: ``B > max_batch`` or ``T > max_len``.
            ValueError: a length outside ``[1, T]``.
        """
        b = int(seq_lens.shape[0])
        if b > self.max_batch or tokens > self.max_len:
            raise CacheCapacityError(
                f"batch {b} x {tokens} tokens exceeds the cache ({self.max_batch} x {self.max_len})"
            )
        lo, hi = int(seq_lens.min()), int(seq_lens.max())
        if lo < 1 or hi > tokens:
            raise ValueError(f"sequence lengths must be within 1..{tokens}, got {lo}..{hi}")
        self.reset()
        self.batch = b
        self.lengths[:b] = seq_lens.to(self.lengths.device)
        self._longest = hi
        positions = torch.arange(tokens, device=self.lengths.device)
        return positions.expand(b, tokens)

    def next_positions(self) -> tuple[Tensor, Tensor]:
        """Positions ``[B, 1]`` and lengths after the step ``[B]`` (int64) of a decode step;
        CacheCapacityError with no active batch or a full sequence.
        """
        if self.batch == 0:
            raise CacheCapacityError("no sequences in the cache: prefill first")
        if self._longest >= self.max_len:
            raise CacheCapacityError(f"a sequence fills the cache ({self.max_len} slots)")
        lengths = self.lengths[: self.batch]
        return lengths[:, None], lengths + 1

    def advance(self, steps: int = 1) -> None:
        """Record that every active sequence grew by ``steps`` tokens."""
        self.lengths[: self.batch] += steps
        self._longest += steps

    def state(self) -> tuple[Tensor, int, int]:
        """A copy of the bookkeeping (not the K/V buffers) for :meth:`restore_state`."""
        return self.lengths.clone(), self.batch, self._longest

    def restore_state(self, state: tuple[Tensor, int, int]) -> None:
        """Put back bookkeeping from :meth:`state`, in place (``lengths`` keeps its address)."""
        lengths, self.batch, self._longest = state
        self.lengths.copy_(lengths)

    def advanced_on_device(self, steps: int = 1) -> None:
        """Record on the host that a replayed CUDA graph advanced every active sequence by
        ``steps``.
        """
        self._longest += steps

    def write(self, layer: int, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Store ``k [B, Hkv, T, D]``, ``v [B, Hkv, T, Dv]`` (MLA: latent and rope key) at
        ``positions [B, T]`` int64 of ``layer``; returns views of the layer's cache for the active
        batch, ``(k [B, Hkv, S, D], v [B, Hkv, S, Dv])``.
        """
        b = k.shape[0]
        rows = torch.arange(b, device=positions.device)[:, None]
        k_cache, v_cache = self.k[layer][:b], self.v[layer][:b]
        # Advanced indices on dims 0 and 2 put their [B, T] shape first: values are [B, T, Hkv, D].
        k_cache[rows, :, positions] = k.transpose(1, 2).to(k_cache.dtype)
        v_cache[rows, :, positions] = v.transpose(1, 2).to(v_cache.dtype)
        return k_cache, v_cache
