"""Per-op bytes and roofline times of a decode step, against numbers worked out by hand for
Llama-3.2-1B (config: ../shared/data/models/llama-3.2-1b.json)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kiln.agent_runner.op_roofline import bandwidth_bytes_per_s, op_bytes, roofline_ms
from kiln.common.errors import NotFound
from kiln.workloads.config import MoEConfig, load_config

MODELS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "models"
pytestmark = pytest.mark.skipif(not MODELS.is_dir(), reason="../shared/data/models is not here")


@pytest.fixture(scope="module")
def llama():  # type: ignore[no-untyped-def]
    return load_config(MODELS / "llama-3.2-1b.json")


def test_llama_3_2_1b_weights_add_up_to_its_parameter_count(llama) -> None:  # type: ignore[no-untyped-def]
    # H 2048, I 8192, 32 q heads and 8 kv heads of 64, V 128256, tied embeddings, 16 layers.
    b = op_bytes(llama, layers=16, batch_size=1, context_len=0, dtype_bytes=1)
    assert b["qkv_proj"] == 16 * 2048 * (2048 + 512 + 512)  # 100,663,296
    assert b["o_proj"] == 16 * 2048 * 2048  # 67,108,864
    assert b["mlp"] == 16 * 3 * 2048 * 8192  # 805,306,368
    assert b["rms_norm"] == 16 * 2 * 2048 + 2048  # 67,584
    assert b["lm_head"] == 128256 * 2048  # 262,668,288 (tied: the embedding matrix)
    # Every parameter once: the layers' weights + the (tied) embedding matrix read by lm_head.
    weights = b["qkv_proj"] + b["o_proj"] + b["mlp"] + b["rms_norm"] + b["lm_head"]
    assert weights == 1_235_814_400
    assert b["rope"] == b["sampler"] == 0 and "moe" not in b


def test_llama_3_2_1b_at_batch_8_context_1024_in_bf16(llama) -> None:  # type: ignore[no-untyped-def]
    b = op_bytes(llama, layers=16, batch_size=8, context_len=1024, dtype_bytes=2)
    # K and V, 8 sequences x 1025 positions x 8 kv heads x 64 x 2 bytes, 16 layers
    assert b["attention"] == 2 * 8 * 1025 * 8 * 64 * 2 * 16 == 268_697_600
    assert b["embedding"] == 8 * 2048 * 2
    assert b["mlp"] == 1_610_612_736
    # H200: 4.8 TB/s x 4.26/4.8 achievable = 4.26e12 B/s; mlp 1,610,612,736 B -> 0.3781 ms
    bw, hw = bandwidth_bytes_per_s("h200")
    assert hw.name == "h200" and bw == pytest.approx(4.26e12)
    ms = roofline_ms(b, bw)
    assert ms["mlp"] == pytest.approx(1_610_612_736 / 4.26e12 * 1e3)
    assert ms["mlp"] == pytest.approx(0.37808, rel=1e-4)
    assert ms["attention"] == pytest.approx(0.063075, rel=1e-4)


def test_fast_tier_counts_only_the_layers_held(llama) -> None:  # type: ignore[no-untyped-def]
    two = op_bytes(llama, layers=2, batch_size=1, context_len=10, dtype_bytes=2)
    full = op_bytes(llama, layers=16, batch_size=1, context_len=10, dtype_bytes=2)
    assert two["mlp"] * 8 == full["mlp"] and two["attention"] * 8 == full["attention"]
    assert two["lm_head"] == full["lm_head"]  # not per layer


def test_moe_counts_the_experts_a_step_touches(llama) -> None:  # type: ignore[no-untyped-def]
    moe = dataclasses.replace(llama, moe=MoEConfig(num_experts=8, top_k=2, intermediate_size=1024))
    one = op_bytes(moe, layers=1, batch_size=1, context_len=0, dtype_bytes=1)
    # batch 1: 2 of 8 experts (1 - (1 - 2/8)^1 = 0.25 of 8), router 8 x 2048
    assert one["moe"] == 8 * 2048 + 2 * 3 * 2048 * 1024 and "mlp" not in one
    many = op_bytes(moe, layers=1, batch_size=64, context_len=0, dtype_bytes=1)
    assert many["moe"] == pytest.approx(8 * 2048 + 8 * 3 * 2048 * 1024, rel=1e-6)  # all 8


def test_bad_input_is_refused(llama) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=r"layers 17 is outside 1\.\.16"):
        op_bytes(llama, layers=17, batch_size=1, context_len=0, dtype_bytes=2)
    with pytest.raises(ValueError, match="batch_size >= 1"):
        op_bytes(llama, layers=1, batch_size=0, context_len=0, dtype_bytes=2)
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        roofline_ms({"mlp": 1}, 0.0)
    with pytest.raises(NotFound, match="unknown hardware"):
        bandwidth_bytes_per_s("tpu-v9")
