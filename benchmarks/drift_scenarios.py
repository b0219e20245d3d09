"""Drift detection on the real traces: false triggers on stationary traffic, time to trigger on
drifting traffic, and the window-to-window noise the default thresholds are set above.

Each scenario is a list of requests in arrival order (trace time, seconds), folded into windows
(:class:`~kiln.workloads.traffic.windows.WindowSpec`, default 600 s every 300 s) and measured
against the proven shape: :func:`~kiln.workloads.traffic.drift.reference_shape` of the traffic
before the change (the whole trace when stationary). After a trigger the run is replayed as a
controller would: the proven shape becomes the reference shape of the drifted run's windows and
the detector is rebased at the trigger (a promotion at the new shape).

Scenarios: stationary Azure conv / Azure code / Mooncake conversation; Azure conv thinned 1 in
10 (~300 requests a window: small-window noise); Azure conv then Azure code and Mooncake
conversation then synthetic (concatenated in time); Azure conv with ISL x1.8 from its midpoint;
a burst: Azure conv whose traffic doubles for 15 minutes from 40 % of its span with prompts
twice as long (the issue's "bursts double prompt lengths").

    python3 benchmarks/drift_scenarios.py [--json benchmarks/results/drift_scenarios.json]

Prints a table last; writes JSON with the command, the policy, the spec and every window.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from kiln.workloads.traffic import read_trace
from kiln.workloads.traffic.drift import (
    DIMENSIONS,
    DriftDetector,
    DriftPolicy,
    measure_drift,
    reference_shape,
)
from kiln.workloads.traffic.records import Request
from kiln.workloads.traffic.windows import TrafficWindow, WindowSpec, fold

TRACES = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "traces"
GAP_S = 1.0  # between the end of one trace and the start of the next when concatenated


def _load(name: str, traces: Path) -> list[Request]:
    return list(read_trace(traces / name).requests)


def _then(a: list[Request], b: list[Request]) -> tuple[list[Request], float]:
    """``b`` shifted to start ``GAP_S`` after ``a``'s last arrival; (both, change time)."""
    change = a[-1].arrival_s + GAP_S
    return a + [replace(r, arrival_s=r.arrival_s + change) for r in b], change


def _scaled_isl(reqs: list[Request], factor: float, at: float) -> list[Request]:
    return [replace(r, isl=round(r.isl * factor)) if r.arrival_s >= at else r for r in reqs]


def _burst(reqs: list[Request], start: float, length: float) -> list[Request]:
    """Every request in ``[start, start + length)`` gets a twin 0.1 s later with twice its
    prompt (rate x2 there, half the prompts twice as long)."""
    twins = [
        replace(r, arrival_s=r.arrival_s + 0.1, isl=r.isl * 2)
        for r in reqs
        if start <= r.arrival_s < start + length
    ]
    return sorted(reqs + twins, key=lambda r: r.arrival_s)


def scenarios(traces: Path) -> dict[str, tuple[list[Request], float | None]]:
    """name -> (requests, change time in seconds or None for stationary traffic)."""
    conv = _load("azure_llm_2023_conv.csv", traces)
    code = _load("azure_llm_2023_code.csv", traces)
    mc_conv = _load("mooncake_fast25_conversation.jsonl", traces)
    mc_syn = _load("mooncake_fast25_synthetic.jsonl", traces)
    span = conv[-1].arrival_s
    out: dict[str, tuple[list[Request], float | None]] = {
        "stationary azure conv": (conv, None),
        "stationary azure code": (code, None),
        "stationary mooncake conv": (mc_conv, None),
        "stationary azure conv 1/10": (conv[::10], None),
    }
    out["azure conv -> code"] = _then(conv, code)
    out["mooncake conv -> synthetic"] = _then(mc_conv, mc_syn)
    out["azure conv isl x1.8 @mid"] = (_scaled_isl(conv, 1.8, span / 2), span / 2)
    out["azure conv burst 15 min"] = (_burst(conv, 0.4 * span, 900.0), 0.4 * span)
    return out


def run_scenario(
    reqs: list[Request], change: float | None, spec: WindowSpec, policy: DriftPolicy
) -> dict[str, Any]:
    """Replay one scenario window by window; the figures the table and the JSON show."""
    before = reqs if change is None else [r for r in reqs if r.arrival_s < change]
    proven = reference_shape(before, spec)
    detector = DriftDetector(policy)
    windows = fold(reqs, spec, origin_s=0.0)
    rows: list[dict[str, Any]] = []
    run: list[TrafficWindow] = []
    triggers: list[dict[str, Any]] = []
    noise = dict.fromkeys(DIMENSIONS, 0.0)
    for w in windows:
        measure = measure_drift(proven, w.shape(), policy)
        decision = detector.observe(measure, w.end_s, sparse=w.sparse)
        if not w.sparse and (change is None or w.end_s <= change):
            for dim in DIMENSIONS:
                noise[dim] = max(noise[dim], measure.dimensions[dim])
        run = [*run, w] if decision.drifted else ([] if not w.sparse else run)
        row = {
            "index": w.index,
            "start_s": w.start_s,
            "end_s": w.end_s,
            "requests": len(w.requests),
            "sparse": w.sparse,
            "measure": measure.to_dict(),
            "decision": decision.to_dict(),
        }
        rows.append(row)
        if decision.triggered:
            triggers.append(
                {"index": w.index, "end_s": w.end_s, "dominant": measure.dominant,
                 "score": measure.score, "reason": decision.reason}
            )  # fmt: skip
            seen = {id(r): r for x in run for r in x.requests}
            proven = reference_shape(sorted(seen.values(), key=lambda r: r.arrival_s), spec)
            detector.rebase(w.end_s)
            run = []
    out = _summary(rows, triggers, change, noise)
    if change is None:
        out["noise_after_rebase"] = rebased_noise(windows, spec, policy)
    return out


