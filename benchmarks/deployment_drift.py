"""Scenario measurement for issue 15: a deployment on the CPU over a drifting real-trace replay
(Azure conversation then Azure code, or ``--order code-conv`` the other way), timed from the
first drifted window to DriftDetected and to the verdict (CandidatePromoted or
PromotionDeclined).

Needs a running kiln (`kiln up`); uses the CLI and the Deployments API as the CLI's team:

    python benchmarks/deployment_drift.py --model CONFIG [--order conv-code] [--speed 600]
        [--budget 3m]
        [--out benchmarks/results/deployment_drift.json]

Times are wall-clock seconds between the events' ledger timestamps (`recorded_at`); the window
figures are arrival-time seconds of the replay. Prints one JSON object and writes it to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("KILN_SHARED_DATA", ROOT.parent / "shared" / "data")) / "traces"


def kiln(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "kiln", *args], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"kiln {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def history(name: str) -> list[dict]:
    import asyncio

    from google.protobuf.json_format import MessageToDict

    from kiln.cli.context import service_addr
    from kiln.common.client import team_channel
    from kiln.common.settings import load_settings
    from kiln.v1 import deployments_pb2, deployments_pb2_grpc

    async def get() -> deployments_pb2.Deployment:
        s = load_settings()
        async with team_channel(service_addr(s, "agent-runner"), s.team) as ch:
            stub = deployments_pb2_grpc.DeploymentsStub(ch)
            req = deployments_pb2.GetDeploymentRequest(name=name, history=True)
            return await stub.Get(req, timeout=60)

    d = asyncio.run(get())
    return [MessageToDict(e, preserving_proto_field_name=True) for e in d.history]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--order", choices=("conv-code", "code-conv"), default="conv-code")
    ap.add_argument("--speed", default="600")
    ap.add_argument("--budget", default="3m")
    ap.add_argument("--window", default="10m")
    ap.add_argument("--timeout-s", type=float, default=3600)
    ap.add_argument("--out", default="benchmarks/results/deployment_drift.json")
    a = ap.parse_args()
    name = f"drift-{uuid.uuid4().hex[:6]}"
    first, then = DATA / "azure_llm_2023_conv.csv", DATA / "azure_llm_2023_code.csv"
    if a.order == "code-conv":
        first, then = then, first
    kiln("deployments", "create", name, "--model", a.model, "--traffic", str(first),
         "--hardware", "cpu", "--budget", a.budget, "--window", a.window)  # fmt: skip
    deadline = time.monotonic() + a.timeout_s
    while not any(e["type"] == "CandidatePromoted" for e in history(name)):
        if time.monotonic() > deadline:
            raise SystemExit("no initial promotion")
        time.sleep(5)
    kiln("traffic", "observe", name, str(first), "--speed", a.speed)
    kiln("traffic", "observe", name, str(then), "--speed", a.speed, "--close")
    verdicts = ("CandidatePromoted", "PromotionDeclined")
    while True:
        events = history(name)
        after = [e for e in events if e["type"] in verdicts][1:]
        if after or time.monotonic() > deadline:
            break
        time.sleep(5)

    def at(e: dict) -> float:
        from datetime import datetime

        return datetime.fromisoformat(e["recorded_at"].replace("Z", "+00:00")).timestamp()

    windows = [e for e in events if e["type"] == "TrafficWindowObserved"]
    first = next((w for w in windows if w["detail"].get("drifted")), None)
    drift = next((e for e in events if e["type"] == "DriftDetected"), None)
    verdict = after[0] if after else None
    result = {
        "command": " ".join(sys.argv),
        "deployment": name,
        "order": a.order,
        "windows": len(windows),
        "false_triggers_before_change": sum(
            1
            for e in events
            if e["type"] == "DriftDetected"
            and first is not None
            and e["detail"]["window_index"] < first["detail"]["index"]
        ),
        "first_drifted_window": first["detail"]["index"] if first else None,
        "drift_window": drift["detail"]["window_index"] if drift else None,
        "s_first_drifted_to_drift_detected": at(drift) - at(first) if drift and first else None,
        "s_first_drifted_to_verdict": at(verdict) - at(first) if verdict and first else None,
        "verdict": verdict["type"] if verdict else None,
        "verdict_summary": verdict["summary"] if verdict else None,
        "verdict_detail": verdict["detail"] if verdict else None,
    }
    print(json.dumps(result, indent=2))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
