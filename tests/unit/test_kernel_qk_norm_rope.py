"""``kiln.ops.kernels.qk_norm_rope`` (per-head Q/K norm + RoPE + KV-cache write) against its
reference and against kiln's op chain (``qkv_proj`` output -> ``rms_norm`` per head -> ``rope
cos_sin_cache`` -> ``StaticKVCache.write``), with and without the norms, for GQA ratios and head
dims 8..256 (an odd number of rotation pairs included).

Sets ``TRITON_INTERPRET=1`` before Triton's first import on hosts without CUDA.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

from kiln.ops.kernels import qk_norm_rope as QN
from kiln.ops.registry import get
from tests.unit.op_testing import DTYPES, assert_close, randn

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
P, S = 64, 24  # rope table length, cache length


def _tables(d: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2).float() / d))
    t = get("rope", "cos_sin_cache").derived.fn({"inv_freq": inv_freq, "max_positions": P})  # type: ignore[union-attr]
    return t["cos"].to(DEVICE), t["sin"].to(DEVICE)


def _setup(b: int, hq: int, hkv: int, d: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    cos, sin = _tables(d)
    return {
        "qkv": randn(b, (hq + 2 * hkv) * d, dtype=dtype, scale=3.0).to(DEVICE),
        "qn": (1.0 + 0.3 * torch.randn(d)).to(dtype).to(DEVICE),
        "kn": (1.0 + 0.3 * torch.randn(d)).to(dtype).to(DEVICE),
        "cos": cos,
        "sin": sin,
        "pos": torch.randperm(S)[:b].to(DEVICE),
        "kc": randn(b + 1, hkv, S, d, dtype=dtype).to(DEVICE),
        "vc": randn(b + 1, hkv, S, d, dtype=dtype).to(DEVICE),
    }


CASES = [
    # (B, Hq, Hkv, D)
    (1, 4, 2, 16),
    (3, 6, 2, 8),
    (2, 4, 1, 12),  # D/2 = 6 pairs: masked lanes
    (2, 8, 8, 64),  # no GQA
    (1, 4, 1, 256),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norms", ["both", "none", "q_only"])
@pytest.mark.parametrize(("b", "hq", "hkv", "d"), CASES)
def test_matches_reference(
    dtype: torch.dtype, norms: str, b: int, hq: int, hkv: int, d: int
) -> None:
    torch.manual_seed(b * 100 + d)
    t = _setup(b, hq, hkv, d, dtype)
    kc_ref, vc_ref = t["kc"].clone(), t["vc"].clone()
    qn = None if norms == "none" else t["qn"]
    kn = t["kn"] if norms == "both" else None
    heads = {"num_heads": hq, "num_kv_heads": hkv, "head_dim": d}
    args = (t["cos"], t["sin"], t["pos"])
    got = QN.qk_norm_rope(t["qkv"], qn, kn, EPS, *args, t["kc"], t["vc"], **heads)
    want = QN.qk_norm_rope_reference(t["qkv"], qn, kn, EPS, *args, kc_ref, vc_ref, **heads)
    assert got.shape == (b, hq, d)
    assert not got.isnan().any()
    assert_close(got, want)
    # every cache slot: the written ones match the reference's, the others are untouched
    assert_close(t["kc"], kc_ref)
    assert_close(t["vc"], vc_ref)


def test_reference_matches_kiln_op_chain() -> None:
    """The reference equals kiln's decoder ops: per-head rms_norm, then rope cos_sin_cache."""
    b, hq, hkv, d = 2, 4, 2, 8
    t = _setup(b, hq, hkv, d, torch.float32)
    kc_ref = t["kc"].clone()
    q = QN.qk_norm_rope_reference(
        t["qkv"], t["qn"], t["kn"], EPS, t["cos"], t["sin"], t["pos"], t["kc"], t["vc"],
        num_heads=hq, num_kv_heads=hkv, head_dim=d,
    )  # fmt: skip
    qq, kk, _ = t["qkv"].split([hq * d, hkv * d, hkv * d], dim=-1)
    qq = qq.unflatten(-1, (hq, d))[:, :, None]  # [B, Hq, 1, D]
    kk = kk.unflatten(-1, (hkv, d))[:, :, None]
    qq, _ = get("rms_norm")(qq, weight=t["qn"], eps=EPS)
    kk, _ = get("rms_norm")(kk, weight=t["kn"], eps=EPS)
    qq, kk = get("rope", "cos_sin_cache")(qq, kk, t["pos"][:, None], cos=t["cos"], sin=t["sin"])
    rows = torch.arange(b)[:, None]
    kc_ref[rows, :, t["pos"][:, None]] = kk.transpose(1, 2)
    torch.testing.assert_close(q, qq[:, :, 0])
    torch.testing.assert_close(t["kc"], kc_ref)


def test_norm_scales_each_head_by_its_own_statistics() -> None:
    """A head scaled by 100 comes out the same after the norm (the norm is per head, not per
    row): the kernel cannot be reading other heads' values into the statistics."""
    b, hq, hkv, d = 1, 2, 1, 16
    t = _setup(b, hq, hkv, d, torch.float32)
    scaled = t["qkv"].clone()
    scaled[:, :d] *= 100.0
    heads = {"num_heads": hq, "num_kv_heads": hkv, "head_dim": d}
    a = QN.qk_norm_rope(
        t["qkv"], t["qn"], t["kn"], EPS, t["cos"], t["sin"], t["pos"], t["kc"], t["vc"], **heads
    )
    c = QN.qk_norm_rope(
        scaled, t["qn"], t["kn"], EPS, t["cos"], t["sin"], t["pos"], t["kc"], t["vc"], **heads
    )
    torch.testing.assert_close(a, c, atol=1e-4, rtol=1e-4)


def test_bad_inputs_raise_clear_errors() -> None:
    t = _setup(1, 2, 1, 8, torch.float32)
    args = (t["qkv"], t["qn"], t["kn"], EPS, t["cos"], t["sin"], t["pos"], t["kc"], t["vc"])
    heads = {"num_heads": 2, "num_kv_heads": 1, "head_dim": 8}
    with pytest.raises(ValueError, match="qkv must be"):
        QN.qk_norm_rope(*args, num_heads=3, num_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="q_norm"):
        QN.qk_norm_rope(t["qkv"], t["qn"][:4], *args[2:], **heads)
    with pytest.raises(ValueError, match="positions"):
        QN.qk_norm_rope(*args[:6], t["pos"].int(), *args[7:], **heads)
    with pytest.raises(ValueError, match="k_cache"):
        QN.qk_norm_rope(*args[:7], t["kc"][:, :, :, :4], t["vc"], **heads)
    with pytest.raises(ValueError, match="even head_dim"):
        QN.qk_norm_rope(*args, num_heads=2, num_kv_heads=1, head_dim=7)
