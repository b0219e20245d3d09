"""Where an MoE model's decode step goes, kernel by kernel, inside a CUDA graph.

Builds ``--layers`` layers of an MoE config (``--model``, default Qwen3-30B-A3B; seeded random
bf16 weights) on one CUDA device, prefills ``--batch`` sequences to ``--context`` tokens, then
for each variant (``--variants``: ``recipe`` JSON plus whether the ``fused_decode`` chain runs
it) captures one decode step as a CUDA graph and reports:

- the median replay time (CUDA events, :func:`fused_decode_profile.graph_time_us`) against the
  bandwidth limit of the bytes the step reads (the experts its routing is expected to read,
  :func:`kiln.cost_model.step_bytes.weights_read_bytes`, plus the KV cache);
- the largest difference of its logits from the first variant's (same replays, same cache);
- the kernels of ``--profile-replays`` replays under ``torch.profiler`` (CUPTI sees the kernels
  a graph launches), grouped by name: launches and GPU µs per step, the top ``--top``.

    python3 benchmarks/moe_step_profile.py --layers 8 --batch 1 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fused_decode_profile import graph_time_us, operating_point_parser

from kiln.cost_model.step_bytes import (
    decode_step_bytes_for,
    weights_read_bytes,
)
from kiln.runtime.fused_decode import FusedDecode
from kiln.workloads.config import load_config
from kiln.workloads.models import build_model

VARIANTS: list[dict[str, Any]] = [
    {"name": "reference", "recipe": {}, "fused": False},
    {"name": "moe=triton_gather", "recipe": {"moe": "triton_gather"}, "fused": False},
    {"name": "fused_decode", "recipe": {}, "fused": True},
    {"name": "fused_decode+triton_gather", "recipe": {"moe": "triton_gather"}, "fused": True},
]


def kernel_table(step: Any, replays: int) -> list[dict[str, Any]]:
    """Kernels of ``replays`` replays of the captured ``step`` by name: launches and µs per step."""
    from torch.profiler import ProfilerActivity, profile

    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0:
            row = by_name[ev.name[:90]]
            row[0] += 1
            row[1] += ev.device_time
    rows = [
        {"kernel": n, "launches": c / replays, "us": t / replays} for n, (c, t) in by_name.items()
    ]
    return sorted(rows, key=lambda r: -r["us"])


def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    config = load_config(Path(args.model))
    layers = min(args.layers or config.num_hidden_layers, config.num_hidden_layers)
    dev = torch.device(args.device)
    model = build_model(
        config,
        layers=layers,
        dtype=torch.bfloat16,
        device=dev,
        seed=0,
        max_batch=args.batch,
        max_seq_len=args.context + 64,
    )
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, config.vocab_size, (args.batch, args.context), generator=gen)
    model.prefill(prompt.to(dev))
    held = sum(
        {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for _, t in model.weights.items()
        }.values()
    )
    weights = weights_read_bytes(config, held, 2, args.batch, layers=layers)
    step_bytes = decode_step_bytes_for(
        config, weights, args.batch, args.context, "bfloat16", layers
    )
    limit_us = step_bytes.total / args.bandwidth * 1e6
    print(
        f"{config.name} ({layers} of {config.num_hidden_layers} layers): batch {args.batch}, "
        f"context {args.context}; reads {step_bytes.total / 1e9:.3f} GB, limit {limit_us:.0f} us"
    )
    tokens = torch.randint(0, config.vocab_size, (args.batch, 1), device=dev)
    saved = model.cache.state()
    out = []
    first: list[torch.Tensor] = []
    for v in json.loads(args.variants) if args.variants else VARIANTS:
        from kiln.workloads.models.binding import OpBinding

        try:
            model.rebind(OpBinding.from_recipe(v["recipe"]))
            fd = FusedDecode(model, v.get("params", {})) if v["fused"] else None

            def step(fd: FusedDecode | None = fd) -> torch.Tensor:
                return fd(tokens) if fd is not None else model.decode_step(tokens)

            logits: list[torch.Tensor] = []
            step_us = graph_time_us(step, args.repeats, keep=logits)
            model.cache.restore_state(saved)
            first = first or logits
            kernels = kernel_table(step, args.profile_replays)
            model.cache.restore_state(saved)
        except Exception as err:
            print(f"\n[{v['name']}] failed: {type(err).__name__}: {str(err)[:300]}")
            out.append({**v, "error": f"{type(err).__name__}: {err}"})
            model.cache.restore_state(saved)
            continue
        row = {
            **v,
            "step_us": step_us,
            "limit_us": limit_us,
            "fraction_of_limit": limit_us / step_us,
            "per_layer_us": step_us / layers,
            "kernels_per_step": sum(k["launches"] for k in kernels),
            "kernel_us_per_step": sum(k["us"] for k in kernels),
            "kernels": kernels[: args.top],
            "max_abs_diff_vs_first": (logits[0] - first[0]).abs().max().item(),
        }
        out.append(row)
        print(
            f"\n[{v['name']}] step {step_us:.0f} us ({row['fraction_of_limit']:.1%} of limit, "
            f"{row['per_layer_us']:.1f} us/layer); {row['kernels_per_step']:.0f} kernels, "
            f"{row['kernel_us_per_step']:.0f} us of kernel time per step; max |logits - first "
            f"variant's| {row['max_abs_diff_vs_first']:.3g}"
        )
        for k in kernels[: args.top]:
            print(f"  {k['us']:8.1f} us {k['launches']:6.0f}x  {k['kernel']}")
    print("\n=== step, best first ===")
    for r in sorted((r for r in out if "step_us" in r), key=lambda r: r["step_us"]):
        print(
            f"{r['step_us']:8.0f} us {r['fraction_of_limit']:6.1%} {r['kernels_per_step']:6.0f} "
            f"kernels {r['kernel_us_per_step']:7.0f} us busy  {r['name']}"
        )
    return out


if __name__ == "__main__":
    p = operating_point_parser(__doc__ or "", "qwen3-30b-a3b.json", 50)
    p.add_argument("--layers", type=int, default=8, help="layers built (0: all)")
    p.add_argument("--profile-replays", type=int, default=10)
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--variants", default="", help="JSON list of {name, recipe, fused, params}")
    a = p.parse_args()
    rows = main(a)
    if a.json:
        Path(a.json).write_text(json.dumps({"command": sys.argv, "rows": rows}, indent=1))
