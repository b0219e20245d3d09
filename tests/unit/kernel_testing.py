"""Shared helpers for the Triton kernel tests run through Triton's interpreter on CPU.

Every kernel test module starts with ``os.environ["TRITON_INTERPRET"] = "1"`` *before* anything
imports Triton (Triton picks compile vs interpret when ``@triton.jit`` decorates a function,
including its own ``tl.max``/``tl.sum`` helpers at ``import triton``). pytest imports all test
modules at collection, before any test runs, so the variable is set early enough when the whole
suite runs in one process, as long as no module imported earlier imports Triton at import time.
The GEMV kernel tests do the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch


@pytest.fixture
def poisoned_empty(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``torch.empty`` (and ``empty_like``) return NaN-filled float tensors and -1-filled
    integer tensors for the test's duration, so an output element (or partial-result element)
    a kernel forgets to write shows up as NaN or a wrong index instead of lucky zeros."""
    real_empty, real_like = torch.empty, torch.empty_like

    def fill(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            return t.fill_(float("nan"))
        if t.dtype != torch.bool:
            return t.fill_(-1)
        return t

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        return fill(real_empty(*args, **kwargs))

    def empty_like(*args: Any, **kwargs: Any) -> torch.Tensor:
        return fill(real_like(*args, **kwargs))

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_like", empty_like)
    yield


def assert_finite(t: torch.Tensor) -> None:
    """No NaN or inf anywhere in ``t``."""
    assert torch.isfinite(t.float()).all(), f"{(~torch.isfinite(t.float())).sum()} non-finite"
