"""Submitted workloads and budgets: validation errors and the workload key."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from kiln.agent_runner.budget import ExperimentBudget, validate_budget
from kiln.agent_runner.workload import build_workload, validate_workload
from kiln.common.errors import InvalidArgument, NotFound
from kiln.v1 import common_pb2

CONFIG = {
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "torch_dtype": "bfloat16",
}


def _workload(config: dict | None = None, **traffic: float) -> common_pb2.Workload:
    shape = {"batch_size": 4, "context_len": 512, **traffic}
    return common_pb2.Workload(
        model=common_pb2.ModelSpec(name="tiny", config_json=json.dumps(config or CONFIG)),
        traffic=common_pb2.TrafficShape(
            isl_tokens=common_pb2.Distribution(p50=100, p90=200, p99=300, mean=120, max=400),
            **shape,  # type: ignore[arg-type]
        ),
        hardware=common_pb2.HardwareTarget(name="cpu"),
    )


def test_key_ignores_config_order_source_and_names() -> None:
    a = validate_workload(_workload())
    reordered = _workload(dict(reversed(list(CONFIG.items()))))
    reordered.traffic.source = "elsewhere.csv"
    reordered.model.name = "other-name"
    reordered.hardware.name = "CPU"
    reordered.hardware.num_devices = 1  # the catalogue default for cpu
    assert validate_workload(reordered).key == a.key
    assert a.key.startswith("wk-") and len(a.key) == 19
    assert a.message.workload_key == a.key and a.hardware == "cpu" and a.devices == 1


def test_key_changes_with_the_workload() -> None:
    base = validate_workload(_workload()).key
    assert validate_workload(_workload(batch_size=8)).key != base
    assert validate_workload(_workload({**CONFIG, "num_hidden_layers": 3})).key != base
    w = _workload()
    w.model.dtype = "float32"
    assert validate_workload(w).key != base


@pytest.mark.parametrize(
    ("workload", "error", "message"),
    [
        (None, InvalidArgument, "workload is missing"),
        (
            common_pb2.Workload(hardware=common_pb2.HardwareTarget(name="cpu")),
            InvalidArgument,
            "workload.model is missing",
        ),
        (_workload({"model_type": "bert"}), InvalidArgument, "unsupported architecture 'bert'"),
        (  # parsed fine, but no engine builds a greedy MLA router yet: refused at submission
            _workload(
                {
                    **CONFIG,
                    "model_type": "deepseek_v3",
                    "n_routed_experts": 8,
                    "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32,
                    "kv_lora_rank": 16,
                    "qk_nope_head_dim": 8,
                    "qk_rope_head_dim": 8,
                    "v_head_dim": 8,
                    "topk_method": "greedy",
                }
            ),
            InvalidArgument,
            "cannot build top-k method 'greedy'",
        ),
        (_workload({**CONFIG, "vocab_size": None}), InvalidArgument, "workload.model"),
        (_workload(batch_size=0), InvalidArgument, "batch_size must be >= 1"),
        (_workload(context_len=0), InvalidArgument, "context_len must be >= 1"),
        (_workload(prefix_hit_rate=1.5), InvalidArgument, "prefix_hit_rate"),
        (_workload(mean_concurrency=float("inf")), InvalidArgument, "mean_concurrency"),
    ],
)
def test_bad_workloads(workload: common_pb2.Workload | None, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        validate_workload(workload)


def test_bad_hardware_dtype_weights_and_percentiles() -> None:
    w = _workload()
    w.hardware.name = "abacus"
    with pytest.raises(NotFound, match="unknown hardware 'abacus'"):
        validate_workload(w)
    w = _workload()
    w.model.dtype = "int3"
    with pytest.raises(InvalidArgument, match="dtype 'int3'"):
        validate_workload(w)
    w = _workload()
    w.model.weights_dir = "/definitely/not/here"
    with pytest.raises(NotFound, match="weights_dir"):
        validate_workload(w)
    w = _workload()
    w.traffic.isl_tokens.p90 = 1000
    with pytest.raises(InvalidArgument, match="out of order"):
        validate_workload(w)
    w = _workload()
    w.ClearField("traffic")
    with pytest.raises(InvalidArgument, match="traffic is missing"):
        validate_workload(w)


def test_build_workload_from_files(tmp_path: Path) -> None:
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(CONFIG))
    trace = tmp_path / "t.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,100,10\n2023-11-16 18:15:47.6805900,300,30\n"
    )
    w = build_workload(cfg, trace, "cpu")
    assert w.model.name == "tiny" and w.traffic.source == "t.csv"
    assert validate_workload(w).key.startswith("wk-")
    with pytest.raises(NotFound, match="trace"):
        build_workload(cfg, tmp_path / "missing.csv", "cpu")
    with pytest.raises(NotFound, match="model config"):
        build_workload(tmp_path / "missing.json", trace, "cpu")
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    with pytest.raises(InvalidArgument, match=r"bad\.csv"):
        build_workload(cfg, bad, "cpu")


@pytest.mark.parametrize("wall", [0.0, -1.0, float("nan"), float("inf"), 31 * 86400.0])
def test_bad_budgets(wall: float) -> None:
    with pytest.raises(InvalidArgument, match="wall_seconds"):
        validate_budget(common_pb2.Budget(wall_seconds=wall))


def test_budget_slots() -> None:
    assert validate_budget(common_pb2.Budget(wall_seconds=1.0)).wall_seconds == 1.0
    with pytest.raises(InvalidArgument, match="budget is missing"):
        validate_budget(None)
    b = ExperimentBudget(limit=2)
    assert b.reserve() and b.reserve() and not b.reserve()
    b.release()
    assert b.reserve()
    b.complete()
    b.complete()
    assert b.spent and not b.reserve()
    unlimited = ExperimentBudget(limit=0)
    assert all(unlimited.reserve() for _ in range(100)) and not unlimited.spent


async def test_acquire_waits_for_a_reserved_slot_given_back() -> None:
    b = ExperimentBudget(limit=2)
    assert b.reserve() and b.reserve()  # every slot reserved, none completed
    waiting = asyncio.create_task(b.acquire())
    await asyncio.sleep(0.01)
    assert not waiting.done()  # a reservation may be given back: wait, do not give up
    b.release()  # e.g. the other agent lost its claim
    assert await asyncio.wait_for(waiting, 1)
    assert b.in_flight == 2


async def test_acquire_gives_up_once_the_budget_is_spent() -> None:
    b = ExperimentBudget(limit=2)
    assert b.reserve() and b.reserve()
    waiting = asyncio.create_task(b.acquire())
    await asyncio.sleep(0.01)
    b.complete()
    await asyncio.sleep(0.01)
    assert not waiting.done()  # one experiment still in flight might fail to be requested
    b.complete()
    assert await asyncio.wait_for(waiting, 1) is False
    assert b.spent and b.in_flight == 0
    assert await ExperimentBudget(limit=0).acquire()  # no limit


async def test_acquire_takes_no_slot_while_the_gate_is_closed() -> None:
    b, gate = ExperimentBudget(limit=3), asyncio.Event()
    waiting = asyncio.create_task(b.acquire(gate))
    await asyncio.sleep(0.01)
    assert not waiting.done() and b.in_flight == 0  # a confirmation holds the gate
    assert b.reserve() and b.reserve()  # ... and takes its slots first
    gate.set()
    assert await asyncio.wait_for(waiting, 1)
    assert b.in_flight == 3
