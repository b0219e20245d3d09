"""Baselines side by side: transformers eager, static cache, compiled (CUDA graphs), a
gpt-fast-style model, and kiln's reference forward, on the same seeded weights and operating
point, with each one's fraction of the memory-bandwidth limit (the weights plus the KV cache of
``--batch`` sequences at ``--context`` tokens, :func:`kiln.baselines.table.bandwidth_limit`).

Usage (from the repository root):

    python benchmarks/baselines.py [--config models/llama-3.2-1b.json] [--device cuda|cpu]
        [--dtype bfloat16|float32] [--batch 1] [--context 1024] [--steps 50] [--warmup 5]
        [--layers N] [--hardware h200] [--baselines all|hf_eager,gpt_fast,...]
        [--no-compile] [--json]

``--config`` defaults to ``../shared/data/models/llama-3.2-1b.json`` (or under
``$KILN_SHARED_DATA``). On a CPU use a small config or ``--layers 2``, and ``--no-compile``
(torch.compile on a CPU takes minutes). Every row follows :mod:`kiln.baselines.harness`: prompt
prefilled, first decode step checked against kiln's reference forward, warm-up, timed steps
(:mod:`kiln.runtime.timing`). kiln's reference row is the same protocol on kiln's
``DecoderModel`` with reference ops. ``--json`` prints one JSON object instead of the table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from kiln.baselines.harness import (
    BaselineSetup,
    Runner,
    baseline_setup,
    measure,
    reference_model,
)
from kiln.baselines.result import BaselineResult
from kiln.baselines.runner import run_named
from kiln.baselines.table import bandwidth_limit
from kiln.cost_model.step_bytes import decode_step_bytes_for, weights_read_bytes
from kiln.domain.baselines import BASELINE_NAMES, parse_names
from kiln.workloads.config import DTYPE_BYTES, load_config


def shared_data() -> Path:
    """``$KILN_SHARED_DATA`` or ``../shared/data`` beside the checkout."""
    env = os.environ.get("KILN_SHARED_DATA")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data"


def kiln_reference(point: BaselineSetup) -> Runner:
    """kiln's ``DecoderModel`` with reference ops over the point's weights, as a runner."""
    model = reference_model(point, point.cache_len)

    def prefill(prompt: torch.Tensor) -> None:
        model.prefill(prompt)

    def step(token: torch.Tensor, position: int) -> torch.Tensor:
        return model.decode_step(token)

    return Runner(prefill, step, ["kiln DecoderModel, reference ops, eager"])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=None, help="a Hugging Face config.json")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=0, help="keep the first N layers (0: all)")
    p.add_argument("--hardware", default="h200", help="catalogue entry for the bandwidth limit")
    p.add_argument("--baselines", default="all", help=f"{', '.join(BASELINE_NAMES)} or all")
    p.add_argument("--no-compile", action="store_true", help="run compiled baselines eager")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the baselines and kiln's reference; print the table (or JSON). Returns 0, or 2 on
    bad arguments."""
    args = parse_args(argv)
    try:
        names = parse_names(args.baselines)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    path = args.config or shared_data() / "models" / "llama-3.2-1b.json"
    config = load_config(path)
    if args.layers:
        config = config.with_layers(args.layers)
    dtype = getattr(torch, args.dtype)
    at: dict[str, Any] = {  # the operating point, of every row
        "batch": args.batch,
        "context": args.context,
        "device": args.device,
        "dtype": dtype,
        "seed": args.seed,
        "steps": args.steps,
        "warmup": args.warmup,
    }
    point = baseline_setup(config, **at)
    weights_bytes = point.weights.nbytes()
    options: dict[str, Any] = {"compile_mode": None} if args.no_compile else {}
    results: list[BaselineResult] = []
    for name in names:
        extra = options if name in ("hf_compile", "gpt_fast") else {}
        results.append(run_named(name, config, **at, weights=point.weights, **extra))
    results.append(measure("kiln_reference", point, kiln_reference))
    weights_read = round(
        weights_read_bytes(config, weights_bytes, DTYPE_BYTES[args.dtype], args.batch)
    )
    step = decode_step_bytes_for(config, weights_read, args.batch, args.context, args.dtype)
    limit = bandwidth_limit(
        args.hardware,
        weights_read,
        args.batch,
        context=args.context,
        kv_bytes_per_token=step.kv_bytes_per_token,  # the layers kept
        kv_bytes=step.kv,  # what their attention reads (sliding/sparse layers: their span)
        kv_span=step.kv_span,
    )
    reference = results[-1].tokens_per_s
    if args.json:
        print(
            json.dumps(
                {
                    "config": str(path),
                    "device": args.device,
                    "dtype": args.dtype,
                    "batch": args.batch,
                    "context": args.context,
                    "weights_bytes": weights_bytes,
                    "bandwidth_limit_tokens_per_s": limit.tokens_per_s if limit else None,
                    "bandwidth_source": limit.source if limit else None,
                    "bandwidth_limit": limit.describe() if limit else None,
                    "kv_bytes_read": limit.step.kv if limit else None,
                    "results": [r.to_dict() for r in results],
                },
                indent=2,
            )
        )
        return 0
    table = Table(
        "",
        "tok/s",
        "ms/step",
        "p10-p90 ms",
        "vs kiln ref",
        "of bw limit",
        "max abs err",
        "",
        title=f"{config.name}: batch {args.batch}, context {args.context}, {args.dtype} on "
        f"{args.device}, {weights_bytes / 1e9:.2f} GB of weights",
        caption=f"bandwidth limit {limit.describe()}" if limit else "",
    )
    for r in results:
        frac = limit.fraction(r.tokens_per_s) if limit else None
        note = r.skipped_reason or r.error or ("" if r.correct else "INCORRECT")
        table.add_row(
            r.name,
            f"{r.tokens_per_s:,.1f}" if r.tokens_per_s else "-",
            f"{r.median_ms:.3f}" if r.median_ms else "-",
            f"{r.p10_ms:.3f}-{r.p90_ms:.3f}" if r.median_ms else "-",
            f"{r.tokens_per_s / reference:.2f}x" if reference and r.tokens_per_s else "-",
            f"{frac:.1%}" if frac is not None else "-",
            f"{r.max_abs_error:.3g}",
            note[:80],
        )
    Console(width=160).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
