"""Decode attention and LM-head-argmax Triton kernels vs PyTorch, at Llama-3.2-1B shapes (CUDA).

Decode attention (32 query heads, 8 KV heads, head dim 64, bf16) at batch 1, 8 and 32 and
context 1085, 4096 and 16384 (cache length = context, every sequence full): each
:class:`DecodeAttentionConfig` in ``CONFIGS`` and the ``sdpa`` op implementation. Prints the
median time (ms, ``triton.testing.do_bench``), the KV bytes read per call (K and V, each
``B * Hkv * context * D * 2`` bytes) over that time in GB/s, and its fraction of the H200's
4.26 TB/s copy bandwidth (measured device-to-device copy, the project's roofline figure). Then
``lm_head_argmax`` vs ``F.linear`` + ``argmax`` over the 128256 x 2048 head at M = 1, 8, 16
(weight bytes / time).

    python benchmarks/kernels_attention.py --json /tmp/kernels_attention.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

HQ, HKV, D, HIDDEN, VOCAB = 32, 8, 64, 2048, 128256
PEAK_BYTES_PER_S = 4.26e12
BATCHES = (1, 8, 32)
CONTEXTS = (1085, 4096, 16384)


def bench_ms(fn: Callable[[], object]) -> float:
    """Median ms per call (``triton.testing.do_bench``: warm-up, L2 flush between calls)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def row(kind: str, name: str, shape: dict[str, int], ms: float, nbytes: int) -> dict[str, Any]:
    """One result: time (ms), bytes read, GB/s and the fraction of the peak bandwidth."""
    gbps = nbytes / (ms * 1e-3) / 1e9
    return {
        "kernel": kind,
        "impl": name,
        **shape,
        "ms": round(ms, 5),
        "bytes": nbytes,
        "gb_per_s": round(gbps, 1),
        "fraction_of_peak": round(gbps * 1e9 / PEAK_BYTES_PER_S, 3),
    }


def attention_rows() -> list[dict[str, Any]]:
    """Decode attention configs and sdpa at every (batch, context)."""
    from kiln.ops.attention import sdpa
    from kiln.ops.kernels.decode_attention import DecodeAttentionConfig, decode_attention

    configs = {
        "split256_block64_w4": DecodeAttentionConfig(),
        "split256_block64_w4_dot": DecodeAttentionConfig(use_dot=True),
        "split128_block32_w4": DecodeAttentionConfig(split_s=128, block_s=32),
        "split128_block64_w4_dot": DecodeAttentionConfig(split_s=128, block_s=64, use_dot=True),
        "split512_block64_w4_dot": DecodeAttentionConfig(split_s=512, block_s=64, use_dot=True),
        "split512_block128_w8_dot": DecodeAttentionConfig(
            split_s=512, block_s=128, num_warps=8, use_dot=True
        ),
        "split64_block32_w2": DecodeAttentionConfig(split_s=64, block_s=32, num_warps=2),
    }
    out = []
    for b in BATCHES:
        for ctx in CONTEXTS:
            k = torch.randn(b, HKV, ctx, D, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
            seq_lens = torch.full((b,), ctx, device="cuda", dtype=torch.int64)
            positions = (seq_lens - 1)[:, None]
            nbytes = 2 * k.numel() * k.element_size()
            shape = {"batch": b, "context": ctx}
            args = (q, k, v, seq_lens)
            for name, cfg in configs.items():

                def run(cfg: DecodeAttentionConfig = cfg, args: tuple = args) -> object:
                    return decode_attention(*args, scale=D**-0.5, config=cfg)

                out.append(row("decode_attention", name, shape, bench_ms(run), nbytes))
            sdpa_args = (q[:, :, None], k, v, positions, seq_lens)

            def run_sdpa(args: tuple = sdpa_args) -> object:
                return sdpa(*args, scale=D**-0.5)

            out.append(row("decode_attention", "sdpa", shape, bench_ms(run_sdpa), nbytes))
    return out


def lm_head_rows() -> list[dict[str, Any]]:
    """lm_head_argmax (a few block sizes) vs F.linear + argmax."""
    from kiln.ops.kernels.lm_head_argmax import lm_head_argmax

    w = torch.randn(VOCAB, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    nbytes = w.numel() * w.element_size()
    out = []
    for m in (1, 8, 16):
        x = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
        for bn, bk, warps in ((64, 128, 4), (128, 128, 4), (64, 256, 8), (32, 256, 4)):

            def run(bn: int = bn, bk: int = bk, warps: int = warps, x: torch.Tensor = x) -> object:
                return lm_head_argmax(x, w, block_n=bn, block_k=bk, num_warps=warps)

            name = f"triton_n{bn}_k{bk}_w{warps}"
            out.append(row("lm_head_argmax", name, {"m": m}, bench_ms(run), nbytes))

        def torch_ref(x: torch.Tensor = x) -> object:
            logits = F.linear(x, w).float()
            return logits, torch.argmax(logits, dim=-1)

        out.append(row("lm_head_argmax", "linear+argmax", {"m": m}, bench_ms(torch_ref), nbytes))
    return out


def main(argv: list[str] | None = None) -> int:
    """Run both benchmarks, print a table, write ``--json`` when given. Returns the exit code
    (2 without CUDA)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", type=Path, help="write the results here as a JSON list")
    parser.add_argument("--skip-lm-head", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    results = attention_rows()
    if not args.skip_lm_head:
        results += lm_head_rows()
    for r in results:
        shape = " ".join(f"{k}={r[k]}" for k in ("batch", "context", "m") if k in r)
        print(
            f"{r['kernel']:17s} {shape:24s} {r['impl']:26s} {r['ms'] * 1e3:9.1f} us "
            f"{r['gb_per_s']:8.1f} GB/s {r['fraction_of_peak']:6.1%}"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
