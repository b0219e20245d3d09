"""Which ``moe`` implementation wins, by tokens per step and expert-load skew.

One MoE layer of a real config (``--config``, default Qwen3-30B-A3B from
``../shared/data/models``) with seeded random weights whose router is biased to the Zipf skew s
(:mod:`kiln.workloads.models.routing`); each implementation runs on the same router inputs (the
post-norm hidden states of random prompts are near unit RMS: unit normal here). Prints, per s and
token count N, the distinct experts hit and each implementation's time per call (ms; CUDA events
on GPU, ``perf_counter`` on CPU) with the winner.

    python benchmarks/moe_ops.py --device cuda --dtype bfloat16 --skews 0 0.4 1.2
    python benchmarks/moe_ops.py --hidden 256 --tokens 1 8 64   # CPU, shrunk hidden size
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kiln.ops.moe import route
from kiln.ops.registry import get, implementations
from kiln.workloads.config import parse_config
from kiln.workloads.models import build_model

MODELS = Path(__file__).resolve().parents[2] / "shared" / "data" / "models"


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Mean ms per call after 3 warm-up calls."""
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        torch.cuda.synchronize()
        return float(start.elapsed_time(end)) / repeats
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t) * 1e3 / repeats


def main() -> None:
    """Print the table (see the module docs)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default=str(MODELS / "qwen3-30b-a3b.json"))
    parser.add_argument("--hidden", type=int, default=0, help="shrink hidden size (0: keep)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--skews", type=float, nargs="+", default=[0.0, 0.4, 1.2])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    raw = json.loads(Path(args.config).read_text())
    if args.hidden:
        raw.update(hidden_size=args.hidden, vocab_size=1024, head_dim=32, num_attention_heads=8)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    impls = implementations("moe")
    for s in args.skews:
        cfg = parse_config(raw, Path(args.config).stem).with_expert_skew(s)
        model = build_model(cfg, layers=1, dtype=dtype, device=device, max_seq_len=8)
        params = model.slots.layers[0].ffn.params
        print(f"{cfg.name}, one MoE layer, {args.dtype} on {device}, skew s={s}")
        for n in args.tokens:
            x = torch.randn(1, n, cfg.hidden_size, device=device).to(dtype)
            _, experts = route(
                x.view(n, -1),
                params["router_weight"],
                top_k=params["top_k"],
                norm_topk_prob=params["norm_topk_prob"],
                router_bias=params["router_bias"],
            )
            ms = {
                i: timed(lambda i=i, x=x, p=params: get("moe", i).fn(x, **p), device, args.repeats)
                for i in impls
            }
            cells = "  ".join(f"{i} {t:8.3f}" for i, t in ms.items())
            hit = int(torch.unique(experts).numel())
            print(f"  N={n:4d} experts hit {hit:4d}  {cells}  -> {min(ms, key=ms.__getitem__)}")


if __name__ == "__main__":
    main()
