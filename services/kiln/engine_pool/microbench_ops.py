"""The microbenchmarks themselves: torch ops timed on one device at the requested shapes.

Each op is timed after a warm-up, repeatedly until ``MIN_RUNS`` runs and ``POINT_BUDGET_S`` of
them (at most ``MAX_RUNS``); the result is the median in ms with the spread (p90 - p10) /
median. On CUDA a run is bracketed by CUDA events after a synchronize, on the CPU by
``perf_counter``. GPU-only ops (FP8 GEMMs, CUDA-graph replay) are skipped on the CPU with the
reason; an op that raises is skipped with its error. The whole run stops at its budget (the
rest skipped as "budget spent"). Runs in the microbenchmark subprocess
(:mod:`kiln.engine_pool.microbench_run`), never in the pool's process.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from kiln.common.microbench_wire import MicrobenchRequest
from kiln.events.microbenchmarks import OpResult, OpSkipped

MIN_RUNS = 3
MAX_RUNS = 50
POINT_BUDGET_S = 0.05
"""Timing of one point stops once it has MIN_RUNS runs and this much time (GPU: 200 runs)."""
LAUNCH_OPS = 100
"""Tiny kernels per launch-overhead sample."""

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
}

Point = tuple[str, dict[str, int], Callable[[], Callable[[], Any]]]
"""(op, shape, setup) where ``setup()`` allocates and returns the function to time."""


def time_ms(fn: Callable[[], Any], device: torch.device) -> tuple[float, int, float]:
    """(median ms, runs, spread) of ``fn`` after two warm-up calls."""
    cuda = device.type == "cuda"
    for _ in range(2):
        fn()
    if cuda:
        torch.cuda.synchronize(device)
    samples: list[float] = []
    start = time.perf_counter()
    max_runs = 200 if cuda else MAX_RUNS
    while len(samples) < max_runs:
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            samples.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        if len(samples) >= MIN_RUNS and time.perf_counter() - start > POINT_BUDGET_S:
            break
    med = statistics.median(samples)
    qs = statistics.quantiles(samples, n=10) if len(samples) >= 2 else [med] * 9
    return med, len(samples), (qs[8] - qs[0]) / med if med > 0 else 0.0


def _gemm(m: int, n: int, k: int, dt: torch.dtype, dev: torch.device) -> Callable[[], Any]:
    if dt == torch.float8_e4m3fn:
        x = torch.randn(m, k, device=dev).to(dt)
        w = torch.randn(n, k, device=dev).to(dt).t()
        one = torch.ones((), device=dev)
        return lambda: torch._scaled_mm(x, w, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    x, w = torch.randn(m, k, device=dev, dtype=dt), torch.randn(k, n, device=dev, dtype=dt)
    return lambda: x @ w


def _attention(
    b: int, q_len: int, ctx: int, h: int, kvh: int, d: int, dt: torch.dtype, dev: torch.device
) -> Callable[[], Any]:
    q = torch.randn(b, h, q_len, d, device=dev, dtype=dt)
    k = torch.randn(b, kvh, ctx, d, device=dev, dtype=dt)
    v = torch.randn(b, kvh, ctx, d, device=dev, dtype=dt)
    causal = q_len > 1
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=h != kvh)


def _expert(t: int, hdim: int, inter: int, dt: torch.dtype, dev: torch.device) -> Callable[[], Any]:
    x = torch.randn(t, hdim, device=dev, dtype=dt)
    gu = torch.randn(hdim, 2 * inter, device=dev, dtype=dt)
    down = torch.randn(inter, hdim, device=dev, dtype=dt)

    def run() -> torch.Tensor:
        g, u = (x @ gu).chunk(2, dim=-1)
        return (F.silu(g) * u) @ down

    return run


def _launch(dev: torch.device, graph: bool) -> Callable[[], Any]:
    a = torch.ones(1, device=dev)
    out = torch.empty_like(a)

    def burst() -> None:
        for _ in range(LAUNCH_OPS):
            torch.add(a, 1.0, out=out)

    if not graph:
        return burst
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        burst()
    torch.cuda.synchronize(dev)
    with torch.cuda.graph(g):
        burst()
    return g.replay


def points(req: MicrobenchRequest, dev: torch.device) -> Iterator[Point | OpSkipped]:
    """Every point of ``req`` to time on ``dev``, or the reason an op cannot run there."""
    dt_name = req.dtype
    dt = _DTYPES[dt_name]
    cuda = dev.type == "cuda"
    fp8 = dt == torch.float8_e4m3fn
    if fp8 and not cuda:
        yield OpSkipped(op="gemm", dtype=dt_name, reason="FP8 GEMMs need a GPU with FP8")
    elif fp8 and torch.cuda.get_device_capability(dev) < (8, 9):
        yield OpSkipped(op="gemm", dtype=dt_name, reason="FP8 GEMMs need compute capability 8.9")
    else:
        for g in req.gemm:
            for m in g.ms:
                yield (
                    "gemm",
                    {"m": m, "n": g.n, "k": g.k},
                    partial(_gemm, m, g.n, g.k, dt, dev),
                )
    adt = torch.bfloat16 if fp8 else dt  # attention and experts compute in the activations'
    for a in req.attention_decode:
        for b in a.batches:
            for c in a.contexts:
                shape = {"batch": b, "context": c, "heads": a.heads, "kv_heads": a.kv_heads}
                yield (
                    "attention_decode",
                    shape | {"head_dim": a.head_dim},
                    partial(_attention, b, 1, c, a.heads, a.kv_heads, a.head_dim, adt, dev),
                )
    for a in req.attention_prefill:
        for c in a.contexts:
            shape = {"tokens": c, "heads": a.heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim}
            yield (
                "attention_prefill",
                shape,
                partial(_attention, 1, c, c, a.heads, a.kv_heads, a.head_dim, adt, dev),
            )
    for e in req.moe_expert:
        for t in e.tokens:
            shape = {"tokens": t, "hidden": e.hidden, "intermediate": e.intermediate}
            yield (
                "moe_expert",
                shape,
                partial(_expert, t, e.hidden, e.intermediate, adt, dev),
            )
    if req.launch:
        yield "launch", {"graph": 0}, lambda: _launch(dev, graph=False)
        if cuda:
            yield "launch", {"graph": 1}, lambda: _launch(dev, graph=True)
        else:
            yield OpSkipped(op="launch", dtype="", reason="CUDA-graph replay needs a GPU")


def run(req: MicrobenchRequest, dev: torch.device) -> tuple[list[OpResult], list[OpSkipped]]:
    """Time every point of ``req`` on ``dev`` within ``req.budget_s``."""
    results: list[OpResult] = []
    skipped: list[OpSkipped] = []
    deadline = time.monotonic() + req.budget_s
    fp8 = req.dtype == "float8_e4m3fn"
    for item in points(req, dev):
        if isinstance(item, OpSkipped):
            skipped.append(item)
            continue
        op, shape, setup = item
        dtype = "bfloat16" if fp8 and op != "gemm" else req.dtype
        if op == "launch":
            dtype = "none"
        if time.monotonic() > deadline:
            skipped.append(
                OpSkipped(op=op, dtype=dtype, reason=f"budget of {req.budget_s:g} s spent")
            )
            continue
        try:
            fn = setup()
            with torch.inference_mode():
                ms, n, spread = time_ms(fn, dev)
        except Exception as exc:  # an op the device cannot run: say so, go on
            skipped.append(
                OpSkipped(op=op, dtype=dtype, reason=f"{type(exc).__name__}: {exc}"[:500])
            )
            continue
        if op == "launch":
            ms /= LAUNCH_OPS
        results.append(
            OpResult.model_validate(
                {"op": op, "dtype": dtype, "shape": shape, "ms": max(ms, 1e-6)}
                | {"samples": n, "spread": spread}
            )
        )
    return results, skipped
