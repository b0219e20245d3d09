"""Warm start vs cold start at a new traffic shape, on this CPU, in one run (Contract 2).

Brings kiln up on the embedded default in a scratch state directory (free ports, so it does not
meet another kiln on this machine), then, with a tiny Llama-3.2 config (the e2e tests' one) and
the same budget for each:

1. ``old``: a compilation at the old shape (the Azure code trace: batch 2 on a CPU engine),
   team ``bench-warm``;
2. ``cold``: a cold compilation at the new shape (the Azure conversation trace: batch 8), team
   ``bench-cold`` -- another team, so it can neither reuse nor be reused by the warm one;
3. ``warm``: the same new shape warm-started from ``old`` (``WarmStart.compilation_ids``), team
   ``bench-warm``.

Figure: the time (seconds from submission, and experiments) the warm compilation needs to reach
the cold one's final best speedup (``BestCandidateImproved.speedup``, full tier over the
reference measured next to it) within ``--tolerance`` (default 3 %: the full tier's run-to-run
noise on a shared CPU), over the time the cold one needed for its own final best; goal <= 30 %.
Prints a table last and writes ``benchmarks/results/warm_start.json`` (with the command).

    python benchmarks/warm_start.py [--budget-s 120] [--max-experiments 20] [--tolerance 0.03]

(Code then conversation: in the other order, on 2026-12-02 with 180 s budgets, nothing beat the
reference at the code trace's batch 2 on the full tier, cold or warm, so there was no final
best to reach.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("KILN_SHARED_DATA", ROOT.parent / "shared" / "data"))
LLAMA = DATA / "models" / "llama-3.2-1b.json"
OLD_TRACE = DATA / "traces" / "azure_llm_2023_code.csv"
NEW_TRACE = DATA / "traces" / "azure_llm_2023_conv.csv"
RESULT = ROOT / "benchmarks" / "results" / "warm_start.json"
TEAMS = ("bench-warm", "bench-cold")


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
            async for event in stub.Watch(compiler_pb2.WatchRequest(compilation_id=cid)):
                last = event
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
    }


def _reach(progress: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    """The first point of a best-so-far curve at or above ``target`` speedup."""
    return next((p for p in progress if p["speedup"] >= target), None)


async def _compilations(settings: Any, old: Any, new: Any, budget: Any) -> dict[str, Any]:
    from kiln.v1 import compiler_pb2

    def req(workload: Any, **kw: Any) -> Any:
        return compiler_pb2.SubmitRequest(
            workload=workload, budget=budget, baselines=["none"], **kw
        )

    runs = {"old": await _compile(settings, TEAMS[0], req(old))}
    runs["cold"] = await _compile(settings, TEAMS[1], req(new))
    warm_start = compiler_pb2.WarmStart(compilation_ids=[runs["old"]["compilation_id"]])
    runs["warm"] = await _compile(settings, TEAMS[0], req(new, warm_start=warm_start))
    return runs


def _run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from kiln.agent_runner.workload import build_workload
    from kiln.common.pki import ensure_deployment
    from kiln.common.settings import SERVICE_NAMES, load_settings
    from kiln.embedded.supervisor import Supervisor
    from kiln.v1 import common_pb2

    _environment(workdir / "state")
    settings = load_settings()
    ensure_deployment(settings.pki_path, SERVICE_NAMES, teams=TEAMS)
    config = _tiny_config(workdir)
    old = build_workload(config, OLD_TRACE, "cpu")
    new = build_workload(config, NEW_TRACE, "cpu")
    budget = common_pb2.Budget(wall_seconds=args.budget_s, max_experiments=args.max_experiments)
    supervisor = Supervisor(settings)
    print("starting kiln (embedded) ...", file=sys.stderr, flush=True)
    supervisor.up(start_services=True)
    try:
        started = time.monotonic()
        runs = asyncio.run(_compilations(settings, old, new, budget))
        wall = time.monotonic() - started
    finally:
        supervisor.down()
    cold, warm = runs["cold"], runs["warm"]
    cold_best = cold["best_speedup"]
    cold_point = _reach(cold["progress"], cold_best) if cold_best > 0 else None
    target = cold_best * (1 - args.tolerance)
    warm_point = _reach(warm["progress"], target) if cold_best > 0 else None
    warm_strict = _reach(warm["progress"], cold_best) if cold_best > 0 else None
    ratio = (
        warm_point["elapsed_s"] / cold_point["elapsed_s"]
        if warm_point and cold_point and cold_point["elapsed_s"] > 0
        else None
    )
    return {
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "model": "tiny llama-3.2 (hidden 256, 4 layers, vocab 2048; tests/e2e)",
        "old_shape": OLD_TRACE.name,
        "new_shape": NEW_TRACE.name,
        "budget": {"wall_seconds": args.budget_s, "max_experiments": args.max_experiments},
        "tolerance": args.tolerance,
        "runs": runs,
        "cold_final_speedup": cold_best,
        "cold_reached": cold_point,
        "warm_reached": warm_point,
        "warm_reached_strict": warm_strict,
        "time_ratio": ratio,
        "goal": "time_ratio <= 0.30",
        "wall_s": wall,
    }


def _table(result: dict[str, Any]) -> str:
    def cell(point: dict[str, Any] | None) -> str:
        if point is None:
            return "not reached"
        return f"{point['elapsed_s']:.1f} s / {point['experiments']} exp"

    rows = [
        ("run", "final speedup", "reaches cold's final best", "experiments", "reused"),
        ("-" * 5, "-" * 13, "-" * 25, "-" * 11, "-" * 6),
    ]
    for name in ("old", "cold", "warm"):
        r = result["runs"][name]
        reached = {
            "old": "(old shape)",
            "cold": cell(result["cold_reached"]),
            "warm": cell(result["warm_reached"]),
        }[name]
        rows.append(
            (
                name,
                f"{r['best_speedup']:.3f}x",
                reached,
                str(r["experiments_done"]),
                str(r["experiments_reused"]),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    ratio = result["time_ratio"]
    lines.append(
        f"warm / cold time to the cold final best (within {result['tolerance']:.0%}): "
        + (f"{ratio:.0%}" if ratio is not None else "n/a")
        + " (goal <= 30 %)"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=120.0, help="wall seconds per run")
    parser.add_argument("--max-experiments", type=int, default=20)
    parser.add_argument("--tolerance", type=float, default=0.03)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kiln-warm-bench-") as tmp:
        result = _run(args, Path(tmp))
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(_table(result))


if __name__ == "__main__":
    main()
