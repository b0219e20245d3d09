"""Decode tokens/s of hand-picked candidates on one persistent engine, against the bandwidth limit.

Starts one engine (Llama-3.2-1B from ../shared/data or ``$KILN_SHARED_DATA``, the Azure
conversation trace's context, ``--batch`` sequences, ``--tier``), measures the reference and the
library's main moves (a CUDA graph over the reference, the fused PyTorch ops, the Triton op
kernels, the ``fused_decode`` transform over a small grid of its kernel parameters) exactly as the
engine pool measures experiments (checked against the reference, timed, a timed step verified),
and prints decode tokens/s with the fraction of the memory-bandwidth limit: the engine's weights
bytes (including the LM head) read once per step plus the KV cache of every sequence at the
measured batch and context over the layers held
(:func:`kiln.cost_model.step_bytes.decode_step_bytes_for`: sliding and sparse layers read only
what they attend), at ``--bandwidth`` (default 4.26 TB/s,
the H200's measured device-to-device copy rate, tool library H200 notes). On CPU only the
candidates that run there are measured.

    python3 benchmarks/decode_candidates.py --device cuda:0 --batch 1 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from engine_hot_reload import MODEL, TRACE, request_for, workload

from kiln.cost_model.step_bytes import (
    DecodeStepBytes,
    decode_step_bytes_for,
    weights_read_bytes,
)
from kiln.domain.candidate import Candidate, Transform
from kiln.engine_pool.process import EngineProcess
from kiln.engine_pool.settings import EngineSettings
from kiln.runtime.spec import EngineSpec
from kiln.workloads.config import DTYPE_BYTES

FUSED_OPS = {
    "attention": "sdpa",
    "qkv_proj": "fused",
    "mlp": "fused_gate_up",
    "rms_norm": "fused_residual",
    "rope": "cos_sin_cache",
}
TRITON_OPS = {
    "attention": "flash_decoding",
    "qkv_proj": "triton_gemv",
    "o_proj": "triton_gemv",
    "mlp": "triton_gate_up",
    "rms_norm": "triton",
    "rope": "cos_sin_cache",
    "lm_head": "triton_gemv",
}
FUSED_DECODE_GRID: list[dict[str, str]] = [
    {},
    {"num_warps": "8"},
    {"block_k": "1024"},
    {"block_k": "256", "num_warps": "2"},
    {"o_block_n": "8", "down_block_n": "8", "gate_up_block_n": "16"},
    {"down_split_k": "2"},
    {"lm_block_n": "64"},
    {"split_s": "128"},
    {"pdl": "0"},  # no programmatic dependent launch (the default is 2)
]


def candidates(
    device: str, grid: list[dict[str, str]] | None = None, ops: bool = True
) -> list[tuple[str, Candidate]]:
    """The candidates to measure, reference first: with ``ops``, the op-level moves; then
    ``fused_decode`` over ``grid`` (default :data:`FUSED_DECODE_GRID`)."""
    out = [("reference", Candidate())]
    if not device.startswith("cuda"):
        return [*out, ("fused ops", Candidate.make(FUSED_OPS))]
    graph = Transform("cuda_graph")
    if ops:
        out += [
            ("cuda_graph", Candidate.make({}, [graph])),
            ("fused ops + cuda_graph", Candidate.make(FUSED_OPS, [graph])),
            ("triton ops + cuda_graph", Candidate.make(TRITON_OPS, [graph])),
            ("fused_decode (no graph)", Candidate.make({}, [Transform("fused_decode")])),
        ]
    for params in FUSED_DECODE_GRID if grid is None else grid:
        label = "fused_decode + cuda_graph" + (
            " " + ",".join(f"{k}={v}" for k, v in params.items()) if params else ""
        )
        out.append((label, Candidate.make({}, [Transform.of("fused_decode", **params), graph])))
    return out


def step_bytes(spec: EngineSpec, weights: int, batch: int = 0, context: int = 0) -> DecodeStepBytes:
    """What one decode step of ``spec``'s engine reads: the ``weights`` bytes it holds that a
    step reads (:func:`~kiln.cost_model.step_bytes.weights_read_bytes`) plus the KV cache
    (``spec.dtype``, ``spec.layers`` held) its attention reads for ``batch`` sequences at
    ``context`` tokens (0: the spec's; a measurement says where it was measured; sliding and
    sparse layers only what they attend:
    :func:`~kiln.cost_model.step_bytes.decode_step_bytes_for`)."""
    config, batch = spec.model_config(), batch or spec.batch_size
    size = DTYPE_BYTES.get(spec.dtype, 2)
    read = weights_read_bytes(config, weights, size, batch, layers=spec.layers)
    context = context or spec.context_len
    return decode_step_bytes_for(config, read, batch, context, spec.dtype, spec.layers)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    settings = EngineSettings(**({"device": args.device} if args.device else {}))
    spec = EngineSpec.from_workload(workload("", args.batch), args.tier, settings.limits())
    print(
        f"{spec.model_name}, {args.tier} tier: {spec.layers}/{spec.total_layers} layers, "
        f"{spec.dtype} on {spec.device}; batch {spec.batch_size}, context {spec.context_len}"
    )
    engine = EngineProcess(spec, f"decode-{args.tier}", ready_timeout_s=1800)
    engine.start()
    rows: list[dict[str, Any]] = []
    try:
        await engine.wait_ready()
        weights = int(engine.info.get("memory", {}).get("weights_bytes", 0))
        at = step_bytes(spec, weights)
        print(
            f"weights {at.weights / 1e9:.3f} GB + KV {at.kv / 1e9:.3f} GB (batch {at.batch}, "
            f"context {at.context:,}) -> bandwidth limit {at.total / args.bandwidth * 1e3:.3f} "
            f"ms/step = {at.limit_tokens_per_s(args.bandwidth):,.0f} tokens/s at "
            f"{args.bandwidth / 1e12:.2f} TB/s"
        )
        grid = json.loads(args.grid) if args.grid else None
        for label, cand in candidates(spec.device, grid, ops=args.ops):
            t0 = time.perf_counter()
            m = await engine.run(request_for(label, cand, settings), deadline_s=600)
            took = time.perf_counter() - t0
            median = m.timing.median_ms if m.timing else 0.0
            limit = step_bytes(spec, weights, m.batch_size, m.context_len).limit_tokens_per_s(
                args.bandwidth
            )
            row = {
                "candidate": label,
                "recipe": cand.describe(),
                "status": m.status,
                "correct": m.correct,
                "max_abs_error": m.max_abs_error,
                "median_ms": median,
                "p10_ms": m.timing.p10_ms if m.timing else 0.0,
                "p90_ms": m.timing.p90_ms if m.timing else 0.0,
                "tokens_per_s": m.tokens_per_s,
                "limit_tokens_per_s": limit,
                "fraction_of_limit": m.tokens_per_s / limit if limit and median else 0.0,
                "seconds_to_result": took,
                "phases_ms": m.phases_ms,
                "error": m.error.splitlines()[0] if m.error else "",
            }
            rows.append(row)
            print(
                f"  {label:62s} {m.status:9s} {median:8.3f} ms {m.tokens_per_s:9.1f} tok/s "
                f"{row['fraction_of_limit']:6.1%}  ({took:.1f} s) {row['error'][:100]}",
                flush=True,
            )
    finally:
        await engine.stop()
    best = max((r for r in rows if r["status"] == "ok"), key=lambda r: r["tokens_per_s"])
    print("\n=== decode, best first ===")
    for r in sorted(rows, key=lambda r: -r["tokens_per_s"]):
        print(
            f"{r['candidate']:62s} {r['status']:9s} {r['median_ms']:8.3f} ms "
            f"{r['tokens_per_s']:9.1f} tok/s {r['fraction_of_limit']:6.1%}"
        )
    print(f"best: {best['candidate']} {best['tokens_per_s']:.1f} tokens/s")
    return {"spec": {"batch": spec.batch_size, "context": spec.context_len}, "rows": rows}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="", help="default: KILN_ENGINE_DEVICE (cpu)")
    parser.add_argument("--tier", default="full", choices=["fast", "full"])
    parser.add_argument("--batch", type=int, default=1, help="decode batch (0 = the trace's)")
    parser.add_argument("--bandwidth", type=float, default=4.26e12, help="bytes/s")
    parser.add_argument("--json", default="", help="write the full results to this file")
    parser.add_argument(
        "--grid", default="", help="JSON list of fused_decode parameter sets (default: built in)"
    )
    parser.add_argument(
        "--no-ops", dest="ops", action="store_false", help="skip the op-level candidates"
    )
    if not MODEL.is_file() or not TRACE.is_file():
        sys.exit(f"needs {MODEL} and {TRACE}")
    cli = parser.parse_args()
    data = asyncio.run(main(cli))
    if cli.json:
        Path(cli.json).write_text(json.dumps(data, indent=2))
