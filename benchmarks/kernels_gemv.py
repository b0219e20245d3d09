"""How close the GEMV kernels get to the H200's memory bandwidth at Llama-3.2-1B decode shapes.

For each shape (qkv, o_proj + residual, gate_up + SiLU·mul, down, lm_head, the norm-fused
qkv and gate_up, and norm + QKV + RoPE + cache write) and each config of a small grid, it
captures a CUDA graph of ``ROUNDS`` calls that rotate over enough weight copies that L2 (60 MB)
never holds the next weight, times the replay with ``triton.testing.do_bench`` (median, ms) and
reports per call: µs, GB/s of bytes moved (weights + activations + outputs) and the fraction of
4.26 TB/s (measured H200 copy bandwidth). torch (``F.linear`` and the same elementwise epilogue)
runs the same way as the baseline (for the RoPE row: norm + linear only, without the rotation and
the cache write). A final table lists the best config per shape.

    python benchmarks/kernels_gemv.py                       # M = 1, full grid
    python benchmarks/kernels_gemv.py --m 1 4 16 --quick --json gemv.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

PEAK_BYTES_PER_S = 4.26e12  # measured device-to-device copy bandwidth of the H200 (brief)
L2_BYTES = 60 * 2**20
ROUNDS = 16  # calls per captured graph
H, HQ, HKV, D, INTER, VOCAB, EPS = 2048, 32, 8, 64, 8192, 128256, 1e-5
BF16 = torch.bfloat16

if TYPE_CHECKING:
    from kiln.ops.kernels.gemv import GemvConfig

# (name, rows N of the weight, K, kind)
SHAPES = [
    ("qkv", (HQ + 2 * HKV) * D, H, "gemv"),
    ("o_proj+res", H, HQ * D, "gemv_res"),
    ("gate_up+silu", 2 * INTER, H, "silu"),
    ("down", H, INTER, "gemv"),
    ("lm_head", VOCAB, H, "lm_head"),
    ("norm+qkv", (HQ + 2 * HKV) * D, H, "norm"),
    ("norm+gate_up+silu", 2 * INTER, H, "norm_silu"),
    ("norm+qkv+rope+cache", (HQ + 2 * HKV) * D, H, "qkv_rope"),
]


def grid(kind: str, k: int, quick: bool, full: bool = False) -> list[dict[str, int]]:
    """Configs to try: block_n x block_k x num_warps (x split_k for long K; x num_stages 1..3
    with ``full``; ``quick``: block_k 1024, 4 warps only)."""
    block_ns = [2, 4, 8] if kind == "qkv_rope" else [2, 4, 8, 16]
    block_ks = [512, 1024, 2048] if not quick else [1024]
    warps = [4, 8] if not quick else [4]
    splits = [1, 2, 4] if k >= 4096 and kind not in ("qkv_rope",) else [1]
    stages = [1, 2, 3] if full else [1]
    out = []
    for bn, bk, w, s, st in itertools.product(block_ns, block_ks, warps, splits, stages):
        pairs = 2 if kind in ("silu", "norm_silu", "qkv_rope") else 1
        if bn * bk * pairs > 4 * 8192 or bk > k:
            continue  # far past the register budget
        out.append({"block_n": bn, "block_k": bk, "split_k": s, "num_warps": w, "num_stages": st})
    return out


def bench_graph(calls: list[Callable[[], object]]) -> float:
    """Median ms per call of a CUDA graph replaying ``ROUNDS`` calls cycling over ``calls``."""
    for fn in calls:  # compile / warm up outside the capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(ROUNDS):
            calls[i % len(calls)]()
    import triton.testing

    ms = triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median")
    return float(ms) / ROUNDS


def make_calls(
    kind: str, n: int, k: int, m: int, cfg: GemvConfig | None
) -> tuple[list[Callable[[], object]], int]:
    """The rotated calls for one (shape, config) (``cfg`` None: the torch baseline) and the
    bytes one call moves."""
    from kiln.ops.kernels.gemv import gemv
    from kiln.ops.kernels.norm_gemv import gate_up_silu, rms_norm_gemv
    from kiln.ops.kernels.qkv_rope import rms_norm_qkv_rope

    w_bytes = n * k * 2
    copies = max(2, math.ceil(3 * L2_BYTES / w_bytes))
    weights = [torch.randn(n, k, device="cuda").to(BF16) * k**-0.5 for _ in range(copies)]
    x = torch.randn(m, k, device="cuda").to(BF16)
    nw = torch.ones(k, device="cuda", dtype=BF16)
    res = torch.randn(m, n, device="cuda").to(BF16)
    out_n = n // 2 if "silu" in kind else n
    moved = w_bytes + x.numel() * 2 + m * out_n * (4 if kind == "lm_head" else 2)
    if kind == "qkv_rope":
        freq = torch.rand(D // 2, device="cuda")
        angles = torch.arange(4096, device="cuda").float()[:, None] * freq
        cos, sin = angles.cos(), angles.sin()
        pos = torch.arange(m, device="cuda")
        kc = torch.zeros(m, HKV, 4096, D, device="cuda", dtype=BF16)
        vc = torch.zeros_like(kc)
    calls: list[Callable[[], object]] = []
    for w in weights:
        if cfg is None:  # torch: F.linear and the same epilogue in eager ops
            if kind in ("norm", "norm_silu", "qkv_rope"):

                def fn(w: torch.Tensor = w) -> object:
                    h = F.linear(F.rms_norm(x, (k,), nw, EPS), w)
                    if kind == "norm_silu":
                        g, u = h.chunk(2, dim=-1)
                        return F.silu(g) * u
                    return h

            elif kind == "silu":

                def fn(w: torch.Tensor = w) -> object:
                    g, u = F.linear(x, w).chunk(2, dim=-1)
                    return F.silu(g) * u

            else:

                def fn(w: torch.Tensor = w) -> object:
                    y = F.linear(x, w)
                    return y + res if kind == "gemv_res" else y.float() if kind == "lm_head" else y

        elif kind == "qkv_rope":

            def fn(w: torch.Tensor = w) -> object:
                return rms_norm_qkv_rope(
                    x,
                    nw,
                    EPS,
                    w,
                    cos,
                    sin,
                    pos,
                    kc,
                    vc,
                    num_heads=HQ,
                    num_kv_heads=HKV,
                    head_dim=D,
                    config=cfg,
                )

        elif kind in ("norm", "norm_silu"):

            def fn(w: torch.Tensor = w) -> object:
                act = "silu_mul" if kind == "norm_silu" else None
                return rms_norm_gemv(x, nw, EPS, w, activation=act, config=cfg)

        elif kind == "silu":

            def fn(w: torch.Tensor = w) -> object:
                return gate_up_silu(x, w, config=cfg)

        else:

            def fn(w: torch.Tensor = w) -> object:
                return gemv(
                    x,
                    w,
                    residual=res if kind == "gemv_res" else None,
                    out_dtype=torch.float32 if kind == "lm_head" else None,
                    config=cfg,
                )

        calls.append(fn)
    return calls, moved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--m", type=int, nargs="+", default=[1], help="batch rows (<= 16)")
    parser.add_argument("--only", nargs="*", default=None, help="shape names to run")
    parser.add_argument("--quick", action="store_true", help="a small config grid")
    parser.add_argument("--full", action="store_true", help="also sweep num_stages 1..3")
    parser.add_argument("--json", type=Path, default=None, help="write every number here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kernels_gemv needs a CUDA device")
    from kiln.ops.kernels.gemv import GemvConfig as Config

    rows: list[dict[str, object]] = []
    for m, (name, n, k, kind) in itertools.product(args.m, SHAPES):
        if args.only and name not in args.only:
            continue
        for cfg_fields in [None, *grid(kind, k, args.quick, args.full)]:
            cfg = None if cfg_fields is None else Config(**cfg_fields)
            try:
                calls, moved = make_calls(kind, n, k, m, cfg)
                ms = bench_graph(calls)
            except Exception as exc:  # a config that fails to compile: report and go on
                print(f"{name:22s} M={m:<2d} {cfg_fields}: FAILED {type(exc).__name__}: {exc}")
                continue
            gbs = moved / (ms * 1e-3) / 1e9
            row = {
                "shape": name,
                "m": m,
                "n": n,
                "k": k,
                "impl": "torch" if cfg is None else "triton",
                "config": None if cfg is None else asdict(cfg),
                "us": ms * 1e3,
                "bytes": moved,
                "gb_per_s": gbs,
                "fraction_of_peak": gbs * 1e9 / PEAK_BYTES_PER_S,
            }
            rows.append(row)
            label = "torch" if cfg is None else ",".join(str(v) for v in asdict(cfg).values())
            print(
                f"{name:22s} M={m:<2d} {label:22s} {ms * 1e3:8.2f} us {gbs:8.0f} GB/s "
                f"{row['fraction_of_peak']:6.1%}"
            )
            del calls
            torch.cuda.empty_cache()
    print("\nbest per shape (config = block_n,block_k,split_k,num_warps,num_stages):")
    print(f"{'shape':22s} {'M':>3s} {'torch us':>9s} {'best us':>9s} {'of peak':>8s}  config")
    for (name, m), group in itertools.groupby(rows, key=lambda r: (r["shape"], r["m"])):
        group_rows = list(group)
        torch_us = next((r["us"] for r in group_rows if r["impl"] == "torch"), float("nan"))
        tri = [r for r in group_rows if r["impl"] == "triton"]
        if not tri:
            continue
        best = min(tri, key=lambda r: float(r["us"]))  # type: ignore[arg-type]
        cfg_d = best["config"]
        assert isinstance(cfg_d, dict)
        print(
            f"{name!s:22s} {m!s:>3s} {torch_us:9.2f} {best['us']:9.2f} "
            f"{best['fraction_of_peak']:8.1%}  {','.join(str(v) for v in cfg_d.values())}"
        )
    if args.json:
        args.json.write_text(
            json.dumps({"peak_bytes_per_s": PEAK_BYTES_PER_S, "rows": rows}, indent=1)
        )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
