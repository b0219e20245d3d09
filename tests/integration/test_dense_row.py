"""benchmarks/dense_row.py against a compilation in the real ledger (in-process ledger server
over gRPC, real PostgreSQL): the row's figures come from the compilation's events, the limit
counts the KV cache at the measured context, and the results file keeps one row per model,
batch, context and trace."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kiln.domain.candidate import REFERENCE_CANDIDATE, Candidate
from kiln.ledger.client import LedgerClient
from kiln.ledger.model import NewEvent
from tests.unit.test_baselines_table_limit import KV_PER_TOKEN, LLAMA_1B, WEIGHTS

from ..pki import ServiceLedger  # writes as the services do
from .events_factory import new_id
from .serving import run_command

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
WINNER = Candidate.make({"attention": "sdpa"})
H200_BW = 4.26e12


def _load_dense_row() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dense_row", ROOT / "benchmarks/dense_row.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["dense_row"] = module
    spec.loader.exec_module(module)
    return module


dense_row = _load_dense_row()


async def _experiment(
    client: LedgerClient, cid: str, candidate: Candidate, completed: dict[str, Any], **req: Any
) -> str:
    eid = new_id()
    cand_id = completed.pop("candidate_id", candidate.id)
    common = {"compilation_id": cid, "candidate_id": cand_id}
    await client.append(
        f"experiment-{eid}",
        [
            NewEvent(
                "ExperimentRequested",
                {**common, "candidate": candidate.canonical(), "tier": "full", **req},
            ),
            NewEvent(
                "ExperimentCompleted",
                {
                    **common,
                    "status": "ok",
                    "correct": True,
                    "tier": "full",
                    "weights_bytes": WEIGHTS,
                    "batch_size": 1,
                    "context_len": 7084,
                    "environment": {"dtype": "bfloat16", "device": "cuda"},
                    **completed,
                },
            ),
        ],
    )
    return eid


async def _compilation(client: LedgerClient) -> str:
    """A finished h200 compilation of a Llama-3.2-1B-shaped model at batch 1, context 7,084:
    reference 400 tok/s, gpt_fast 742 (correct), hf_compile incorrect, best 1,000 tok/s;
    prefill medians: reference 71.0 ms, gpt_fast 61.4, hf_compile not timed, best 75.3."""
    cid = new_id()
    stream = f"compilation-{cid}"
    workload = {
        "model": {"name": "llama-3.2-1b", "config_json": json.dumps(LLAMA_1B)},
        "traffic": {"source": "traces/azure_llm_2023_conv.csv", "batch_size": 1,
                    "context_len": 7084},
        "hardware": {"name": "h200", "num_devices": 1},
    }  # fmt: skip
    submitted = {
        "workload_key": "wk-dense",
        "model_name": "llama-3.2-1b",
        "hardware": "h200",
        "workload": workload,
        "budget": {"wall_seconds": 180},
    }
    await client.append(stream, [NewEvent("CompilationSubmitted", submitted)], "no_stream")
    ref = await _experiment(
        client,
        cid,
        REFERENCE_CANDIDATE,
        {"tokens_per_s": 400.0, "median_ms": 2.5, "prefill_median_ms": 71.0},
        agent="confirm",
    )
    await client.append(
        stream,
        [NewEvent("BaselineMeasured", {"experiment_id": ref, "candidate_id":
                  REFERENCE_CANDIDATE.id, "tokens_per_s": 400.0, "median_ms": 2.5})],
    )  # fmt: skip
    for name, tps, correct, prefill in (
        ("gpt_fast", 742.0, True, 61.4),
        ("hf_compile", 470.0, False, 0.0),
    ):
        eid = await _experiment(
            client,
            cid,
            REFERENCE_CANDIDATE,
            {"candidate_id": f"baseline:{name}", "tokens_per_s": tps, "median_ms": 1.0 / tps,
             "correct": correct, "prefill_median_ms": prefill},
            agent=f"compare:{name}",
            baseline=name,
        )  # fmt: skip
        compared = {
            "name": name,
            "experiment_id": eid,
            "status": "ok",  # measured; the engine's own check is the verdict below
            "correct": correct,
            "tokens_per_s": tps,
            "median_ms": 1e3 / tps,
            "batch": 1,
            "weights_bytes": WEIGHTS,
            **({"prefill_median_ms": prefill} if prefill else {}),  # hf_compile: an old event
        }
        await client.append(stream, [NewEvent("BaselineCompared", compared)])
    for status, error in (
        ("crashed", "prefill: OutOfMemoryError: CUDA out of memory. Tried to allocate 9 GiB"),
        ("crashed", "prefill: OutOfMemoryError: CUDA out of memory. Tried to allocate 3 GiB"),
        ("cancelled", "the search ended (the wall-clock budget of 180 s is spent)"),
    ):
        await _experiment(
            client,
            cid,
            Candidate.make({"moe": "dense"}),
            {"status": status, "correct": False, "error": error},
            agent="profiler",
        )
    best = await _experiment(
        client,
        cid,
        WINNER,
        {"tokens_per_s": 1000.0, "median_ms": 1.0, "prefill_median_ms": 75.3},
        agent="confirm",
    )
    improved = {
        "workload_key": "wk-dense",
        "experiment_id": best,
        "candidate_id": WINNER.id,
        "tokens_per_s": 1000.0,
        "median_ms": 1.0,
        "speedup": 2.5,
        "tier": "full",
        "reference_experiment_id": ref,
        "reference_tokens_per_s": 400.0,
        "elapsed_s": 42.0,
        "experiments": 7,
    }
    await client.append(
        stream,
        [
            NewEvent("BestCandidateImproved", improved),
            NewEvent("CompilationEnded", {"status": "succeeded", "reason": "budget spent"}),
        ],
    )
    return cid


async def test_dense_row_from_the_ledger(ledger_addr: str, tmp_path: Path) -> None:
    async with ServiceLedger(ledger_addr, "search") as client:
        cid = await _compilation(client)
        failures: dict[str, int] = {}
        snap, comparison = await dense_row.read_compilation(client, cid, failures)
        with pytest.raises(LookupError):
            await dense_row.read_compilation(client, new_id())
    row = dense_row.dense_row(
        snap, comparison, trace="azure_llm_2023_conv.csv", command="kc", failures=failures
    )
    assert set(row) >= {
        "model", "batch", "context", "trace", "reference", "hf_compile", "gpt_fast",
        "kiln_best", "limit_tok_s", "experiments", "time_to_95_s", "best_candidate",
        "command", "date", "baseline_checks", "prefill_ms", "prefill_check",
    }  # fmt: skip
    assert (row["model"], row["batch"], row["context"]) == ("llama-3.2-1b", 1, 7084)
    assert row["reference"] == 400.0 and row["gpt_fast"] == 742.0
    assert row["hf_compile"] == 470.0  # measured; its verdict is kept beside it
    assert row["baseline_checks"]["hf_compile"].startswith("INCORRECT")
    assert row["baseline_checks"]["gpt_fast"].startswith("correct")
    assert row["kiln_best"] == 1000.0 and row["best_candidate"] == "attention=sdpa"
    assert row["prefill_ms"] == {
        "reference": 71.0, "hf_compile": None, "gpt_fast": 61.4, "kiln_best": 75.3
    }  # fmt: skip
    assert row["prefill_check"].startswith("kiln best prefill 75.30 ms vs 71.00 ms")
    assert "not flagged, the reference's spread is unknown (1 run)" in row["prefill_check"]
    honest = H200_BW / (WEIGHTS + 7084 * KV_PER_TOKEN)
    assert row["limit_tok_s"] == pytest.approx(honest, rel=1e-3)  # not 4.26e12 / weights
    assert "context 7,084" in row["limit"]
    assert row["failures"] == {"crashed: prefill: OutOfMemoryError: CUDA out of memory": 2}
    assert row["experiments"] == 6 and row["time_to_95_s"] == pytest.approx(42.0)
    assert row["command"] == "kc" and row["date"].startswith("20")

    out = tmp_path / "results" / "h200_dense.json"
    dense_row.upsert_row(out, row)
    dense_row.upsert_row(out, {**row, "batch": 30, "kiln_best": 11190.6})
    rows = dense_row.upsert_row(out, {**row, "kiln_best": 1100.0})  # same key: replaced
    assert json.loads(out.read_text()) == rows
    assert [(r["batch"], r["kiln_best"]) for r in rows] == [(30, 11190.6), (1, 1100.0)]


def test_upsert_row_refuses_a_file_that_is_not_a_list(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    out.write_text('{"model": "x"}')
    with pytest.raises(ValueError, match="JSON list"):
        dense_row.upsert_row(out, {"model": "x"})


async def test_dense_row_command_line(ledger_addr: str, tmp_path: Path) -> None:
    async with ServiceLedger(ledger_addr, "search") as client:
        cid = await _compilation(client)
    out = tmp_path / "h200_dense.json"
    args = [cid, "--trace", "conv.csv", "--command", "kiln compile ...", "--out", str(out)]
    addr = ["--ledger-addr", ledger_addr, "--team", "search"]
    script = str(ROOT / "benchmarks/dense_row.py")
    code, text = await run_command(script, *args, *addr)
    assert code == 0, text
    (row,) = json.loads(out.read_text())
    assert row["trace"] == "conv.csv" and row["gpt_fast"] == 742.0
    code, text = await run_command(script, new_id(), *addr[:2], "--out", str(out))
    assert code == 1, text
    assert len(json.loads(out.read_text())) == 1


def test_a_fast_tier_only_compilation_has_no_full_tier_figures() -> None:
    from kiln.baselines.table import Comparison
    from kiln.v1 import common_pb2, compiler_pb2

    comparison = Comparison(REFERENCE_CANDIDATE.id)
    comparison.update("BaselineMeasured", {"tokens_per_s": 6.3, "median_ms": 160.0})
    snap = compiler_pb2.Compilation(
        compilation_id="c-cpu",
        workload=common_pb2.Workload(
            model=common_pb2.ModelSpec(name="llama-3.2-1b"),
            traffic=common_pb2.TrafficShape(batch_size=1, context_len=1085),
            hardware=common_pb2.HardwareTarget(name="cpu"),
        ),
    )
    row = dense_row.dense_row(snap, comparison, trace="conv.csv", command="")
    assert (row["batch"], row["context"]) == (1, 1085)  # the traffic's: nothing measured full
    assert row["reference"] is None and row["kiln_best"] is None
    assert set(row["prefill_ms"].values()) == {None} and row["prefill_check"] == ""
    assert row["limit_tok_s"] is None and row["time_to_95_s"] is None
