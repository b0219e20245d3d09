"""Engine benchmark: cold start of a persistent engine vs hot reload of candidates on it, and
experiments per hour hot-reloading vs restarting the engine per experiment.

Usage (from the repository root):

    python benchmarks/engine_hot_reload.py [--device cpu|cuda:0] [--tiers fast,full]
        [--batch N] [--restarts N] [--dtype float32|bfloat16] [--json FILE]

Timing follows the service's settings (``KILN_ENGINE_WARMUP``, ``_REPEATS``, ``_MIN_REPEATS``,
``_MEASURE_BUDGET_S``, ``_MAX_BATCH``, ``_MAX_CONTEXT``, ...; CUDA devices have their own
defaults, see ``kiln.engine_pool.settings.CUDA_DEFAULTS``). Data come from ``../shared/data``
beside the checkout, or ``$KILN_SHARED_DATA``.

For each tier it builds one engine process for Llama-3.2-1B
(``models/llama-3.2-1b.json``, seeded random weights) at the operating point of the Azure
conversation trace (``traces/azure_llm_2023_conv.csv``; ``--batch`` overrides the batch, e.g.
1 for batch-1 decode), and prints:

1. cold start: process start -> engine ready -> the first experiment's result (the reference
   candidate), with the build split;
2. for several new candidates on the warm engine, hot reload -> result: sending the candidate,
   loading its code, re-binding ops, (CUDA graph capture), warm-up, correctness check and
   timing, until the measurement is back; with the phase split and the decode step's median;
3. ``--restarts N``: N more engines started, measured once and stopped (restart per
   experiment), each on a candidate of its own;
4. a summary: cold start, mean hot reload, their ratio, experiments per hour both ways, and
   the reference's decode tokens/s per tier.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.domain.candidate import Candidate, CodeModule, Transform
from kiln.engine_pool.process import EngineProcess
from kiln.engine_pool.settings import EngineSettings
from kiln.runtime.measurement import Measurement
from kiln.runtime.request import RunRequest
from kiln.runtime.spec import EngineSpec
from kiln.workloads.traffic import TrafficShape, read_trace

SHARED = Path(
    os.environ.get("KILN_SHARED_DATA")
    or Path(__file__).resolve().parents[1].parent / "shared" / "data"
)
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


def candidates(device: str) -> list[tuple[str, Candidate]]:
    """The candidates measured, first the reference (the cold start's experiment)."""
    out = [
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
        (
            "rms_norm=fused_residual, rope=cos_sin_cache",
            Candidate.make({"rms_norm": "fused_residual", "rope": "cos_sin_cache"}),
        ),
    ]
    if device.startswith("cuda"):
        graph = [Transform("cuda_graph")]
        fused = {
            "attention": "sdpa",
            "qkv_proj": "fused",
            "mlp": "fused_gate_up",
            "rms_norm": "fused_residual",
            "rope": "cos_sin_cache",
        }
        out += [
            ("cuda_graph", Candidate.make({}, transforms=graph)),
            ("all fused ops + cuda_graph", Candidate.make(fused, transforms=graph)),
            (
                "attention=sdpa + cuda_graph",
                Candidate.make({"attention": "sdpa"}, transforms=graph),
            ),
            (  # the second code module: the sandbox (started by the first) is warm
                "code module: rms_norm=handwritten + cuda_graph",
                Candidate.make(
                    {"rms_norm": "handwritten"},
                    code_modules=[HANDWRITTEN_RMS_NORM],
                    transforms=graph,
                ),
            ),
        ]
    return out


def workload(dtype: str, batch: int) -> dict[str, object]:
    """The Workload JSON: the model config and the trace's traffic shape (``batch`` > 0
    overrides the shape's batch)."""
    shape = TrafficShape.from_trace(read_trace(TRACE))
    model = {"name": MODEL.stem, "config_json": MODEL.read_text(), "seed": "0"}
    if dtype:
        model["dtype"] = dtype
    return {
        "model": model,
        "traffic": {
            "source": shape.source,
            "batch_size": batch or shape.batch_size,
            "context_len": shape.context_len,
        },
        "hardware": {"name": "cpu", "num_devices": 1},
    }


def request_for(label: str, candidate: Candidate, settings: EngineSettings) -> RunRequest:
    """A RunRequest timed as the service times experiments."""
    return RunRequest(
        label,
        candidate,
        warmup=settings.warmup,
        repeats=settings.repeats,
        min_repeats=settings.min_repeats,
        measure_budget_s=settings.measure_budget_s,
        verify_timed_steps=settings.verify_timed_steps,
        prefill_repeats=settings.prefill_repeats,
    )


def row(label: str, took: float, m: Measurement) -> str:
    """One table line: candidate, status, seconds to result, decode median, tokens/s, phases."""
    median = f"{m.timing.median_ms:.3f} ms" if m.timing else "-"
    phases = ", ".join(f"{k} {v:.0f}" for k, v in m.phases_ms.items())
    # in the engine but outside its phases; then outside the engine (the pipe, the worker)
    inside = m.device_ms - sum(m.phases_ms.values())
    phases += f"; unphased {inside:.0f}, outside engine {took * 1e3 - m.device_ms:.0f}"
    line = (
        f"  {label:42s} {m.status:9s} {took:9.3f} s {median:>12s} {m.tokens_per_s:9.1f}  {phases}"
    )
    if m.prefill is not None:
        line += (
            f"\n    prefill {m.prefill.median_ms:.2f} ms median "
            f"({m.prefill_tokens_per_s:,.0f} prompt tokens/s)"
        )
    if m.status != "ok":
        line += f"\n    error: {m.error.splitlines()[0] if m.error else ''}"
    return line


HEADER = (
    f"  {'candidate':42s} {'status':9s} {'to result':>11s} "
    f"{'decode median':>12s} {'tokens/s':>9s}  phases (ms)"
)


@dataclass
class TierResult:
    """What one tier measured (seconds, tokens/s)."""

    tier: str
    layers: str
    batch: int
    context: int
    ready_s: float = 0.0
    cold_s: float = 0.0
    hot_s: list[float] = field(default_factory=list)
    restart_s: list[float] = field(default_factory=list)
    tokens_per_s: dict[str, float] = field(default_factory=dict)
    statuses: dict[str, str] = field(default_factory=dict)
    phases_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    memory: dict[str, Any] = field(default_factory=dict)

    @property
    def hot_mean_s(self) -> float:
        return statistics.mean(self.hot_s) if self.hot_s else float("nan")

    @property
    def hot_median_s(self) -> float:
        return statistics.median(self.hot_s) if self.hot_s else float("nan")

    @property
    def restart_mean_s(self) -> float:
        runs = [self.cold_s, *self.restart_s]
        return statistics.mean(runs)


async def measure(engine: EngineProcess, label: str, cand: Candidate, settings: EngineSettings):
    t0 = time.perf_counter()
    m = await engine.run(request_for(label, cand, settings), deadline_s=600)
    return time.perf_counter() - t0, m


async def run_tier(tier: str, args: argparse.Namespace, settings: EngineSettings) -> TierResult:
    spec = EngineSpec.from_workload(workload(args.dtype, args.batch), tier, settings.limits())
    cands = candidates(spec.device)
    result = TierResult(
        tier, f"{spec.layers}/{spec.total_layers}", spec.batch_size, spec.context_len
    )
    print(
        f"\n=== {spec.model_name}, {tier} tier: {spec.layers}/{spec.total_layers} layers, "
        f"{spec.dtype} on {spec.device}; batch {spec.batch_size}, context {spec.context_len} ==="
    )
    for note in spec.notes:
        print(f"  note: {note}")
    engine = EngineProcess(spec, f"bench-{tier}", ready_timeout_s=1800)
    start = time.perf_counter()
    engine.start()
    try:
        await engine.wait_ready()
        result.ready_s = time.perf_counter() - start
        label, cand = cands[0]
        took, m = await measure(engine, label, cand, settings)
        result.cold_s = time.perf_counter() - start
        result.tokens_per_s[label] = m.tokens_per_s
        result.statuses[label] = m.status
        result.phases_ms[label] = m.phases_ms
        build = engine.info.get("build_phases_s", {})
        result.memory = dict(engine.info.get("memory", {}))
        print(f"cold start (process start -> first result): {result.cold_s:.2f} s")
        print(
            f"  process start -> ready {result.ready_s:.2f} s; build in the process "
            f"{engine.build_s:.2f} s ("
            + ", ".join(f"{k} {v:.2f}" for k, v in build.items())
            + f"); interpreter + imports {result.ready_s - engine.build_s:.2f} s"
        )
        mem = result.memory
        print(
            f"  weights {mem.get('weights_bytes', 0) / 2**20:.0f} MiB, KV caches "
            f"{mem.get('kv_cache_bytes', 0) / 2**20:.1f} MiB, workspace "
            f"{mem.get('workspace_bytes', 0) / 2**20:.1f} MiB"
        )
        print(HEADER)
        print(row(f"{label} (first experiment)", took, m))
        print("hot reload -> result on the warm engine:")
        print(HEADER)
        for label, cand in cands[1:]:
            took, m = await measure(engine, label, cand, settings)
            result.hot_s.append(took)
            result.tokens_per_s[label] = m.tokens_per_s
            result.statuses[label] = m.status
            result.phases_ms[label] = m.phases_ms
            print(row(label, took, m))
    finally:
        await engine.stop()
    for i in range(args.restarts):
        label, cand = cands[1 + i % (len(cands) - 1)]
        fresh = EngineProcess(spec, f"bench-{tier}-restart{i}", ready_timeout_s=1800)
        t0 = time.perf_counter()
        fresh.start()
        try:
            await fresh.wait_ready()
            _, m = await measure(fresh, label, cand, settings)
        finally:
            await fresh.stop()
        took = time.perf_counter() - t0
        result.restart_s.append(took)
        print(f"restart per experiment #{i + 1} ({label}): {took:.2f} s ({m.status})")
    return result


async def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    settings = EngineSettings(**({"device": args.device} if args.device else {}))
    print(
        f"timing: warmup {settings.warmup}, {settings.min_repeats}..{settings.repeats} timed "
        f"steps, budget {settings.measure_budget_s:g} s"
    )
    results = [await run_tier(tier, args, settings) for tier in args.tiers.split(",")]
    print("\n=== summary ===")
    print(
        f"{'tier':5s} {'layers':>7s} {'batch':>5s} {'cold start':>11s} "
        f"{'hot reload mean / median':>25s} {'cold/hot':>9s} {'exp/h hot':>10s} "
        f"{'exp/h restart':>14s} {'x':>6s} {'reference tok/s':>16s}"
    )
    for r in results:
        ref = r.tokens_per_s.get("reference", 0.0)
        print(
            f"{r.tier:5s} {r.layers:>7s} {r.batch:5d} {r.cold_s:9.2f} s "
            f"{r.hot_mean_s:11.3f} / {r.hot_median_s:.3f} s {r.cold_s / r.hot_mean_s:8.1f}x "
            f"{3600 / r.hot_mean_s:10,.0f} {3600 / r.restart_mean_s:14,.0f} "
            f"{r.restart_mean_s / r.hot_mean_s:5.0f}x {ref:16.1f}"
        )
    print(
        "cold/hot = cold start to first result over the mean hot reload to result; "
        "x = experiments per hour hot-reloading over restarting per experiment (both means)"
    )
    return [
        {
            **r.__dict__,
            "hot_mean_s": r.hot_mean_s,
            "hot_median_s": r.hot_median_s,
            "restart_mean_s": r.restart_mean_s,
            "experiments_per_hour_hot": 3600 / r.hot_mean_s,
            "experiments_per_hour_restart": 3600 / r.restart_mean_s,
        }
        for r in results
    ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="", help="default: KILN_ENGINE_DEVICE (cpu)")
    parser.add_argument("--tiers", default="fast", help="comma-separated: fast,full")
    parser.add_argument("--batch", type=int, default=0, help="decode batch (default: trace's)")
    parser.add_argument("--restarts", type=int, default=0, help="restart-per-experiment runs")
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="", help="default: the service's"
    )
    parser.add_argument("--json", default="", help="write the full results to this file")
    if not MODEL.is_file() or not TRACE.is_file():
        sys.exit(f"needs {MODEL} and {TRACE}")
    cli = parser.parse_args()
    data = asyncio.run(main(cli))
    if cli.json:
        Path(cli.json).write_text(json.dumps(data, indent=2))
