"""Prefix-cache reuse from Mooncake ``hash_ids``.

Mooncake gives each prompt as the ids of its 512-token blocks; equal ids are the same prefix KV
block. Walking the requests in arrival order with an *unbounded* cache, a request's cached prefix
is its longest leading run of block ids all seen in earlier requests (a prefix cache can only
reuse a prefix: the first unseen block ends reuse). The hit rate is token-weighted, as in
SOURCES.md ("prefix-cache proxy", token-weighted column):

    hit rate = sum_i min(cached_blocks_i * block_size, isl_i) / sum_i isl_i

It is an upper bound for any finite cache (no evictions).
"""

from __future__ import annotations

from collections.abc import Sequence

from kiln.workloads.traffic.records import Request

MOONCAKE_BLOCK_TOKENS = 512


def prefix_hit_rate(requests: Sequence[Request], block_size: int = MOONCAKE_BLOCK_TOKENS) -> float:
    """Fraction (0..1) of prompt tokens inside an already-cached leading prefix, requests taken
    in the given order; 0.0 when there are no prompt tokens. ``block_size`` is in tokens."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    seen: set[int] = set()
    hit = total = 0
    for r in requests:
        cached = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            cached += 1
        hit += min(cached * block_size, r.isl)
        total += r.isl
        seen.update(r.hash_ids)
    return hit / total if total else 0.0


def block_reuse_rate(requests: Sequence[Request]) -> float:
    """Fraction (0..1) of all hash-id blocks whose id appeared in an earlier request (SOURCES.md's
    "% of blocks seen before"; not restricted to a leading prefix); 0.0 with no blocks."""
    seen: set[int] = set()
    reused = total = 0
    for r in requests:
        reused += sum(1 for h in r.hash_ids if h in seen)
        total += len(r.hash_ids)
        seen.update(r.hash_ids)
    return reused / total if total else 0.0
