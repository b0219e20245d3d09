"""Coordinate descent over each kernel family's launch configuration of a ``fused_decode`` step,
judged on the **whole step** in one CUDA graph (not each family alone: under programmatic
dependent launch a kernel's cost depends on how much of the GPU its neighbours leave free).

For each family (QKV, attention, o_proj, gate_up, down, LM head) and each of its launch
dimensions (GEMV: ``block_n``, ``block_k``, ``num_warps``, ``num_stages``; attention:
``split_s``, ``block_s``, ``num_warps``, ``fused_combine``), every value is tried with the rest
held at the best so far; a change is kept when the step's median replay time drops by more than
``--min-gain``. Passes repeat until one changes nothing or ``--deadline`` seconds have gone.
Every step's logits are compared with the defaults' (rounding-level differences only).

    python3 benchmarks/fused_step_search.py --model MODEL.json --batch 1 --context 1085 \
        --deadline 240 --json out.json [--layers N] [--recipe '{"moe": "triton_gather"}']

``--layers`` builds the first N layers only (the limit counts those); ``--recipe`` binds ops
first (an MoE model's expert layers run its bound ``moe`` op inside the chain).

Prints each accepted change, then the defaults' and the best step (µs, tok/s, % of the weights +
KV limit at ``--bandwidth``) and the best configuration per family.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
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

GEMV_DIMS: dict[str, tuple[int, ...]] = {
    "block_n": (1, 2, 4, 8, 16),
    "block_k": (256, 512, 1024, 2048, 4096),
    "num_warps": (1, 2, 4, 8),
    "num_stages": (1, 2, 3),
}
ATTENTION_DIMS: dict[str, tuple[Any, ...]] = {
    "split_s": (32, 64, 128, 256),
    "block_s": (16, 32, 64),
    "num_warps": (1, 2, 4, 8),
    "fused_combine": (False, True),
}
FAMILIES = ("qkv", "attention", "o_proj", "gate_up", "down", "lm_head")


def _attr(fd: FusedDecode, family: str) -> str:
    if family == "qkv":
        return "qkv_gemv_config" if fd.model.config.qk_norm else "qkv_config"
    return {
        "attention": "attention_config",
        "o_proj": "o_config",
        "gate_up": "gate_up_config",
        "down": "down_config",
        "lm_head": "lm_config",
    }[family]


def main(args: argparse.Namespace) -> dict[str, Any]:
    config = load_config(Path(args.model))
    layers = min(args.layers or config.num_hidden_layers, config.num_hidden_layers)
    dev = torch.device(args.device)
    model = build_model(
        config, layers=layers, dtype=torch.bfloat16, device=dev, seed=0, max_batch=args.batch,
        max_seq_len=args.context + 64 * args.repeats + 64,
    )  # fmt: skip
    recipe = json.loads(args.recipe)
    if recipe:
        from kiln.workloads.models.binding import OpBinding

        model.rebind(OpBinding.from_recipe(recipe))
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
    step = decode_step_bytes_for(config, weights, args.batch, args.context, "bfloat16", layers)
    limit_us = step.total / args.bandwidth * 1e6
    tokens = torch.randint(0, config.vocab_size, (args.batch, 1), device=dev)
    saved = model.cache.state()
    fd = FusedDecode(model, json.loads(args.params))
    best = {f: getattr(fd, _attr(fd, f)) for f in FAMILIES}
    reference: list[torch.Tensor] = []
    evaluated = 0

    def measure(configs: dict[str, Any]) -> tuple[float, float]:
        nonlocal evaluated
        for family, cfg in configs.items():
            setattr(fd, _attr(fd, family), cfg)
        logits: list[torch.Tensor] = []
        try:
            us = graph_time_us(lambda: fd(tokens), args.repeats, keep=logits)
        finally:
            model.cache.restore_state(saved)
        evaluated += 1
        if not reference:
            reference.extend(logits)
        return us, (logits[0] - reference[0]).abs().max().item()

    default_us, _ = measure(best)
    best_us = default_us
    print(f"{config.name} b{args.batch} ctx {args.context}: limit {limit_us:.0f} us; defaults "
          f"{default_us:.1f} us ({limit_us / default_us:.1%})", flush=True)  # fmt: skip
    start = time.monotonic()
    accepted: list[dict[str, Any]] = []
    for pass_no in range(args.passes):
        changed = False
        for family in FAMILIES:
            dims = ATTENTION_DIMS if family == "attention" else GEMV_DIMS
            for dim, values in dims.items():
                for value in values:
                    if time.monotonic() - start > args.deadline:
                        break
                    current = best[family]
                    if getattr(current, dim) == value:
                        continue
                    try:
                        trial = replace(current, **{dim: value})
                        us, diff = measure({**best, family: trial})
                    except Exception as exc:  # a launch the kernel refuses or cannot compile
                        print(f"  {family} {dim}={value}: {type(exc).__name__}: {str(exc)[:70]}")
                        setattr(fd, _attr(fd, family), current)
                        continue
                    if us < best_us * (1 - args.min_gain) and diff <= args.max_diff:
                        best[family], best_us, changed = trial, us, True
                        accepted.append({"pass": pass_no, "family": family, dim: value, "us": us})
                        print(f"  pass {pass_no} {family} {dim}={value}: {us:.1f} us "
                              f"({limit_us / us:.1%}), diff {diff:.2g}", flush=True)  # fmt: skip
                    else:
                        setattr(fd, _attr(fd, family), current)
        if not changed or time.monotonic() - start > args.deadline:
            break
    final_us, final_diff = measure(best)  # re-measured, so the figure is not a lucky minimum
    result = {
        "model": config.name,
        "batch": args.batch,
        "context": args.context,
        "layers": layers,
        "recipe": recipe,
        "params": json.loads(args.params),
        "limit_us": limit_us,
        "defaults_us": default_us,
        "best_us": final_us,
        "best_tokens_per_s": args.batch * 1e6 / final_us,
        "best_fraction_of_limit": limit_us / final_us,
        "defaults_fraction_of_limit": limit_us / default_us,
        "max_abs_diff_vs_defaults": final_diff,
        "evaluated": evaluated,
        "seconds": time.monotonic() - start,
        "accepted": accepted,
        "best": {f: asdict(c) for f, c in best.items()},
    }
    print(f"\n{config.name} b{args.batch} ctx {args.context}: defaults {default_us:.1f} us "
          f"({limit_us / default_us:.1%}) -> best {final_us:.1f} us = "
          f"{result['best_tokens_per_s']:,.0f} tok/s ({limit_us / final_us:.1%}); "
          f"{evaluated} steps in {result['seconds']:.0f} s")  # fmt: skip
    for family, cfg in best.items():
        print(f"  {family:10s} {asdict(cfg)}")
    return result


if __name__ == "__main__":
    parser = operating_point_parser(__doc__ or "", "llama-3.2-1b.json", 30)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--deadline", type=float, default=240.0, help="seconds of search")
    parser.add_argument("--min-gain", type=float, default=0.005, help="relative")
    parser.add_argument("--max-diff", type=float, default=0.5, help="max |logits - defaults'|")
    parser.add_argument("--params", default="{}", help="fused_decode parameters to start from")
    parser.add_argument("--layers", type=int, default=0, help="layers built (0: all)")
    parser.add_argument("--recipe", default="{}", help="ops bound first, JSON")
    cli = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    data = main(cli)
    if cli.json:
        Path(cli.json).write_text(json.dumps(data, indent=2))
