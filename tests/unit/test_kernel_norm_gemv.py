"""``kiln.ops.kernels.norm_gemv`` (RMS norm + GEMV, SiLU·mul epilogue) against its references.

Sets ``TRITON_INTERPRET=1`` before Triton's first import on hosts without CUDA (see
``test_kernel_gemv``'s docstring).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

from kiln.ops.kernels import gemv as G
from kiln.ops.kernels import norm_gemv as NG
from tests.unit.op_testing import DTYPES, assert_close, randn

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5


@pytest.fixture(autouse=True)
def _poison(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(G, "POISON_OUTPUTS", True)


def _rand(*shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return randn(*shape, dtype=dtype, scale=scale).to(DEVICE)


def _norm_weight(k: int, dtype: torch.dtype) -> torch.Tensor:
    return (1.0 + 0.2 * torch.randn(k)).to(dtype).to(DEVICE)


CASES = [
    # (M, N (output rows), K, config)
    (1, 37, 100, G.GemvConfig(block_n=16, block_k=32)),
    (3, 21, 130, G.GemvConfig(block_n=16, block_k=64, split_k=2)),
    (4, 18, 70, None),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", [None, "silu_mul"])
@pytest.mark.parametrize(("m", "n", "k", "config"), CASES)
def test_matches_reference(
    dtype: torch.dtype,
    activation: str | None,
    m: int,
    n: int,
    k: int,
    config: G.GemvConfig | None,
) -> None:
    x = _rand(m, k, dtype=dtype, scale=3.0)  # the residual stream is not unit-scale
    nw = _norm_weight(k, dtype)
    rows = 2 * n if activation else n
    w = _rand(rows, k, dtype=dtype, scale=k**-0.5)
    got = NG.rms_norm_gemv(x, nw, EPS, w, activation=activation, config=config)
    want = NG.rms_norm_gemv_reference(x, nw, EPS, w, activation=activation)
    assert got.shape == (m, n)
    assert not got.isnan().any()
    assert_close(got, want)


def test_reference_is_rms_norm_then_swiglu() -> None:
    x, nw = torch.randn(2, 12), 1.0 + torch.rand(12)
    g, u = torch.randn(5, 12), torch.randn(5, 12)
    xn = nw * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    want = torch.nn.functional.silu(xn @ g.T) * (xn @ u.T)
    got = NG.rms_norm_gemv_reference(x, nw, EPS, torch.cat([g, u]), activation="silu_mul")
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k", [1, 3])
def test_gate_up_silu_matches_mlp_epilogue(dtype: torch.dtype, split_k: int) -> None:
    x = _rand(2, 90, dtype=dtype)
    w = _rand(2 * 24, 90, dtype=dtype, scale=0.1)
    cfg = G.GemvConfig(block_n=16, block_k=32, split_k=split_k)
    got = NG.gate_up_silu(x, w, config=cfg)
    gate, up = torch.nn.functional.linear(x, w).chunk(2, dim=-1)
    assert_close(got, torch.nn.functional.silu(gate) * up)
    assert_close(got, NG.gate_up_silu_reference(x, w))


def test_nan_in_a_row_propagates_to_that_row_only() -> None:
    x = _rand(2, 40, dtype=torch.bfloat16)
    x[0, 3] = float("nan")
    w = _rand(16, 40, dtype=torch.bfloat16)
    got = NG.rms_norm_gemv(
        x, _norm_weight(40, torch.bfloat16), EPS, w, config=G.GemvConfig(block_n=16, block_k=64)
    )
    assert got[0].isnan().all()
    assert not got[1].isnan().any()


def test_bad_inputs_raise_clear_errors() -> None:
    x = _rand(1, 16, dtype=torch.float32)
    nw = _norm_weight(16, torch.float32)
    w = _rand(9, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match="silu_mul needs"):
        NG.rms_norm_gemv(x, nw, EPS, w, activation="silu_mul")
    with pytest.raises(ValueError, match="activation"):
        NG.rms_norm_gemv(x, nw, EPS, w, activation="gelu")
    with pytest.raises(ValueError, match="norm_weight"):
        NG.rms_norm_gemv(x, nw[:15], EPS, w)
    with pytest.raises(ValueError, match="eps"):
        NG.rms_norm_gemv(x, nw, -1.0, w)
