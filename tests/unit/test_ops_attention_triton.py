"""The Triton-backed op registrations vs their ops' reference implementations, through Triton's
interpreter (``TRITON_INTERPRET=1`` set below before Triton is imported; see
tests/unit/kernel_testing.py): ``attention`` "flash_decoding" (decode kernel at T == 1, sdpa
fallback at T > 1), ``rms_norm`` "triton", and the lossy "fp8_gemv" implementations of
``qkv_proj``, ``o_proj`` and ``mlp`` (within a documented error bound that a lossless
tolerance rejects)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

from collections.abc import Callable
from typing import Any

import pytest
import torch

import kiln.ops  # noqa: F401
from kiln.ops import attention_triton, quantized_linear, rms_norm_triton  # noqa: F401
from kiln.ops.registry import OpImpl, get
from tests.unit.op_testing import DTYPES, assert_close, randn

CACHE_LEN, HEAD_DIM, KV_HEADS = 45, 16, 2

#: fp8 e4m3 row-wise: relative (Frobenius) error of a layer's output vs the unquantised one.
#: Per-weight rounding is <= 2^-4 relative, ~2.5 % RMS; a matmul keeps that (errors are
#: independent), and two chained matmuls (mlp) compound to ~3-4 %.
FP8_MIN_ERROR, FP8_MAX_ERROR = 0.01, 0.06


def _attention_case(
    batch: int, tokens: int, group: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    q = randn(batch, KV_HEADS * group, tokens, HEAD_DIM, dtype=dtype)
    k = randn(batch + 1, KV_HEADS, CACHE_LEN, HEAD_DIM, dtype=dtype)[:batch]
    v = randn(batch + 1, KV_HEADS, CACHE_LEN, HEAD_DIM, dtype=dtype)[:batch]
    if tokens == 1:  # decode: the query sits at the last valid slot
        seq_lens = torch.tensor([1, CACHE_LEN, 20][:batch])
        positions = (seq_lens - 1)[:, None]
    else:  # prefill of right-padded prompts
        positions = torch.arange(tokens).expand(batch, tokens)
        seq_lens = torch.tensor([tokens, 1, 3][:batch])
    return q, k, v, positions, seq_lens


def test_registrations_run_on_cuda_only() -> None:
    for op, name in [
        ("attention", "flash_decoding"),
        ("rms_norm", "triton"),
        ("qkv_proj", "fp8_gemv"),
        ("o_proj", "fp8_gemv"),
        ("mlp", "fp8_gemv"),
    ]:
        impl = get(op, name)
        assert impl.runs_on("cuda") and not impl.runs_on("cpu")
        assert impl.lossy == (name == "fp8_gemv")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("batch", [1, 3])
def test_attention_matches_reference(
    dtype: torch.dtype, tokens: int, group: int, batch: int
) -> None:
    torch.manual_seed(batch * 100 + tokens * 10 + group)
    q, k, v, positions, seq_lens = _attention_case(batch, tokens, group, dtype)
    scale = HEAD_DIM**-0.5
    want = get("attention", "reference")(q, k, v, positions, seq_lens, scale=scale)
    out = get("attention", "flash_decoding")(q, k, v, positions, seq_lens, scale=scale)
    assert out.shape == q.shape
    assert_close(out, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize(("sinks", "window"), [(True, None), (False, 3), (True, 3)])
def test_attention_with_sinks_and_window_matches_reference(
    dtype: torch.dtype, tokens: int, sinks: bool, window: int | None
) -> None:
    """gpt-oss's params: the kernel at decode, sdpa's windowed mask or the reference (sinks) at
    prefill."""
    torch.manual_seed(tokens * 10 + (window or 0))
    q, k, v, positions, seq_lens = _attention_case(3, tokens, 2, dtype)
    kwargs = {"scale": HEAD_DIM**-0.5, "window": window}
    if sinks:
        kwargs["sinks"] = randn(KV_HEADS * 2, dtype=dtype, scale=2.0)
    want = get("attention", "reference")(q, k, v, positions, seq_lens, **kwargs)
    out = get("attention", "flash_decoding")(q, k, v, positions, seq_lens, **kwargs)
    assert_close(out, want)


def test_attention_under_torch_compile_calls_the_kernel_as_an_opaque_op() -> None:
    torch.manual_seed(7)
    q, k, v, positions, seq_lens = _attention_case(3, 1, 4, torch.float32)
    scale = HEAD_DIM**-0.5
    impl = get("attention", "flash_decoding")
    calls = []

    def backend(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        calls.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    compiled = torch.compile(impl.fn, backend=backend, fullgraph=True)
    out = compiled(q, k, v, positions, seq_lens, scale=scale)
    assert "kiln.decode_attention.default" in calls  # Dynamo never traced into the kernel
    assert_close(out, get("attention", "reference")(q, k, v, positions, seq_lens, scale=scale))
    inductor = torch.compile(impl.fn, fullgraph=True)(q, k, v, positions, seq_lens, scale=scale)
    assert torch.equal(inductor, out)


def test_the_opaque_op_carries_sinks_and_window() -> None:
    torch.manual_seed(8)
    q, k, v, positions, seq_lens = _attention_case(3, 1, 2, torch.float32)
    kwargs: dict[str, Any] = {"scale": HEAD_DIM**-0.5, "sinks": randn(4, dtype=torch.float32)}
    kwargs["window"] = 7
    calls = []

    def backend(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        calls.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    fn = get("attention", "flash_decoding").fn
    out = torch.compile(fn, backend=backend, fullgraph=True)(q, k, v, positions, seq_lens, **kwargs)
    assert "kiln.decode_attention.default" in calls
    assert_close(out, get("attention", "reference")(q, k, v, positions, seq_lens, **kwargs))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_matches_reference(dtype: torch.dtype, with_residual: bool) -> None:
    torch.manual_seed(with_residual)
    x = randn(2, 3, 48, dtype=dtype)
    residual = randn(2, 3, 48, dtype=dtype) if with_residual else None
    w = randn(48, dtype=dtype)
    normed, out_res = get("rms_norm", "triton")(x, residual, weight=w, eps=1e-5)
    want_normed, want_res = get("rms_norm", "reference")(x, residual, weight=w, eps=1e-5)
    assert_close(normed, want_normed)
    assert torch.equal(out_res, want_res)


def _derived_call(op: str, impl: OpImpl, base: dict[str, Any], *args: torch.Tensor) -> Any:
    assert impl.derived is not None
    params = impl.derived.fn(base)
    return impl(*args, **params)


def _qkv_params(dtype: torch.dtype) -> dict[str, Any]:
    h, hq, hkv, d = 64, 4, 2, 16
    return {
        "q_weight": randn(hq * d, h, dtype=dtype, scale=0.1),
        "k_weight": randn(hkv * d, h, dtype=dtype, scale=0.1),
        "v_weight": randn(hkv * d, h, dtype=dtype, scale=0.1),
        "q_bias": randn(hq * d, dtype=dtype),
        "k_bias": randn(hkv * d, dtype=dtype),
        "v_bias": randn(hkv * d, dtype=dtype),
        "num_heads": hq,
        "num_kv_heads": hkv,
        "head_dim": d,
    }


CASES: dict[str, Callable[[torch.dtype], tuple[dict[str, Any], Callable[[int], torch.Tensor]]]]
CASES = {
    "qkv_proj": lambda dt: (_qkv_params(dt), lambda t: randn(2, t, 64, dtype=dt)),
    "o_proj": lambda dt: (
        {"weight": randn(40, 64, dtype=dt, scale=0.1), "bias": None},
        lambda t: randn(2, 4, t, 16, dtype=dt),
    ),
    "mlp": lambda dt: (
        {
            "gate_weight": randn(96, 40, dtype=dt, scale=0.2),
            "up_weight": randn(96, 40, dtype=dt, scale=0.2),
            "down_weight": randn(40, 96, dtype=dt, scale=0.1),
        },
        lambda t: randn(2, t, 40, dtype=dt),
    ),
}


def _flat(out: Any) -> torch.Tensor:
    parts = out if isinstance(out, tuple) else (out,)
    return torch.cat([p.float().flatten() for p in parts])


@pytest.mark.parametrize("op", sorted(CASES))
@pytest.mark.parametrize("tokens", [1, 3])  # 1: the fp8 GEMV kernel; 3: dequantise + F.linear
def test_fp8_ops_error_within_documented_bound(op: str, tokens: int) -> None:
    torch.manual_seed(len(op) + tokens)
    base, make_x = CASES[op](torch.float32)
    x = make_x(tokens)
    want = get(op, "reference")(x, **base)
    out = _derived_call(op, get(op, "fp8_gemv"), base, x)
    got, ref = _flat(out), _flat(want)
    assert torch.isfinite(got).all()
    rel = float((got - ref).norm() / ref.norm())
    assert FP8_MIN_ERROR < rel < FP8_MAX_ERROR, rel
    # A lossless implementation's tolerance rejects it: the op must be marked lossy.
    with pytest.raises(AssertionError):
        assert_close(got, ref)


@pytest.mark.parametrize("op", sorted(CASES))
def test_fp8_kernel_and_dequant_paths_agree(op: str) -> None:
    """Decode rows through the kernel equal the same rows through the dequantised F.linear
    path (prefill), up to float32 summation order: both use the same quantised weights."""
    torch.manual_seed(11)
    base, make_x = CASES[op](torch.float32)
    impl = get(op, "fp8_gemv")
    assert impl.derived is not None
    params = impl.derived.fn(base)
    x = make_x(1)
    decode = impl(x, **params)
    prefill = impl(torch.cat([x, x], dim=-2), **params)
    dec, pre = (decode, prefill) if isinstance(decode, tuple) else ((decode,), (prefill,))
    for a, b in zip(dec, pre, strict=True):
        torch.testing.assert_close(a, b.narrow(-2, 0, 1), atol=1e-5, rtol=1e-5)


def test_fp8_derivations_have_distinct_names() -> None:
    names = {get(op, "fp8_gemv").derived.name for op in CASES}  # type: ignore[union-attr]
    assert names == {"fp8_rowwise_qkv", "fp8_rowwise_o_proj", "fp8_rowwise_mlp"}
