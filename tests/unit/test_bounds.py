"""Stated ranges: bounded quoting, model-config fields, operating points, plan requests, ledger
arguments (the services' hostile-input behaviour is tests/integration/test_hostile_inputs.py)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from kiln.common.errors import (
    MAX_MESSAGE_CHARS,
    InvalidArgument,
    KilnError,
    OutOfRange,
    quote,
)
from kiln.cost_model.bounds import MAX_DEVICES, check_devices, check_plan_degrees
from kiln.cost_model.hardware import get_hardware
from kiln.cost_model.planner import PlanDeadlineExceeded, plan_workload
from kiln.domain.operating_point import (
    MAX_BATCH,
    MAX_TOKENS,
    OperatingPoint,
    OperatingPointError,
    OperatingPointRangeError,
)
from kiln.ledger.bounds import MAX_POSITION, check_position, check_text, read_count
from kiln.workloads.config import ConfigRangeError, UnsupportedModelError, parse_config
from kiln.workloads.config_bounds import LIMITS

MODELS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "models"
LLAMA = {
    "model_type": "llama",
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def test_quote_and_messages_are_bounded() -> None:
    text = "x" * (1 << 20)
    q = quote(text)
    assert len(q) < 250 and q.endswith(f"({len(text)} characters)")
    assert quote("short") == "'short'"
    err = KilnError("value " + text)
    assert len(err.message) == MAX_MESSAGE_CHARS and "characters, cut" in err.message
    assert issubclass(OutOfRange, InvalidArgument)


@pytest.mark.parametrize(
    ("change", "error", "words"),
    [
        ({"num_hidden_layers": 300_000_000}, ConfigRangeError, "num_hidden_layers"),
        ({"num_hidden_layers": LIMITS["num_hidden_layers"][1] + 1}, ConfigRangeError, "4096"),
        ({"num_attention_heads": 0}, ConfigRangeError, "num_attention_heads = 0"),
        ({"num_key_value_heads": 3}, UnsupportedModelError, "not a multiple"),
        ({"num_key_value_heads": 8}, ConfigRangeError, r"out of range 1\.\.4"),
        ({"hidden_size": float("inf")}, UnsupportedModelError, "whole number"),
        ({"hidden_size": 64.5}, UnsupportedModelError, "whole number"),
        ({"hidden_size": True}, UnsupportedModelError, "whole number"),
        ({"hidden_size": 2}, ConfigRangeError, "head_dim"),  # 2 // 4 heads = 0
        ({"vocab_size": "1000"}, UnsupportedModelError, "whole number"),
        ({"rms_norm_eps": float("nan")}, UnsupportedModelError, "finite"),
        ({"rope_theta": 0}, ConfigRangeError, "rope_theta"),
        ({"rope_scaling": {"factor": float("inf")}}, UnsupportedModelError, "non-finite"),
        ({"quantization_config": "fp8"}, UnsupportedModelError, "JSON object"),
        ({"torch_dtype": ["x"]}, UnsupportedModelError, "torch_dtype"),
    ],
)
def test_config_numbers_have_ranges(
    change: dict[str, object], error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words) as info:
        parse_config({**LLAMA, **change}, "m")
    assert len(str(info.value)) < 400
    assert parse_config({**LLAMA, "hidden_size": 64.0}, "m").hidden_size == 64  # 64.0 is whole


def test_moe_layer_lists_are_checked_against_the_layer_count() -> None:
    moe = {**LLAMA, "model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2}
    moe["moe_intermediate_size"] = 32
    cfg = parse_config({**moe, "mlp_only_layers": [1]}, "m")
    assert [cfg.is_moe_layer(i) for i in range(2)] == [True, False]
    assert cfg.moe_layers_in(range(2)) == 1 and cfg.moe_layers_in(range(1, 2)) == 0
    for change, words in (
        ({"mlp_only_layers": [2]}, r"out of range 0\.\.1"),
        ({"mlp_only_layers": list(range(3))}, "lists 3 layers"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
        ({"num_experts_per_tok": 9}, r"out of range 1\.\.8"),
    ):
        with pytest.raises(UnsupportedModelError, match=words):
            parse_config({**moe, **change}, "m")


def test_operating_point_ranges() -> None:
    OperatingPoint(batch_size=MAX_BATCH, isl=MAX_TOKENS, osl=0, context_len=MAX_TOKENS)
    for kw in (
        {"batch_size": MAX_BATCH + 1},
        {"isl": MAX_TOKENS + 1},
        {"context_len": 2**32 - 1},
        {"expert_load_skew": 1e300},
    ):
        with pytest.raises(OperatingPointRangeError):
            OperatingPoint(**kw)
    with pytest.raises(OperatingPointRangeError, match=r"isl_tokens\.p50"):
        OperatingPoint.from_traffic({"isl_tokens": {"p50": 1e300}})
    with pytest.raises(OperatingPointRangeError, match="mean_concurrency"):
        OperatingPoint.from_traffic({"mean_concurrency": 1e300})
    with pytest.raises(OperatingPointError, match="finite"):
        OperatingPoint.from_traffic({"osl_tokens": {"p50": "Infinity"}})


def test_plan_request_ranges() -> None:
    assert check_devices(MAX_DEVICES) == MAX_DEVICES
    with pytest.raises(OutOfRange, match="num_devices"):
        check_devices(2**32 - 1)
    with pytest.raises(OutOfRange, match=r"plan\.pp"):
        check_plan_degrees({"tp": 1, "pp": MAX_DEVICES + 1}, 1)
    with pytest.raises(OutOfRange, match=r"plan\.batch_size"):
        check_plan_degrees({}, MAX_BATCH + 1)


@pytest.mark.skipif(not MODELS.is_dir(), reason="../shared/data/models is absent")
def test_planning_stops_at_its_deadline() -> None:
    cfg = parse_config(json.loads((MODELS / "deepseek-v3.json").read_text()), "deepseek-v3")
    with pytest.raises(PlanDeadlineExceeded, match="candidate plans for 65536 devices") as info:
        plan_workload(
            cfg,
            get_hardware("h200"),
            OperatingPoint(batch_size=1),
            MAX_DEVICES,
            deadline=time.monotonic() + 0.05,
        )
    # it stopped part-way (the whole enumeration takes ~25x the deadline here); a wall-clock
    # bound would measure the CI host's load, not the planner
    done = re.search(r"costed (\d+) of (\d+)", str(info.value))
    assert done is not None and int(done.group(1)) < int(done.group(2))


def test_ledger_arguments() -> None:
    assert check_position("p", MAX_POSITION) == MAX_POSITION
    with pytest.raises(OutOfRange, match="after_position 9223372036854775808"):
        check_position("after_position", 2**63)
    with pytest.raises(InvalidArgument, match="NUL"):
        check_text("stream_prefix", "a\x00")
    with pytest.raises(InvalidArgument, match="the limit is 1024") as info:
        check_text("filter team", "x" * (1 << 20))
    assert len(info.value.message) < 400
    assert read_count(0, 500) == 500 and read_count(2**32 - 1, 500) == 10_000
