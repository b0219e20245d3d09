"""The cost model's tier-2 microbenchmark tables for the shared models, on this host's device.

For each model (``shared/data/models/<name>.json``) builds the request the cost model would
send (:func:`kiln.cost_model.op_shapes.request_for`: every GEMM of its layers and LM head at
tp 1, 2, 4, 8, decode attention by batch x context, prefill attention by prompt, one routed
expert by tokens, the launch cost eagerly and as a CUDA-graph replay), times it in this process
with the engine pool's own timer (:func:`kiln.engine_pool.microbench_ops.run`), prints a short
table (time, achieved bandwidth and math rate against the catalogue's peak) and writes JSON:
one ``MicrobenchmarkMeasured`` payload per model (:mod:`kiln.events.microbenchmarks`), so a run
can be appended to a ledger as it is. On the CPU, GPU-only ops are listed as skipped.

    python benchmarks/microbench_tables.py [--models llama-3.2-1b,llama-3.1-8b,qwen3-8b,...]
        [--device cuda:0|cpu] [--dtype bfloat16] [--budget-s 120] [--tps 1,2,4,8]
        [--out benchmarks/results/microbench_tables.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("KILN_SHARED_DATA", ROOT.parent / "shared" / "data"))
RESULT = ROOT / "benchmarks" / "results" / "microbench_tables.json"
DEFAULT_MODELS = "llama-3.2-1b,llama-3.1-8b,qwen3-8b,qwen3-30b-a3b,mixtral-8x7b-v0.1"


def _rates(op: str, shape: dict[str, int], ms: float, wb: int) -> tuple[float, float]:
    """(GB/s of the weights or KV read, TFLOP/s) of one timed op."""
    s = ms / 1e3
    if op == "gemm":
        m, n, k = shape["m"], shape["n"], shape["k"]
        return n * k * wb / s / 1e9, 2 * m * n * k / s / 1e12
    if op == "attention_decode":
        b, c, kvh, d = shape["batch"], shape["context"], shape["kv_heads"], shape["head_dim"]
        return b * c * 2 * kvh * d * 2 / s / 1e9, 4 * b * shape["heads"] * c * d / s / 1e12
    if op == "attention_prefill":
        t = shape["tokens"]
        return 0.0, 2 * shape["heads"] * t * t * shape["head_dim"] / s / 1e12
    if op == "moe_expert":
        t, h, i = shape["tokens"], shape["hidden"], shape["intermediate"]
        return 3 * h * i * wb / s / 1e9, 6 * t * h * i / s / 1e12
    return 0.0, 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=DEFAULT_MODELS)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--budget-s", type=float, default=120.0, help="per model")
    ap.add_argument("--tps", default="1,2,4,8")
    ap.add_argument("--out", type=Path, default=RESULT)
    args = ap.parse_args(argv)

    import torch

    from kiln.cost_model.hardware import get_hardware
    from kiln.cost_model.op_shapes import request_for
    from kiln.engine_pool.devices import gpu_kind
    from kiln.engine_pool.microbench_ops import run
    from kiln.engine_pool.microbench_run import device_name, versions
    from kiln.workloads.config import DTYPE_BYTES, parse_config_json

    dev = torch.device(args.device)
    if dev.type == "cpu":  # as a CPU engine runs (a core left to the rest of the host)
        from kiln.engine_pool.worker import cpu_threads

        torch.set_num_threads(cpu_threads(os.environ.get("KILN_ENGINE_THREADS", "")))
    name = device_name(args.device)
    kind = gpu_kind(name) if dev.type == "cuda" else "cpu"
    try:
        hw = get_hardware(kind)
        bw, rate = hw.memory_bandwidth_bytes_per_s / 1e9, hw.flops_for(args.dtype) / 1e12
        peak = f"peak {bw:.0f} GB/s, {rate:.0f} TFLOP/s"
    except Exception:
        peak = "not in the catalogue"
    tps = tuple(int(t) for t in args.tps.split(","))
    wb = DTYPE_BYTES[args.dtype]
    print(f"{name} ({kind}; {peak}); {versions()}")
    payloads: list[dict[str, Any]] = []
    for model in args.models.split(","):
        path = DATA / "models" / f"{model}.json"
        if not path.is_file():
            print(f"skip {model}: {path} is absent")
            continue
        cfg = parse_config_json(path.read_text(), model)
        req = request_for(cfg, kind, args.dtype, tps).model_copy(update={"budget_s": args.budget_s})
        start = time.monotonic()
        results, skipped = run(req, dev)
        wall = time.monotonic() - start
        print(f"\n{model}: {len(results)} points in {wall:.1f} s, {len(skipped)} skipped")
        print(f"  {'op':18} {'shape':44} {'ms':>10} {'GB/s':>9} {'TFLOP/s':>8}")
        for r in results:
            gbs, tfl = _rates(r.op, r.shape, r.ms, wb)
            shape = " ".join(f"{k}={v}" for k, v in r.shape.items())
            print(f"  {r.op:18} {shape[:44]:44} {r.ms:10.4f} {gbs:9.1f} {tfl:8.2f}")
        reasons: dict[str, int] = {}
        for s in skipped:
            key = f"{s.op} {s.dtype}: {s.reason}"
            reasons[key] = reasons.get(key, 0) + 1
        for key, n in reasons.items():
            print(f"  skipped {n} x {key}")
        payloads.append(
            {
                "device_kind": kind,
                "device_name": name,
                "versions": versions(),
                "model_name": model,
                "results": [r.model_dump(mode="json") for r in results],
                "skipped": [s.model_dump(mode="json") for s in skipped],
                "wall_s": round(wall, 3),
            }
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    command = shlex.join([sys.executable, *sys.argv])
    args.out.write_text(json.dumps({"command": command, "runs": payloads}, indent=1) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
