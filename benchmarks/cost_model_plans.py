"""The cost model's answers to practitioner questions (issue 16), on the roofline tier.

For each question -- a small dense model at batch 1 on 8 GPUs, an 8B model at batch 1, at batch
256 and at 128 sequences of 8k tokens on one GPU (FP8 KV), a 235B MoE on 8 H200, DeepSeek-V3
(FP8) on 8, 16 and 32 (EP across nodes) and in BF16 on 16 (uneven PP, EP across nodes) --
prints the chosen plan, its TPOT, TTFT (the serving model's medians where it ran), tokens/s per
GPU, whether it meets the targets, and the Pareto frontier; writes
``benchmarks/results/cost_model_plans.json`` (with the command).

    python benchmarks/cost_model_plans.py [--tpot-ms 50] [--ttft-ms 2000] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("KILN_SHARED_DATA", ROOT.parent / "shared" / "data"))
RESULT = ROOT / "benchmarks" / "results" / "cost_model_plans.json"
FP8 = "float8_e4m3fn"
QUESTIONS: list[tuple[str, str, int, int, int, str, int]] = [
    # (question, model, batch, ISL, devices, weight dtype, context: 0 = ISL + 128)
    ("small dense model, batch 1, 8 GPUs", "llama-3.2-1b", 1, 1024, 8, "bfloat16", 0),
    ("8B dense, batch 1, 8 GPUs", "llama-3.1-8b", 1, 1024, 8, "bfloat16", 0),
    ("8B dense, 256 in flight, 8 GPUs", "llama-3.1-8b", 256, 1024, 8, "bfloat16", 0),
    ("8B dense, 128 in flight, 8k context, 1 GPU", "llama-3.1-8b", 128, 1024, 1, "bfloat16", 8192),
    ("235B MoE, 64 in flight, 8 H200", "qwen3-235b-a22b", 64, 1024, 8, "bfloat16", 0),
    ("DeepSeek-V3 FP8, 64 in flight, 8 H200", "deepseek-v3", 64, 2048, 8, FP8, 0),
    ("DeepSeek-V3 FP8, 256 in flight, 16 H200", "deepseek-v3", 256, 2048, 16, FP8, 0),
    ("DeepSeek-V3 FP8, 256 in flight, 32 H200", "deepseek-v3", 256, 2048, 32, FP8, 0),
    ("DeepSeek-V3 BF16, 64 in flight, 16 H200", "deepseek-v3", 64, 2048, 16, "bfloat16", 0),
]


def _short(label: str) -> str:
    """A plan's label without its DCP degree (the frontier column)."""
    return re.sub(r" dcp\d+", "", label)


def _row(e: Any, targets: Any, frontier: frozenset[str]) -> dict[str, Any]:
    sv = e.serving
    return {
        "plan": e.plan.label(),
        "devices": e.plan.devices,
        "tpot_ms": round(e.served_tpot_ms, 3),
        "ttft_ms": round(e.served_ttft_ms, 2),
        "tpot_p90_ms": round(sv.tpot_p90_ms, 3) if sv else None,
        "ttft_p90_ms": round(sv.ttft_p90_ms, 2) if sv else None,
        "step_tpot_ms": round(e.tpot_ms, 3),
        "serving_model": sv is not None,
        "tokens_per_s": round(e.served_tokens_per_s, 1),
        "tokens_per_s_per_gpu": round(e.served_per_device, 1),
        "meets_targets": targets.miss(e) == 0,
        "pareto": e.plan.label() in frontier,
        "kv_cache_dtype": e.plan.kv_dtype or "bfloat16",
        "moe_tp": e.plan.expert_tp,
        "attention_dp": e.plan.attention_dp,
    }


def main() -> None:
    from kiln.cost_model.hardware import get_hardware
    from kiln.cost_model.objective import ServingTargets
    from kiln.cost_model.planner import plan_workload
    from kiln.domain.operating_point import OperatingPoint
    from kiln.workloads.config import load_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tpot-ms", type=float, default=0.0)
    ap.add_argument("--ttft-ms", type=float, default=0.0)
    ap.add_argument("--out", type=Path, default=RESULT)
    a = ap.parse_args()
    targets = ServingTargets.of(a.tpot_ms, a.ttft_ms)
    h200 = get_hardware("h200")
    answers = []
    for question, name, batch, isl, devices, dtype, context in QUESTIONS:
        cfg = load_config(DATA / "models" / f"{name}.json")
        point = OperatingPoint(batch_size=batch, isl=isl, osl=256, context_len=context or isl + 128)
        r = plan_workload(cfg, h200, point, devices, weight_dtype=dtype, targets=targets)
        frontier = [e for e in r.feasible if e.plan.label() in r.frontier]
        frontier.sort(key=lambda e: e.served_tpot_ms)
        answers.append(
            {
                "question": question,
                "model": name,
                "batch": batch,
                "isl": isl,
                "devices": devices,
                "weight_dtype": dtype,
                "chosen": _row(r.feasible[0], targets, r.frontier) if r.feasible else None,
                "frontier": [_row(e, targets, r.frontier) for e in frontier],
                "feasible": len(r.feasible),
                "batch_note": r.batch_note,
                "note": r.note(r.feasible[0]) if r.feasible else "",
            }
        )
    result = {
        "command": " ".join(shlex.quote(x) for x in [sys.executable, *sys.argv]),
        "tier": "roofline",
        "objective": targets.describe(),
        "answers": answers,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(result["objective"])
    print(
        f"{'question':44} {'chosen':34} {'TPOT ms':>8} {'TTFT ms':>8} {'tok/s/GPU':>10} "
        "frontier (TPOT ms)"
    )
    for x in answers:
        c = x["chosen"]
        front = ", ".join(f"{_short(f['plan'])} {f['tpot_ms']:.2f}" for f in x["frontier"])
        if c is None:
            print(f"{x['question']:44} {'none feasible':34}")
            continue
        print(
            f"{x['question']:44} {c['plan']:34} {c['tpot_ms']:>8.2f} {c['ttft_ms']:>8.1f} "
            f"{c['tokens_per_s_per_gpu']:>10.0f} {front}"
        )


if __name__ == "__main__":
    main()
