"""A transformers baseline that would not fit beside kiln's engine is skipped with the reason,
before it allocates (``kiln.baselines.hf.copy_shortfall``)."""

from __future__ import annotations

import torch

from kiln.baselines.hf import copy_shortfall


def test_a_copy_that_does_not_fit_is_refused_with_the_sizes() -> None:
    a, b = torch.zeros(1000, dtype=torch.bfloat16), torch.zeros(500)  # 2,000 + 2,000 bytes
    cuda = torch.device("cuda", 0)
    assert copy_shortfall([a, b], cuda, free_bytes=10_000) is None
    why = copy_shortfall([a, b], cuda, free_bytes=4_000)  # within 5 % of the free memory
    assert why is not None and "needs 0.0 GB" in why and "cuda:0" in why


def test_tied_weights_count_once() -> None:
    embed = torch.zeros(1000)  # 4,000 bytes
    assert (
        copy_shortfall([embed, embed.view(10, 100), embed[:10]], torch.device("cuda"), 4_300)
        is None
    )
    assert copy_shortfall([embed, torch.zeros(1000)], torch.device("cuda"), 4_300) is not None


def test_a_cpu_engine_is_not_checked() -> None:
    assert copy_shortfall([torch.zeros(10)], torch.device("cpu")) is None
