"""Decode attention launch configurations at the dense families' operating points (CUDA).

For each shape (batch, query heads, KV heads, head dim, context) the kernel
:func:`kiln.ops.kernels.decode_attention.decode_attention` runs over ``--layers`` separate
caches (so, as in a decode step, no layer's K/V is in L2 when its call starts), captured in one
CUDA graph and timed over replays (median, CUDA events). Each launch configuration of the grid
(tensor-core scores or not, split length, block, warps, pipelining depth) is one row: µs per
layer, the K/V bytes read per layer over that time and the fraction of ``--bandwidth``.
PyTorch's ``scaled_dot_product_attention`` (``enable_gqa``) on the same caches is a row too.

    python3 benchmarks/attention_sweep.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
from fused_decode_profile import graph_time_us  # benchmarks/ is on sys.path when run as a script

SHAPES = {
    # name: (batch, Hq, Hkv, D, context)
    "llama-1b b1 1k": (1, 32, 8, 64, 1085),
    "llama-1b b1 7k": (1, 32, 8, 64, 7084),
    "llama-1b b30 1k": (30, 32, 8, 64, 1085),
    "qwen3-0.6b b1 1k": (1, 16, 8, 128, 1085),
    "8b b1 1.5k": (1, 32, 8, 128, 1476),
    "8b b30 1k": (30, 32, 8, 128, 1085),
}


def grid() -> list[dict[str, Any]]:
    """The launch configurations tried at every shape."""
    out: list[dict[str, Any]] = []
    plain = {32: (16, 32), 64: (16, 32, 64), 128: (32, 64), 256: (32, 64)}
    dot = {32: (32,), 64: (32, 64), 128: (32, 64), 256: (32, 64), 512: (64,)}
    for use_dot, splits in ((False, plain), (True, dot)):
        for split, blocks in splits.items():
            for block in blocks:
                out.append({"use_dot": use_dot, "split_s": split, "block_s": block, "num_warps": 4})
    for split in (64, 128):
        for warps, stages in ((2, None), (8, None), (4, 2), (4, 1)):
            out.append(
                {"use_dot": True, "split_s": split, "block_s": 64, "num_warps": warps,
                 "num_stages": stages}
            )  # fmt: skip
    return out


def sweep_shape(name: str, shape: tuple[int, ...], args: argparse.Namespace) -> list[dict]:
    """Every configuration of :func:`grid` and SDPA at one shape."""
    import torch.nn.functional as F

    from kiln.ops.kernels.decode_attention import (
        DecodeAttentionConfig,
        decode_attention,
        decode_attention_reference,
    )

    b, hq, hkv, d, ctx = shape
    dev, layers = torch.device(args.device), args.layers
    ks = [torch.randn(b, hkv, ctx, d, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
    vs = [torch.randn(b, hkv, ctx, d, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
    qs = [torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
    lens = torch.full((b,), ctx, device=dev, dtype=torch.int64)
    nbytes = 2 * b * hkv * ctx * d * 2
    scale = d**-0.5
    want = decode_attention_reference(qs[0], ks[0], vs[0], lens, scale=scale).float()
    rows: list[dict] = []

    def record(label: str, us_all: float, err: float) -> None:
        us = us_all / layers
        frac = nbytes / (us * 1e-6) / args.bandwidth
        rows.append({"shape": name, "config": label, "us_per_layer": us,
                     "fraction_of_bandwidth": frac, "max_abs_err": err})  # fmt: skip
        print(f"{name:18s} {label:52s} {us:8.2f} us/layer {frac:6.1%}  err {err:.3g}")

    def attention(config: Any) -> None:
        for i in range(layers):
            decode_attention(qs[i], ks[i], vs[i], lens, scale=scale, config=config)

    for cfg in grid():
        label = ",".join(f"{k}={v}" for k, v in cfg.items())
        try:
            config = DecodeAttentionConfig(**cfg)
            got = decode_attention(qs[0], ks[0], vs[0], lens, scale=scale, config=config)
            err = (got.float() - want).abs().max().item()
            record(label, graph_time_us(lambda c=config: attention(c), args.repeats), err)
        except Exception as exc:  # a configuration the kernel refuses or cannot compile
            print(f"{name:18s} {label:52s} {type(exc).__name__}: {str(exc)[:80]}")
    q4 = [q[:, :, None] for q in qs]

    def sdpa() -> None:
        for i in range(layers):
            F.scaled_dot_product_attention(q4[i], ks[i], vs[i], scale=scale, enable_gqa=True)

    got = F.scaled_dot_product_attention(q4[0], ks[0], vs[0], scale=scale, enable_gqa=True)
    record("torch sdpa (enable_gqa)", graph_time_us(sdpa, args.repeats),
           (got[:, :, 0].float() - want).abs().max().item())  # fmt: skip
    return rows


def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for name, shape in SHAPES.items():
        if args.shapes and not any(s in name for s in args.shapes.split(",")):
            continue
        rows += sweep_shape(name, shape, args)
        torch.cuda.empty_cache()
    print("\n=== best per shape ===")
    for name in dict.fromkeys(r["shape"] for r in rows):
        mine = sorted((r for r in rows if r["shape"] == name), key=lambda r: r["us_per_layer"])
        sdpa = [r for r in mine if r["config"].startswith("torch")]
        for r in mine[:3] + sdpa:
            print(f"{name:18s} {r['us_per_layer']:8.2f} us {r['fraction_of_bandwidth']:6.1%}  "
                  f"{r['config']}")  # fmt: skip
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--bandwidth", type=float, default=4.26e12, help="bytes/s")
    parser.add_argument("--shapes", default="", help="comma-separated name filters")
    parser.add_argument("--json", default="")
    a = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    result = main(a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