def rebased_noise(
    windows: list[TrafficWindow], spec: WindowSpec, policy: DriftPolicy
) -> dict[str, float]:
    """Largest statistic of each non-sparse window against the reference shape of the two
    windows before it: the noise a detector sees after a rebase onto a drifted run's shape."""
    noise = dict.fromkeys(DIMENSIONS, 0.0)
    for i in range(2, len(windows)):
        w, run = windows[i], windows[i - 2 : i]
        if w.sparse or any(x.sparse for x in run):
            continue
        seen = {id(r): r for x in run for r in x.requests}
        proven = reference_shape(sorted(seen.values(), key=lambda r: r.arrival_s), spec)
        measure = measure_drift(proven, w.shape(), policy)
        for dim in DIMENSIONS:
            noise[dim] = max(noise[dim], measure.dimensions[dim])
    return noise


def _summary(
    rows: list[dict[str, Any]],
    triggers: list[dict[str, Any]],
    change: float | None,
    noise: dict[str, float],
) -> dict[str, Any]:
    after = [r for r in rows if change is not None and r["end_s"] > change]
    drifted = [r for r in after if r["decision"]["drifted"]]
    first_drift = drifted[0] if drifted else None
    false = [t for t in triggers if change is None or t["end_s"] <= change]
    true = [t for t in triggers if change is not None and t["end_s"] > change]
    first = true[0] if true else None
    out: dict[str, Any] = {
        "windows": len(rows),
        "sparse": sum(r["sparse"] for r in rows),
        "change_s": change,
        "triggers": len(triggers),
        "false_triggers": len(false),
        "trigger_list": triggers,
        "max_score_before_change": max(
            (r["measure"]["score"] for r in rows if change is None or r["end_s"] <= change),
            default=0.0,
        ),
        "noise_before_change": noise,
        "first_changed_window": after[0]["index"] if after else None,
        "first_drifted_window": first_drift["index"] if first_drift else None,
        "trigger_window": first["index"] if first else None,
        "dominant": first["dominant"] if first else None,
        "windows_to_trigger": None,
        "seconds_to_trigger": None,
        "seconds_change_to_trigger": None,
        "rows": rows,
    }
    if first and first_drift:
        out["windows_to_trigger"] = first["index"] - first_drift["index"]
        out["seconds_to_trigger"] = first["end_s"] - first_drift["end_s"]
        out["seconds_change_to_trigger"] = first["end_s"] - (change or 0.0)
    return out


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 10 else f"{v:.2f}"
    return str(v)


def table(results: dict[str, dict[str, Any]], policy: DriftPolicy) -> str:
    """The printed summary: one row per scenario, then the stationary noise per dimension."""
    head = ("scenario", "windows", "triggers", "false", "max score before", "1st drifted",
            "trigger", "windows to trig", "s to trig", "s change->trig", "dominant")  # fmt: skip
    keys = ("windows", "triggers", "false_triggers", "max_score_before_change",
            "first_drifted_window", "trigger_window", "windows_to_trigger",
            "seconds_to_trigger", "seconds_change_to_trigger", "dominant")  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name, r in results.items():
        lines.append("| " + " | ".join([name, *(_cell(r[k]) for k in keys)]) + " |")
    lines += [
        "",
        "stationary noise (largest statistic over windows; vs the whole trace's "
        "reference / vs the two windows before, as after a rebase) and the limits:",
    ]
    dims = ("trace", *DIMENSIONS)
    lines += ["| " + " | ".join(dims) + " |", "|" + " --- |" * len(dims)]
    for name, r in results.items():
        if r["change_s"] is None:
            a, b = r["noise_before_change"], r["noise_after_rebase"]
            cells = [f"{a[d]:.2f} / {b[d]:.2f}" for d in DIMENSIONS]
            lines.append("| " + " | ".join([name, *cells]) + " |")
    lines.append("| limit | " + " | ".join(f"{policy.limit(d):g}" for d in DIMENSIONS) + " |")
    return "\n".join(lines)


def _rounded(obj: Any) -> Any:
    """``obj`` with floats to 4 decimals (the JSON's size; no figure needs more)."""
    if isinstance(obj, float):
        return round(obj, 4)
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rounded(v) for v in obj]
    return obj


def main(argv: list[str] | None = None) -> int:
    """Run every scenario (or those named by --only), print the table, write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", type=Path, default=TRACES)
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/drift_scenarios.json"))
    ap.add_argument("--length", type=float, default=WindowSpec.length_s)
    ap.add_argument("--step", type=float, default=WindowSpec.step_s)
    ap.add_argument("--policy", type=json.loads, default={}, help="DriftPolicy fields, JSON")
    ap.add_argument("--only", default="", help="comma-separated scenario names")
    args = ap.parse_args(argv)
    spec = WindowSpec(length_s=args.length, step_s=args.step)
    policy = DriftPolicy.from_dict(args.policy)
    wanted: Callable[[str], bool] = lambda n: not args.only or n in args.only.split(",")  # noqa: E731
    results = {
        name: run_scenario(reqs, change, spec, policy)
        for name, (reqs, change) in scenarios(args.traces).items()
        if wanted(name)
    }
    text = table(results, policy)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    command = "python3 benchmarks/drift_scenarios.py " + shlex.join(
        sys.argv[1:] if argv is None else argv
    )
    doc = {
        "command": command.strip(),
        "spec": asdict(spec),
        "policy": policy.to_dict(),
        "scenarios": results,
        "table": text,
    }
    args.json.write_text(json.dumps(_rounded(doc), separators=(",", ":")) + "\n", encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
