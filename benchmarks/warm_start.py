"""Warm start vs cold start at a new traffic shape, on this CPU, in one run (Contract 2).

Brings kiln up on the embedded default in a scratch state directory (free ports, so it does not
meet another kiln on this machine), then, with a tiny Llama-3.2 config (the e2e tests' one) and
the same budget for each, for each repeat (fresh teams, so no repeat seeds or reuses another):

1. ``old``: a compilation at the scenario's old shape, team ``bench-warm-R``;
2. ``cold``: a cold compilation at the new shape, team ``bench-cold-R`` -- another team, so it
   can neither reuse nor be reused by the warm one;
3. ``warm``: the same new shape warm-started from ``old`` (``WarmStart.compilation_ids``), team
   ``bench-warm-R``. Cold and warm alternate their order by repeat.

Scenarios (``--scenario``): ``code-to-conv`` (Azure code, batch 2 on a CPU engine, then Azure
conversation, batch 8), ``conv-to-code``, ``conv-isl-1.8`` (Azure conversation, then the same
trace with every prompt 1.8x as long).

Figure: the time (seconds from submission, and experiments) the warm compilation needs to reach
the cold one's final best speedup (``BestCandidateImproved.speedup``, full tier over the
reference measured next to it) within ``--tolerance`` (default 3 %: the full tier's run-to-run
noise on a shared CPU), over the time the cold one needed for its own final best; goal <= 30 %.
Each run's experiments (agent, tier, candidate, outcome) are kept in the JSON. Prints a table
last and writes ``--out`` (default ``benchmarks/results/warm_start.json``, with the command).

    python benchmarks/warm_start.py [--scenario code-to-conv] [--repeats 1] [--budget-s 120]
        [--max-experiments 20] [--tolerance 0.03] [--out PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import shlex
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("KILN_SHARED_DATA", ROOT.parent / "shared" / "data"))
LLAMA = DATA / "models" / "llama-3.2-1b.json"
TRACES = DATA / "traces"
SCENARIOS = {
    # name: (old trace, new trace, ISL factor applied to the new trace)
    "code-to-conv": ("azure_llm_2023_code.csv", "azure_llm_2023_conv.csv", 1.0),
    "conv-to-code": ("azure_llm_2023_conv.csv", "azure_llm_2023_code.csv", 1.0),
    "conv-isl-1.8": ("azure_llm_2023_conv.csv", "azure_llm_2023_conv.csv", 1.8),
}
RESULT = ROOT / "benchmarks" / "results" / "warm_start.json"


def _teams(repeat: int) -> tuple[str, str]:
    """(warm team, cold team) of one repeat: fresh teams, so no repeat reuses or seeds from
    another (nearby seeds and reuse are per team)."""
    return f"bench-warm-{repeat}", f"bench-cold-{repeat}"


def _scaled_trace(trace: Path, factor: float, out: Path) -> Path:
    """An Azure-format copy of ``trace`` with every prompt length x ``factor``."""
    if factor == 1.0:
        return trace
    rows = list(csv.DictReader(trace.open(newline="")))
    path = out / f"{trace.stem}-isl-x{factor:g}.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        for row in rows:
            w.writerow({**row, "ContextTokens": round(int(row["ContextTokens"]) * factor)})
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tiny_config(out: Path) -> Path:
    """Llama-3.2-1B's config shrunk as in tests/e2e (same family, rope scaling, GQA ratio)."""
    cfg = json.loads(LLAMA.read_text())
    cfg.update(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=2048,
    )
    path = out / "tiny-llama.json"
    path.write_text(json.dumps(cfg))
    return path


def _environment(state: Path) -> None:
    """A private embedded kiln: state directory, ports, no metrics."""
    os.environ.update(
        KILN_STATE_DIR=str(state),
        KILN_EMBEDDED_NATS_PORT=str(_free_port()),
        KILN_EMBEDDED_POSTGRES_PORT=str(_free_port()),
        KILN_LEDGER_ADDR=f"127.0.0.1:{_free_port()}",
        KILN_ENGINE_POOL_ADDR=f"127.0.0.1:{_free_port()}",
        KILN_AGENT_RUNNER_ADDR=f"127.0.0.1:{_free_port()}",
        KILN_COST_MODEL_ADDR=f"127.0.0.1:{_free_port()}",
        KILN_METRICS_PORT="0",
        KILN_LOG_LEVEL="warning",
    )
    for name in ("KILN_NATS_URL", "KILN_DATABASE_URL", "KILN_TLS", "KILN_PKI_DIR"):
        os.environ.pop(name, None)


