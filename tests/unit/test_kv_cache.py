"""The static KV cache: writes at positions, lengths bookkeeping, capacity errors."""

from __future__ import annotations

import pytest
import torch

from kiln.workloads.models.kv_cache import CacheCapacityError, StaticKVCache


def _cache(max_batch: int = 2, max_len: int = 6) -> StaticKVCache:
    return StaticKVCache(
        layers=2,
        max_batch=max_batch,
        kv_heads=3,
        max_len=max_len,
        head_dim=4,
        dtype=torch.float32,
        device="cpu",
    )


def test_prefill_then_decode_bookkeeping_and_writes() -> None:
    cache = _cache()
    positions = cache.start(torch.tensor([3, 1]), tokens=3)
    assert positions.tolist() == [[0, 1, 2], [0, 1, 2]]
    k = torch.randn(2, 3, 3, 4)
    k_all, _ = cache.write(1, k, -k, positions)
    assert k_all.shape == (2, 3, 6, 4)
    assert torch.equal(cache.k[1][:, :, :3], k) and torch.equal(cache.v[1][:, :, :3], -k)
    pos, lens = cache.next_positions()
    assert pos.tolist() == [[3], [1]] and lens.tolist() == [4, 2]
    step = torch.randn(2, 3, 1, 4)
    cache.write(0, step, step, pos)
    assert torch.equal(cache.k[0][0, :, 3], step[0, :, 0])
    assert torch.equal(cache.k[0][1, :, 1], step[1, :, 0])
    cache.advance()
    assert cache.lengths.tolist() == [4, 2]
    cache.reset(zero=True)
    assert cache.lengths.tolist() == [0, 0] and not cache.k[1].any()


def test_capacity_errors() -> None:
    cache = _cache(max_batch=1, max_len=3)
    with pytest.raises(CacheCapacityError, match="prefill first"):
        cache.next_positions()
    with pytest.raises(CacheCapacityError):
        cache.start(torch.tensor([2, 2]), tokens=2)
    with pytest.raises(CacheCapacityError):
        cache.start(torch.tensor([4]), tokens=4)
    with pytest.raises(ValueError, match=r"within 1\.\.2"):
        cache.start(torch.tensor([3]), tokens=2)
    cache.start(torch.tensor([2]), tokens=2)
    cache.next_positions()
    cache.advance()
    with pytest.raises(CacheCapacityError, match="fills the cache"):
        cache.next_positions()
