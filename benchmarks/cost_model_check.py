"""The roofline tier's decode step against kiln's own H200 measurements (issue 16's held-out
check, as far as measurements exist): for each (model, batch, context) that RESULTS.md reports
from `kiln compile` on one H200 (issue 10's rows, sessions 7-10), the predicted TPOT of one
decode step at tp=1 against the measured step of kiln's best candidate and of gpt-fast.

Not blind: the per-kernel overhead (4 us) was derived from one of these points (Llama-3.2-1B at
batch 1, context 1,085). Prints a table and the median absolute error, writes
``benchmarks/results/cost_model_check.json``.

    python benchmarks/cost_model_check.py
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("KILN_SHARED_DATA", ROOT.parent / "shared" / "data"))
RESULT = ROOT / "benchmarks" / "results" / "cost_model_check.json"
# (model, batch, context, kiln best tok/s, gpt-fast tok/s, where in RESULTS.md)
MEASURED = [
    ("llama-3.2-1b", 1, 1085, 1159.3, 610.4, "issue 10 text: 1,159.3; gpt_fast: the issue's table"),
    ("llama-3.2-1b", 1, 7084, 991.9, 462.7, "session 9 rows"),
    ("llama-3.2-3b", 1, 1085, 460.3, 270.2, "session 9 rows"),
    ("llama-3.2-3b", 30, 1085, 7853.8, 2676.5, "session 10 rows"),
    ("llama-3.1-8b", 1, 1085, 236.4, 166.7, "session 9 rows"),
    ("llama-3.1-8b", 1, 7084, 229.8, 133.5, "session 10 rows"),
    ("llama-3.1-8b", 30, 1085, 4881.9, 1748.2, "session 10 rows"),
    ("qwen3-0.6b", 30, 1085, 11905.1, 4052.6, "session 9 rows"),
    ("qwen3-8b", 1, 1085, 214.6, 152.6, "baselines side by side rows"),
    ("qwen3-8b", 30, 1085, 4469.0, 1594.6, "session 9 rows"),
]


def main() -> None:
    from kiln.cost_model.hardware import get_hardware
    from kiln.cost_model.roofline import estimate
    from kiln.cost_model.sharding import Parallelism
    from kiln.domain.operating_point import OperatingPoint
    from kiln.workloads.config import load_config

    h200 = get_hardware("h200")
    rows = []
    for name, batch, ctx, kiln_tps, gpt_tps, source in MEASURED:
        cfg = load_config(DATA / "models" / f"{name}.json")
        point = OperatingPoint(batch_size=batch, isl=ctx, osl=1, context_len=ctx)
        est = estimate(cfg, h200, point, Parallelism())
        kiln_ms, gpt_ms = batch / kiln_tps * 1e3, batch / gpt_tps * 1e3
        rows.append(
            {
                "model": name,
                "batch": batch,
                "context": ctx,
                "predicted_tpot_ms": round(est.tpot_ms, 4),
                "kiln_best_tpot_ms": round(kiln_ms, 4),
                "gpt_fast_tpot_ms": round(gpt_ms, 4),
                "error_vs_kiln": round(est.tpot_ms / kiln_ms - 1, 4),
                "error_vs_gpt_fast": round(est.tpot_ms / gpt_ms - 1, 4),
                "source": source,
            }
        )
    med_kiln = statistics.median(abs(r["error_vs_kiln"]) for r in rows)
    med_gpt = statistics.median(abs(r["error_vs_gpt_fast"]) for r in rows)
    result = {
        "command": " ".join(shlex.quote(x) for x in [sys.executable, *sys.argv]),
        "hardware": "h200 (one GPU, tp=1, bf16)",
        "rows": rows,
        "median_abs_error_vs_kiln_best": med_kiln,
        "median_abs_error_vs_gpt_fast": med_gpt,
    }
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'model':14} {'B':>3} {'ctx':>5} {'pred ms':>8} {'kiln ms':>8} {'err':>6} "
          f"{'gpt-fast ms':>11} {'err':>6}")  # fmt: skip
    for r in rows:
        print(
            f"{r['model']:14} {r['batch']:>3} {r['context']:>5} {r['predicted_tpot_ms']:>8.3f} "
            f"{r['kiln_best_tpot_ms']:>8.3f} {r['error_vs_kiln']:>+6.0%} "
            f"{r['gpt_fast_tpot_ms']:>11.3f} {r['error_vs_gpt_fast']:>+6.0%}"
        )
    print(f"median |error|: vs kiln best {med_kiln:.0%}, vs gpt-fast {med_gpt:.0%}")


if __name__ == "__main__":
    main()
