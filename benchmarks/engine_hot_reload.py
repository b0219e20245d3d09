"""Engine benchmark: cold start of a persistent engine vs hot reload of candidates on it.

Usage (from the repository root):

    python benchmarks/engine_hot_reload.py [--tier fast|full] [--dtype float32|bfloat16]

Timing follows the service's settings (``KILN_ENGINE_WARMUP``, ``_REPEATS``, ``_MIN_REPEATS``,
``_MEASURE_BUDGET_S``, ``_MAX_BATCH``, ``_MAX_CONTEXT``, ...).

It builds one engine process for Llama-3.2-1B (``../shared/data/models/llama-3.2-1b.json``,
seeded random weights) at the operating point of the Azure conversation trace
(``../shared/data/traces/azure_llm_2023_conv.csv``; batch and context clamped to the
``KILN_ENGINE_MAX_BATCH`` / ``KILN_ENGINE_MAX_CONTEXT`` caps), and prints:

1. cold start: process start → engine ready (interpreter, torch import, weights, KV cache,
   warm-up), and the build time inside the process;
2. for several candidates on the warm engine, hot reload → result: sending the candidate,
   loading its code, re-binding ops, warm-up, correctness check and timing, until the
   measurement is back; with the phase split and the decode step's median;
3. the ratio of the mean hot reload to the cold start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

from kiln.engine_pool.process import EngineProcess
from kiln.engine_pool.request import RunRequest
from kiln.engine_pool.settings import EngineSettings
from kiln.engine_pool.spec import EngineSpec
from kiln.workloads.candidate import Candidate, CodeModule
from kiln.workloads.traffic import TrafficShape, read_trace

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
MODEL = SHARED / "models" / "llama-3.2-1b.json"
TRACE = SHARED / "traces" / "azure_llm_2023_conv.csv"

HANDWRITTEN_RMS_NORM = CodeModule(
    "handwritten_rms_norm",
    '''
import torch
from kiln.ops.registry import register

@register("rms_norm", "handwritten", replace=True)
def handwritten(x, residual=None, *, weight, eps):
    """RMSNorm with the residual add, written out (float32 statistics)."""
    if residual is not None:
        x = x + residual
    residual = x
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed.to(x.dtype) * weight), residual
''',
)

CANDIDATES = [
    ("reference", Candidate()),
    ("attention=sdpa", Candidate.make({"attention": "sdpa"})),
    (
        "qkv_proj=fused, mlp=fused_gate_up",
        Candidate.make({"qkv_proj": "fused", "mlp": "fused_gate_up"}),
    ),
    (
        "code module: rms_norm=handwritten",
        Candidate.make({"rms_norm": "handwritten"}, code_modules=[HANDWRITTEN_RMS_NORM]),
    ),
]


def workload(dtype: str) -> dict[str, object]:
    """The Workload JSON: the model config and the trace's traffic shape."""
    shape = TrafficShape.from_trace(read_trace(TRACE))
    model = {"name": MODEL.stem, "config_json": MODEL.read_text(), "seed": "0"}
    if dtype:
        model["dtype"] = dtype
    return {
        "model": model,
        "traffic": {
            "source": shape.source,
            "batch_size": shape.batch_size,
            "context_len": shape.context_len,
        },
        "hardware": {"name": "cpu", "num_devices": 1},
    }


async def main(args: argparse.Namespace) -> None:
    settings = EngineSettings()
    spec = EngineSpec.from_workload(workload(args.dtype), args.tier, settings.limits())
    print(
        f"model {spec.model_name}, {args.tier} tier: "
        f"{spec.layers}/{spec.total_layers} layers, {spec.dtype}"
    )
    print(f"operating point: batch {spec.batch_size}, context {spec.context_len} tokens")
    for note in spec.notes:
        print(f"  note: {note}")

    engine = EngineProcess(spec, "bench", ready_timeout_s=1800)
    start = time.perf_counter()
    engine.start()
    try:
        await engine.wait_ready()
        cold = time.perf_counter() - start
        build = engine.info.get("build_phases_s", {})
        print(f"\ncold start (process start -> ready): {cold:8.2f} s")
        print(
            f"  build inside the process: {engine.build_s:.2f} s ("
            + ", ".join(f"{k} {v:.2f}" for k, v in build.items())
            + f"); interpreter + imports {cold - engine.build_s:.2f} s"
        )
        mem = engine.info.get("memory", {})
        print(
            f"  weights {mem.get('weights_bytes', 0) / 2**20:.0f} MiB, "
            f"KV caches {mem.get('kv_cache_bytes', 0) / 2**20:.1f} MiB"
        )

        print(
            f"\nhot reload -> result on the warm engine (warmup {settings.warmup}, "
            f"{settings.min_repeats}..{settings.repeats} timed steps, "
            f"budget {settings.measure_budget_s:g} s):"
        )
        print(
            f"  {'candidate':38s} {'status':9s} {'reload->result':>14s} "
            f"{'decode median':>14s} {'tokens/s':>9s}  phases (ms)"
        )
        reloads, rebinds = [], []
        for label, candidate in CANDIDATES:
            request = RunRequest(
                label,
                candidate.canonical(),
                warmup=settings.warmup,
                repeats=settings.repeats,
                min_repeats=settings.min_repeats,
                measure_budget_s=settings.measure_budget_s,
            )
            t0 = time.perf_counter()
            m = await engine.run(request, deadline_s=600, candidate_id=candidate.id)
            took = time.perf_counter() - t0
            reloads.append(took)
            rebinds.append((m.phases_ms.get("load", 0.0) + m.phases_ms.get("bind", 0.0)) / 1e3)
            median = f"{m.timing.median_ms:.1f} ms" if m.timing else "-"
            phases = ", ".join(f"{k} {v:.0f}" for k, v in m.phases_ms.items())
            print(
                f"  {label:38s} {m.status:9s} {took:12.2f} s {median:>14s} "
                f"{m.tokens_per_s:9.1f}  {phases}"
            )
            if m.status != "ok":
                print(f"    error: {m.error.splitlines()[0]}")
        mean, rebind = statistics.mean(reloads), statistics.mean(rebinds)
        print(
            f"\nreload proper (load code + re-bind ops): mean {rebind * 1e3:.0f} ms "
            f"= {rebind / cold:.1%} of the cold start; the rest of each experiment is its "
            "correctness check and timing"
        )
        print(
            f"\nmean hot reload -> result: {mean:.2f} s; cold start: {cold:.2f} s; "
            f"ratio {mean / cold:.2f}"
        )
        print(
            json.dumps(
                {
                    "cold_start_s": round(cold, 3),
                    "hot_reload_mean_s": round(mean, 3),
                    "ratio": round(mean / cold, 3),
                    "rebind_mean_s": round(rebind, 4),
                }
            )
        )
    finally:
        await engine.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tier", choices=["fast", "full"], default="fast")
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="", help="default: the service's"
    )
    if not MODEL.is_file() or not TRACE.is_file():
        sys.exit(f"needs {MODEL} and {TRACE}")
    asyncio.run(main(parser.parse_args()))