async def _compile(settings: Any, team: str, request: Any) -> dict[str, Any]:
    """Submit as ``team`` and watch to the end; the last snapshot's figures."""
    from kiln.common.client import FixedIdentity, team_channel, use_client_identity
    from kiln.common.identity import Principal
    from kiln.common.tls import material_for
    from kiln.v1 import compiler_pb2, compiler_pb2_grpc

    identity = FixedIdentity(material_for(settings, Principal("team", team)))
    with use_client_identity(identity):
        async with team_channel(settings.agent_runner_addr, team) as channel:
            stub = compiler_pb2_grpc.CompilerStub(channel)
            submitted = await stub.Submit(request, timeout=120)
            cid = submitted.compilation_id
            print(f"  {team}: {cid} submitted", file=sys.stderr, flush=True)
            last = None
            log: list[dict[str, Any]] = []
            async for event in stub.Watch(compiler_pb2.WatchRequest(compilation_id=cid)):
                last = event
                _log_event(log, event)
                if event.type == "CompilationEnded":
                    break
    assert last is not None
    snap = last.snapshot
    return {
        "compilation_id": cid,
        "team": team,
        "status": last.detail["status"],
        "reason": last.detail["reason"],
        "experiments_done": snap.experiments_done,
        "experiments_reused": snap.experiments_reused,
        "best_speedup": snap.best.speedup if snap.HasField("best") else 0.0,
        "best_candidate": snap.best.candidate.candidate_id if snap.HasField("best") else "",
        "progress": [
            {
                "elapsed_s": p.elapsed_s,
                "experiments": p.experiments,
                "speedup": p.speedup,
                "candidate_id": p.candidate_id,
            }
            for p in snap.progress
        ],
        "experiments": log,
    }


def _log_event(log: list[dict[str, Any]], event: Any) -> None:
    """Append one Watch event to a compact experiment log: what was proposed (by which agent, at
    which tier), its outcome, the reference, reuses and each new best."""
    from google.protobuf.json_format import MessageToDict

    from kiln.cli.compile_view import describe_candidate

    d = MessageToDict(event.detail) if event.HasField("detail") else {}
    at = None
    if event.HasField("snapshot") and event.snapshot.HasField("created_at"):
        since = event.recorded_at.ToDatetime() - event.snapshot.created_at.ToDatetime()
        at = round(since.total_seconds(), 1)
    if event.type == "ExperimentRequested":
        log.append(
            {
                "at_s": at,
                "agent": d.get("agent", ""),
                "tier": d.get("tier", ""),
                "candidate": describe_candidate(d.get("candidate")),
                "candidate_id": d.get("candidate_id", ""),
            }
        )
    elif event.type == "ExperimentCompleted":
        for row in reversed(log):
            if row.get("candidate_id") == d.get("candidate_id") and "status" not in row:
                row["status"] = d.get("status", "")
                row["tokens_per_s"] = round(float(d.get("tokens_per_s", 0.0) or 0.0), 1)
                if d.get("status") != "ok":
                    row["error"] = str(d.get("error", ""))[:120]
                break
    elif event.type in ("MeasurementReused", "BaselineMeasured", "BestCandidateImproved"):
        keep = ("candidate_id", "tokens_per_s", "speedup", "tier", "agent")
        log.append({"at_s": at, "event": event.type, **{k: d[k] for k in keep if k in d}})


