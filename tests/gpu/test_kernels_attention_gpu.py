"""The decode-attention, add+RMSNorm, LM-head-argmax and fp8 GEMV Triton kernels compiled on
CUDA, at Llama-3.2-1B sizes (hidden 2048, 32 query / 8 KV heads, head dim 64, vocab 128256,
bf16), vs their references; plus CUDA-graph capture of decode attention. Skipped without CUDA.

Run on a GPU host: ``pytest --noconftest tests/gpu/test_kernels_attention_gpu.py``. Do not set
``TRITON_INTERPRET`` here (the CPU kernel tests set it at import; run this file in its own
process).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
        reason="TRITON_INTERPRET is set in this process: run the GPU kernel tests on their own",
    ),
]

DEV = "cuda"
HIDDEN, HQ, HKV, D, VOCAB = 2048, 32, 8, 64, 128256
BF16_TOL = 2e-2


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = BF16_TOL) -> None:
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("batch", [1, 8, 32])
@pytest.mark.parametrize("cache_len", [1085, 4096])
@pytest.mark.parametrize("use_dot", [None, True, False])
def test_decode_attention(batch: int, cache_len: int, use_dot: bool | None) -> None:
    from kiln.ops.kernels.decode_attention import (
        DecodeAttentionConfig,
        decode_attention,
        decode_attention_reference,
    )

    torch.manual_seed(batch)
    buf_k = torch.randn(batch + 2, HKV, cache_len, D, device=DEV, dtype=torch.bfloat16)
    buf_v = torch.randn_like(buf_k)
    k, v = buf_k[:batch], buf_v[:batch]
    q = torch.randn(batch, HQ, D, device=DEV, dtype=torch.bfloat16)
    seq_lens = torch.randint(1, cache_len + 1, (batch,), device=DEV)
    seq_lens[0] = cache_len
    if batch > 1:
        seq_lens[1] = 1
    cfg = DecodeAttentionConfig(use_dot=use_dot)
    out = decode_attention(q, k, v, seq_lens, scale=D**-0.5, config=cfg)
    _close(out, decode_attention_reference(q, k, v, seq_lens, scale=D**-0.5))


def test_decode_attention_captures_in_a_cuda_graph() -> None:
    """Captured once at one length, replayed at others: the split count depends on the cache
    length only, so the graph stays right as sequences grow."""
    from kiln.ops.kernels.decode_attention import decode_attention, decode_attention_reference

    torch.manual_seed(0)
    k = torch.randn(4, HKV, 2048, D, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(4, HQ, D, device=DEV, dtype=torch.bfloat16)
    seq_lens = torch.tensor([5, 100, 1000, 2048], device=DEV)
    decode_attention(q, k, v, seq_lens, scale=0.125)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, seq_lens, scale=0.125)
    for lens in ([1, 2, 3, 4], [2048, 1500, 257, 256]):
        seq_lens.copy_(torch.tensor(lens))
        graph.replay()
        _close(out, decode_attention_reference(q, k, v, seq_lens, scale=0.125))


def test_flash_decoding_op_matches_reference() -> None:
    import kiln.ops  # noqa: F401
    from kiln.ops import attention_triton  # noqa: F401
    from kiln.ops.registry import get

    torch.manual_seed(1)
    b, s = 3, 1085
    k = torch.randn(b, HKV, s, D, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    seq_lens = torch.tensor([1, 600, s], device=DEV)
    for t, positions in (
        (1, (seq_lens - 1)[:, None]),
        (7, torch.arange(7, device=DEV).expand(b, 7)),
    ):
        q = torch.randn(b, HQ, t, D, device=DEV, dtype=torch.bfloat16)
        lens = seq_lens if t == 1 else torch.tensor([7, 3, 1], device=DEV)
        want = get("attention", "reference")(q, k, v, positions, lens, scale=0.125)
        _close(get("attention", "flash_decoding")(q, k, v, positions, lens, scale=0.125), want)


@pytest.mark.parametrize("rows", [1, 8, 32])
def test_add_rms_norm(rows: int) -> None:
    from kiln.ops.kernels.add_rms_norm import add_rms_norm, add_rms_norm_reference

    x = torch.randn(rows, HIDDEN, device=DEV, dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.randn(HIDDEN, device=DEV, dtype=torch.bfloat16)
    normed, s = add_rms_norm(x, r, w, 1e-5)
    want_normed, want_s = add_rms_norm_reference(x, r, w, 1e-5)
    assert torch.equal(s, want_s)
    _close(normed, want_normed)


@pytest.mark.parametrize("rows", [1, 4, 16])
def test_lm_head_argmax(rows: int) -> None:
    from kiln.ops.kernels.lm_head_argmax import lm_head_argmax, lm_head_argmax_reference

    torch.manual_seed(rows)
    x = torch.randn(rows, HIDDEN, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(VOCAB, HIDDEN, device=DEV, dtype=torch.bfloat16) * 0.02
    logits, tokens = lm_head_argmax(x, w)
    want_logits, want_tokens = lm_head_argmax_reference(x, w)
    _close(logits, want_logits)
    assert torch.equal(tokens, torch.argmax(logits, dim=-1))
    # Different float32 summation order can flip a near-tie after bf16 rounding, rarely.
    assert (tokens == want_tokens).float().mean() >= 0.9


@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("shape", [(3072, HIDDEN), (HIDDEN, 8192), (16384, HIDDEN)])
def test_fp8_gemv(rows: int, shape: tuple[int, int]) -> None:
    from kiln.ops.kernels.fp8_gemv import fp8_gemv, fp8_gemv_reference, quantize_fp8_rowwise

    torch.manual_seed(rows)
    n, k = shape
    x = torch.randn(rows, k, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02
    w8, scale = quantize_fp8_rowwise(w)
    out = fp8_gemv(x, w8, scale)
    _close(out, fp8_gemv_reference(x, w8, scale))
    exact = F.linear(x.float(), w.float())
    rel = float((out.float() - exact).norm() / exact.norm())
    assert 0.005 < rel < 0.06, rel


@pytest.mark.parametrize("mode", ["default", "max-autotune-no-cudagraphs"])
def test_flash_decoding_under_torch_compile(mode: str) -> None:
    import kiln.ops  # noqa: F401
    from kiln.ops.registry import get

    torch.manual_seed(3)
    b, s = 4, 1085
    q = torch.randn(b, HQ, 1, D, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(b, HKV, s, D, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(b, HKV, s, D, device=DEV, dtype=torch.bfloat16)
    seq_lens = torch.tensor([1, 200, 1085, 700], device=DEV)
    positions = (seq_lens - 1)[:, None]
    impl = get("attention", "flash_decoding")
    eager = impl(q, k, v, positions, seq_lens, scale=D**-0.5)
    compiled = torch.compile(impl.fn, mode=mode, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, positions, seq_lens, scale=D**-0.5), eager)
