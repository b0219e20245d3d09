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

from kiln.engine_pool.measurement import Measurement
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


def request_for(label: str, candidate: Candidate, settings: EngineSettings) -> RunRequest:
    """A RunRequest timed as the service times experiments."""
    return RunRequest(
        label,
        candidate.canonical(),
        warmup=settings.warmup,
        repeats=settings.repeats,
        min_repeats=settings.min_repeats,
        measure_budget_s=settings.measure_budget_s,
    )


def row(label: str, took: float, m: Measurement) -> str:
    """One table line: candidate, status, seconds to result, decode median, tokens/s, phases."""
    median = f"{m.timing.median_ms:.1f} ms" if m.timing else "-"
    phases = ", ".join(f"{k} {v:.0f}" for k, v in m.phases_ms.items())
    line = (
        f"  {label:38s} {m.status:9s} {took:12.2f} s {median:>14s} {m.tokens_per_s:9.1f}  {phases}"
    )
    if m.status != "ok":
        line += f"\n    error: {m.error.splitlines()[0]}"
    return line


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
    print(
        f"timing: warmup {settings.warmup}, {settings.min_repeats}..{settings.repeats} timed "
        f"steps, budget {settings.measure_budget_s:g} s"
    )
    header = (
        f"  {'candidate':38s} {'status':9s} {'to result':>14s} "
        f"{'decode median':>14s} {'tokens/s':>9s}  phases (ms)"
    )

    engine = EngineProcess(spec, "bench", ready_timeout_s=1800)
    start = time.perf_counter()
    engine.start()
    try:
        await engine.wait_ready()
        ready = time.perf_counter() - start
        first_label, first_candidate = CANDIDATES[0]
        m = await engine.run(
            request_for(first_label, first_candidate, settings),
            deadline_s=600,
            candidate_id=first_candidate.id,
        )
        cold = time.perf_counter() - start
        build = engine.info.get("build_phases_s", {})
        print(f"\ncold start (process start -> first result): {cold:8.2f} s")
        print(
            f"  process start -> engine ready: {ready:.2f} s; build inside the process "
            f"{engine.build_s:.2f} s ("
            + ", ".join(f"{k} {v:.2f}" for k, v in build.items())
            + f"); interpreter + imports {ready - engine.build_s:.2f} s"
        )
        mem = engine.info.get("memory", {})
        print(
            f"  weights {mem.get('weights_bytes', 0) / 2**20:.0f} MiB, "
            f"KV caches {mem.get('kv_cache_bytes', 0) / 2**20:.1f} MiB"
        )
        print(header)
        print(row(f"{first_label} (first experiment)", cold - ready, m))

        print("\nhot reload -> result on the warm engine:")
        print(header)
        reloads, swaps = [], []
        for label, candidate in CANDIDATES[1:] + CANDIDATES[:1]:
            t0 = time.perf_counter()
            m = await engine.run(
                request_for(label, candidate, settings), deadline_s=600, candidate_id=candidate.id
            )
            took = time.perf_counter() - t0
            reloads.append(took)
            swaps.append(sum(m.phases_ms.get(k, 0.0) for k in ("load", "bind", "compile")) / 1e3)
            print(row(label, took, m))
        mean, swap = statistics.mean(reloads), statistics.mean(swaps)
        print(
            f"\nswap proper (load code, re-bind ops, first step at the shape): mean "
            f"{swap * 1e3:.0f} ms; the rest of each experiment is its correctness check and timing"
        )
        print(f"engine build (process start -> ready): {ready:8.2f} s")
        print(f"cold start -> first result:            {cold:8.2f} s")
        print(
            f"hot reload -> result (mean of {len(reloads)}):      {mean:8.2f} s = "
            f"{mean / ready:.0%} of the build, {mean / cold:.0%} of the cold start"
        )
        print(
            f"experiments per hour: {3600 / mean:,.0f} hot-reloading vs {3600 / cold:,.0f} "
            f"restarting per experiment ({cold / mean:.1f}x)"
        )
        print(
            json.dumps(
                {
                    "build_s": round(ready, 3),
                    "cold_start_to_result_s": round(cold, 3),
                    "hot_reload_mean_s": round(mean, 3),
                    "ratio_to_build": round(mean / ready, 3),
                    "ratio_to_cold_start": round(mean / cold, 3),
                    "swap_mean_s": round(swap, 4),
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
