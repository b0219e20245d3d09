"""``kiln.ops.kernels.qkv_rope`` (norm + fused QKV + RoPE + KV-cache write) against its reference
and against kiln's op chain (``rms_norm`` -> ``qkv_proj fused`` -> ``rope cos_sin_cache`` ->
``StaticKVCache.write``).

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
from kiln.ops.kernels import qkv_rope as QR
from kiln.ops.registry import get
from tests.unit.op_testing import DTYPES, assert_close, randn

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5
P, S = 64, 24  # rope table length, cache length


@pytest.fixture(autouse=True)
def _poison(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(G, "POISON_OUTPUTS", True)


def _tables(d: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    t = get("rope", "cos_sin_cache").derived.fn({"inv_freq": inv_freq, "max_positions": P})  # type: ignore[union-attr]
    return t["cos"].to(DEVICE), t["sin"].to(DEVICE)


def _setup(
    b: int, hq: int, hkv: int, d: int, k: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    cos, sin = _tables(d)
    return {
        "x": randn(b, k, dtype=dtype, scale=2.0).to(DEVICE),
        "nw": (1.0 + 0.2 * torch.randn(k)).to(dtype).to(DEVICE),
        "w": randn((hq + 2 * hkv) * d, k, dtype=dtype, scale=k**-0.5).to(DEVICE),
        "cos": cos,
        "sin": sin,
        "pos": torch.randperm(S)[:b].to(DEVICE),
        "kc": randn(b + 1, hkv, S, d, dtype=dtype).to(DEVICE),
        "vc": randn(b + 1, hkv, S, d, dtype=dtype).to(DEVICE),
    }


CASES = [
    # (B, Hq, Hkv, D, K, config): block_n = rotation pairs per program
    (1, 4, 2, 16, 40, None),
    (3, 6, 2, 8, 100, G.GemvConfig(block_n=2, block_k=32)),
    (2, 2, 1, 12, 50, G.GemvConfig(block_n=4, block_k=16, num_warps=2)),  # D/2 = 6: masked
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("normed", [True, False])
@pytest.mark.parametrize(("b", "hq", "hkv", "d", "k", "config"), CASES)
def test_matches_reference(
    dtype: torch.dtype,
    normed: bool,
    b: int,
    hq: int,
    hkv: int,
    d: int,
    k: int,
    config: G.GemvConfig | None,
) -> None:
    t = _setup(b, hq, hkv, d, k, dtype)
    kc_ref, vc_ref = t["kc"].clone(), t["vc"].clone()
    nw = t["nw"] if normed else None
    heads = {"num_heads": hq, "num_kv_heads": hkv, "head_dim": d}
    got = QR.rms_norm_qkv_rope(
        t["x"], nw, EPS, t["w"], t["cos"], t["sin"], t["pos"], t["kc"], t["vc"],
        config=config, **heads,
    )  # fmt: skip
    want = QR.rms_norm_qkv_rope_reference(
        t["x"], nw, EPS, t["w"], t["cos"], t["sin"], t["pos"], kc_ref, vc_ref, **heads
    )
    assert got.shape == (b, hq, d)
    assert not got.isnan().any()
    assert_close(got, want)
    # every cache slot: the written ones match the reference's, the others are untouched
    assert_close(t["kc"], kc_ref)
    assert_close(t["vc"], vc_ref)


def test_reference_matches_kiln_op_chain() -> None:
    """The reference equals rms_norm -> qkv_proj fused -> rope cos_sin_cache -> cache write."""
    b, hq, hkv, d, k = 2, 4, 2, 8, 32
    t = _setup(b, hq, hkv, d, k, torch.float32)
    kc_ref, vc_ref = t["kc"].clone(), t["vc"].clone()
    q = QR.rms_norm_qkv_rope_reference(
        t["x"], t["nw"], EPS, t["w"], t["cos"], t["sin"], t["pos"], t["kc"], t["vc"],
        num_heads=hq, num_kv_heads=hkv, head_dim=d,
    )  # fmt: skip
    normed, _ = get("rms_norm")(t["x"][:, None], weight=t["nw"], eps=EPS)
    qq, kk, vv = get("qkv_proj", "fused")(
        normed, qkv_weight=t["w"], qkv_bias=None, num_heads=hq, num_kv_heads=hkv, head_dim=d
    )
    qq, kk = get("rope", "cos_sin_cache")(qq, kk, t["pos"][:, None], cos=t["cos"], sin=t["sin"])
    rows = torch.arange(b)[:, None]
    kc_ref[rows, :, t["pos"][:, None]] = kk.transpose(1, 2)
    vc_ref[rows, :, t["pos"][:, None]] = vv.transpose(1, 2)
    torch.testing.assert_close(q, qq[:, :, 0])
    torch.testing.assert_close(t["kc"], kc_ref)
    torch.testing.assert_close(t["vc"], vc_ref)


def test_nan_in_a_sequence_stays_in_that_sequence() -> None:
    t = _setup(2, 2, 1, 8, 24, torch.bfloat16)
    t["x"][1, 5] = float("nan")
    q = QR.rms_norm_qkv_rope(
        t["x"], t["nw"], EPS, t["w"], t["cos"], t["sin"], t["pos"], t["kc"], t["vc"],
        num_heads=2, num_kv_heads=1, head_dim=8,
    )  # fmt: skip
    assert q[1].isnan().all() and not q[0].isnan().any()
    assert t["kc"][1, :, t["pos"][1]].isnan().all()
    assert not t["kc"][0].isnan().any()


def test_bad_inputs_raise_clear_errors() -> None:
    t = _setup(1, 2, 1, 8, 16, torch.float32)
    args = (t["x"], t["nw"], EPS, t["w"], t["cos"], t["sin"], t["pos"], t["kc"], t["vc"])
    heads = {"num_heads": 2, "num_kv_heads": 1, "head_dim": 8}
    with pytest.raises(ValueError, match="bias"):
        QR.rms_norm_qkv_rope(*args, **heads, qkv_bias=torch.zeros(32, device=DEVICE))
    with pytest.raises(ValueError, match="split_k"):
        QR.rms_norm_qkv_rope(*args, **heads, config=G.GemvConfig(split_k=2))
    with pytest.raises(ValueError, match="rows"):
        QR.rms_norm_qkv_rope(*args, num_heads=3, num_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="positions"):
        bad = (*args[:6], t["pos"].int(), *args[7:])
        QR.rms_norm_qkv_rope(*bad, **heads)
    with pytest.raises(ValueError, match="k_cache"):
        bad = (*args[:7], t["kc"][:, :, :, :4], t["vc"])
        QR.rms_norm_qkv_rope(*bad, **heads)
