"""The GEMV kernels at Llama-3.2-1B sizes on CUDA (skipped without it): kernel vs reference in
bfloat16 for M in (1, 4, 16), split-K, and capture/replay inside a CUDA graph.

Run on a GPU host: ``pytest --noconftest tests/gpu/test_kernels_gemv_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

H, HQ, HKV, D, INTER, VOCAB, EPS = 2048, 32, 8, 64, 8192, 128256, 1e-5
BF16 = torch.bfloat16
TOL = {"atol": 2e-2, "rtol": 2e-2}
# (name, N, K) of the decoder's projections
SHAPES = [("qkv", (HQ + 2 * HKV) * D, H), ("o_proj", H, HQ * D), ("down", H, INTER)]


def _rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * scale).to(BF16)


@pytest.fixture(autouse=True)
def _poison(monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln.ops.kernels import gemv as G

    monkeypatch.setattr(G, "POISON_OUTPUTS", True)


@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize(("name", "n", "k"), SHAPES)
@pytest.mark.parametrize("split_k", [1, 4])
def test_gemv_llama_shapes(m: int, name: str, n: int, k: int, split_k: int) -> None:
    from kiln.ops.kernels.gemv import GemvConfig, default_config, gemv, gemv_reference

    x, w, r = _rand(m, k), _rand(n, k, scale=k**-0.5), _rand(m, n)
    base = default_config(n, k, m=m)
    cfg = GemvConfig(block_n=base.block_n, block_k=min(base.block_k, 512), split_k=split_k)
    got = gemv(x, w, residual=r, config=cfg)
    torch.testing.assert_close(got, gemv_reference(x, w, residual=r), **TOL)


@pytest.mark.parametrize("m", [1, 4])
def test_lm_head_llama_shape(m: int) -> None:
    from kiln.ops.kernels.gemv import gemv, gemv_reference

    x, w = _rand(m, H), _rand(VOCAB, H, scale=H**-0.5)
    got = gemv(x, w, out_dtype=torch.float32)
    torch.testing.assert_close(got, gemv_reference(x, w, out_dtype=torch.float32), **TOL)


@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("activation", [None, "silu_mul"])
def test_rms_norm_gemv_llama_shapes(m: int, activation: str | None) -> None:
    from kiln.ops.kernels.norm_gemv import rms_norm_gemv, rms_norm_gemv_reference

    n = 2 * INTER if activation else (HQ + 2 * HKV) * D
    x, nw, w = _rand(m, H, scale=3.0), 1.0 + _rand(H, scale=0.1), _rand(n, H, scale=H**-0.5)
    got = rms_norm_gemv(x, nw, EPS, w, activation=activation)
    want = rms_norm_gemv_reference(x, nw, EPS, w, activation=activation)
    torch.testing.assert_close(got, want, **TOL)


def _rope_inputs(b: int, positions: list[int]) -> dict[str, torch.Tensor]:
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device="cuda").float() / D))
    angles = torch.arange(4096, device="cuda").float()[:, None] * inv_freq
    return {
        "x": _rand(b, H, scale=3.0),
        "nw": 1.0 + _rand(H, scale=0.1),
        "w": _rand((HQ + 2 * HKV) * D, H, scale=H**-0.5),
        "cos": angles.cos(),
        "sin": angles.sin(),
        "pos": torch.tensor(positions, device="cuda"),
        "kc": _rand(8, HKV, 4096, D),
        "vc": _rand(8, HKV, 4096, D),
    }


@pytest.mark.parametrize("positions", [[0], [4095, 17, 300, 1]])
def test_qkv_rope_llama_shape(positions: list[int]) -> None:
    from kiln.ops.kernels.qkv_rope import rms_norm_qkv_rope, rms_norm_qkv_rope_reference

    t = _rope_inputs(len(positions), positions)
    kc, vc = t["kc"].clone(), t["vc"].clone()
    heads = {"num_heads": HQ, "num_kv_heads": HKV, "head_dim": D}
    args = (t["x"], t["nw"], EPS, t["w"], t["cos"], t["sin"], t["pos"])
    got = rms_norm_qkv_rope(*args, t["kc"], t["vc"], **heads)
    want = rms_norm_qkv_rope_reference(*args, kc, vc, **heads)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(t["kc"], kc, **TOL)
    torch.testing.assert_close(t["vc"], vc, **TOL)


@pytest.mark.parametrize("split_k", [1, 2])
def test_capture_and_replay_in_a_cuda_graph(split_k: int) -> None:
    """Captured once, replayed on new inputs written into the same buffers."""
    from kiln.ops.kernels.gemv import GemvConfig, gemv, gemv_reference
    from kiln.ops.kernels.norm_gemv import gate_up_silu, gate_up_silu_reference

    x, w, gu = _rand(2, H), _rand(H, H, scale=H**-0.5), _rand(2 * INTER, H, scale=H**-0.5)
    cfg = GemvConfig(block_n=4, block_k=512, split_k=split_k)
    gemv(x, w, config=cfg), gate_up_silu(x, gu)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gemv(x, w, config=cfg)
        h = gate_up_silu(x, gu)
    for _ in range(2):
        x.copy_(_rand(2, H))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(y, gemv_reference(x, w), **TOL)
        torch.testing.assert_close(h, gate_up_silu_reference(x, gu), **TOL)


@pytest.mark.parametrize("op", ["qkv_proj", "o_proj", "mlp", "lm_head"])
def test_registered_ops_at_decode(op: str) -> None:
    import kiln.ops
    import kiln.ops.linear_triton
    from kiln.ops.registry import get

    assert kiln.ops.linear_triton  # imported for its registrations
    b = 3
    if op == "qkv_proj":
        args: tuple[torch.Tensor, ...] = (_rand(b, 1, H),)
        params = {
            "q_weight": _rand(HQ * D, H, scale=H**-0.5),
            "k_weight": _rand(HKV * D, H, scale=H**-0.5),
            "v_weight": _rand(HKV * D, H, scale=H**-0.5),
            "q_bias": None, "k_bias": None, "v_bias": None,
            "num_heads": HQ, "num_kv_heads": HKV, "head_dim": D,
        }  # fmt: skip
        impl = "triton_gemv"
    elif op == "o_proj":
        args, impl = (_rand(b, HQ, 1, D),), "triton_gemv"
        params = {"weight": _rand(H, H, scale=H**-0.5), "bias": None}
    elif op == "mlp":
        params = {
            "gate_weight": _rand(INTER, H, scale=H**-0.5),
            "up_weight": _rand(INTER, H, scale=H**-0.5),
            "down_weight": _rand(H, INTER, scale=INTER**-0.5),
        }
        args, impl = (_rand(b, 1, H),), "triton_gate_up"
    else:
        args, impl = (_rand(b, 1, H),), "triton_gemv"
        params = {"weight": _rand(VOCAB, H, scale=H**-0.5)}
    alt = get(op, impl)
    expected = get(op)(*args, **params)
    actual = alt(*args, **(alt.derived.fn(params) if alt.derived else params))
    for a, e in zip(
        actual if isinstance(actual, tuple) else (actual,),
        expected if isinstance(expected, tuple) else (expected,),
        strict=True,
    ):
        torch.testing.assert_close(a, e, **TOL)