def _reach(progress: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    """The first point of a best-so-far curve at or above ``target`` speedup."""
    return next((p for p in progress if p["speedup"] >= target), None)


async def _compilations(
    settings: Any, old: Any, new: Any, budget: Any, repeat: int
) -> dict[str, Any]:
    """One repeat: ``old``, then ``cold`` and ``warm`` at the new shape (their order alternates
    by repeat, so a drift of the machine falls on both alike)."""
    from kiln.v1 import compiler_pb2

    def req(workload: Any, **kw: Any) -> Any:
        return compiler_pb2.SubmitRequest(
            workload=workload, budget=budget, baselines=["none"], **kw
        )

    warm_team, cold_team = _teams(repeat)
    runs = {"old": await _compile(settings, warm_team, req(old))}
    warm_start = compiler_pb2.WarmStart(compilation_ids=[runs["old"]["compilation_id"]])
    for name in ("cold", "warm") if repeat % 2 == 0 else ("warm", "cold"):
        if name == "cold":
            runs["cold"] = await _compile(settings, cold_team, req(new))
        else:
            runs["warm"] = await _compile(settings, warm_team, req(new, warm_start=warm_start))
    return runs


def _figures(runs: dict[str, Any], tolerance: float) -> dict[str, Any]:
    """When cold reached its final best, when warm reached it (within ``tolerance``), the ratio."""
    cold, warm = runs["cold"], runs["warm"]
    cold_best = cold["best_speedup"]
    cold_point = _reach(cold["progress"], cold_best) if cold_best > 0 else None
    warm_point = _reach(warm["progress"], cold_best * (1 - tolerance)) if cold_best > 0 else None
    ratio = (
        warm_point["elapsed_s"] / cold_point["elapsed_s"]
        if warm_point and cold_point and cold_point["elapsed_s"] > 0
        else None
    )
    warm_best = warm["best_speedup"]
    cold_to_warm = _reach(cold["progress"], warm_best * (1 - tolerance)) if warm_best > 0 else None
    return {
        "cold_final_speedup": cold_best,
        "warm_final_speedup": warm_best,
        "cold_reached": cold_point,
        "warm_reached": warm_point,
        "time_ratio": ratio,
        "cold_reached_warm_final": cold_to_warm,
        "final_ratio": warm_best / cold_best if cold_best > 0 and warm_best > 0 else None,
    }


def _run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from kiln.agent_runner.workload import build_workload
    from kiln.common.pki import ensure_deployment
    from kiln.common.settings import SERVICE_NAMES, load_settings
    from kiln.embedded.supervisor import Supervisor
    from kiln.v1 import common_pb2

    old_name, new_name, isl_factor = SCENARIOS[args.scenario]
    _environment(workdir / "state")
    settings = load_settings()
    teams = tuple(t for r in range(args.repeats) for t in _teams(r))
    ensure_deployment(settings.pki_path, SERVICE_NAMES, teams=teams)
    config = _tiny_config(workdir)
    old = build_workload(config, TRACES / old_name, "cpu")
    new = build_workload(config, _scaled_trace(TRACES / new_name, isl_factor, workdir), "cpu")
    budget = common_pb2.Budget(wall_seconds=args.budget_s, max_experiments=args.max_experiments)
    supervisor = Supervisor(settings)
    print("starting kiln (embedded) ...", file=sys.stderr, flush=True)
    supervisor.up(start_services=True)
    repeats = []
    try:
        started = time.monotonic()
        for r in range(args.repeats):
            runs = asyncio.run(_compilations(settings, old, new, budget, r))
            repeats.append({"runs": runs, **_figures(runs, args.tolerance)})
            print(f"  repeat {r}: {_row(r, repeats[-1])}", file=sys.stderr, flush=True)
        wall = time.monotonic() - started
    finally:
        supervisor.down()
    ratios = [x["time_ratio"] for x in repeats if x["time_ratio"] is not None]
    finals = [x["final_ratio"] for x in repeats if x["final_ratio"] is not None]
    return {
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "model": "tiny llama-3.2 (hidden 256, 4 layers, vocab 2048; tests/e2e)",
        "scenario": args.scenario,
        "old_shape": old_name,
        "new_shape": new_name + (f" with ISL x{isl_factor:g}" if isl_factor != 1.0 else ""),
        "old_traffic": _traffic(old),
        "new_traffic": _traffic(new),
        "budget": {"wall_seconds": args.budget_s, "max_experiments": args.max_experiments},
        "tolerance": args.tolerance,
        "repeats": repeats,
        "cold_found_a_best": sum(1 for x in repeats if x["cold_final_speedup"] > 0),
        "warm_reached_cold": len(ratios),
        "median_time_ratio": statistics.median(ratios) if ratios else None,
        "median_final_ratio": statistics.median(finals) if finals else None,
        "goal": "time_ratio <= 0.30",
        "wall_s": wall,
    }


def _traffic(workload: Any) -> dict[str, Any]:
    t = workload.traffic
    return {"batch_size": t.batch_size, "context_len": t.context_len}


def _row(r: int, x: dict[str, Any]) -> str:
    def cell(point: dict[str, Any] | None) -> str:
        if point is None:
            return "not reached"
        return f"{point['elapsed_s']:.1f} s / {point['experiments']} exp"

    ratio = x["time_ratio"]
    return (
        f"{r:>6}  {x['cold_final_speedup']:>5.2f}x  {cell(x['cold_reached']):>16}  "
        f"{x['warm_final_speedup']:>5.2f}x  {cell(x['warm_reached']):>16}  "
        + (f"{ratio:>9.0%}" if ratio is not None else f"{'n/a':>9}")
        + f"  {cell(x.get('cold_reached_warm_final')):>16}"
    )


def _table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['scenario']}: {result['old_shape']} {result['old_traffic']} -> "
        f"{result['new_shape']} {result['new_traffic']}",
        "repeat   cold   cold reached it    warm   warm reached it  warm/cold  cold reached warm",
    ]
    lines += [_row(r, x) for r, x in enumerate(result["repeats"])]
    median = result["median_time_ratio"]
    lines.append(
        f"warm reached cold's final best (within {result['tolerance']:.0%}) in "
        f"{result['warm_reached_cold']} of {result['cold_found_a_best']} repeats where cold "
        "found one; median warm/cold time "
        + (f"{median:.0%}" if median is not None else "n/a")
        + " (goal <= 30 %); median warm/cold final best "
        + (f"{result['median_final_ratio']:.2f}x" if result["median_final_ratio"] else "n/a")
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="code-to-conv")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--budget-s", type=float, default=120.0, help="wall seconds per run")
    parser.add_argument("--max-experiments", type=int, default=20)
    parser.add_argument("--tolerance", type=float, default=0.03)
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kiln-warm-bench-") as tmp:
        result = _run(args, Path(tmp))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(_table(result))


if __name__ == "__main__":
    main()
