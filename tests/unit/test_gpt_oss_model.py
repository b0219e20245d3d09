"""gpt-oss (sliding-window and full layers, attention sinks, q/k/v/o biases, YaRN, a biased
router with softmax over the top-k logits, experts with biases and the clamped SwiGLU) against
transformers' ``GptOssForCausalLM`` with the same weights, in float32: a prompt longer than the
window (every position) and decode steps past it; the real config's parse, KV bytes and a
2-layer build of its real shape; the implementations that lack sinks, windows or the clamped
SwiGLU refused (binding, support statement, fused_decode).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln.runtime.fused_decode import unsupported_reason
from kiln.runtime.support import support_for
from kiln.workloads.config import parse_config
from kiln.workloads.gpt_oss_weights import to_transformers
from kiln.workloads.models import DecoderModel, build_model
from kiln.workloads.models.binding import BindError
from kiln.workloads.weights import WeightError

from .hf_testing import load_weights, max_logit_diff

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.gpt_oss")

MODELS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "models"
REAL = json.loads((MODELS / "gpt-oss-20b.json").read_text())
TOL = 1e-5
"""Max |logit difference|: measured 3.6-6.1e-6 (logits up to ~5.5)."""

TINY: dict[str, Any] = {
    **{k: v for k, v in REAL.items() if k != "quantization_config"},
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 32,
    "head_dim": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "sliding_window": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "experts_per_token": 2,
    "max_position_embeddings": 512,  # 32 x the 16 tokens YaRN's pre-training length says
    "pad_token_id": None,
    "eos_token_id": None,
    "rope_scaling": {**REAL["rope_scaling"], "original_max_position_embeddings": 16},
    "initializer_range": 0.2,  # large enough that sinks, biases and routing matter
    "swiglu_limit": 0.6,  # small enough that the clamps engage
    "torch_dtype": "float32",
}
VARIANTS = {"yarn": {}, "no_rope_scaling": {"rope_scaling": None}}


def _kiln(raw: dict[str, Any], batch: int = 2, max_len: int = 32) -> DecoderModel:
    config = parse_config(raw, "tiny-gpt-oss")
    return build_model(config, dtype=torch.float32, seed=3, max_batch=batch, max_seq_len=max_len)


def _hf(raw: dict[str, Any], model: DecoderModel) -> Any:
    fields = {k: v for k, v in raw.items() if k != "model_type"}
    if raw.get("rope_scaling") is None:
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": raw["rope_theta"]}
    hf_config = transformers.GptOssConfig(**fields)
    hf_config._attn_implementation = "eager"
    state = to_transformers(model.weights, model.config)
    return load_weights(transformers.GptOssForCausalLM(hf_config), state)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_match_transformers(variant: str) -> None:
    raw = {**TINY, **VARIANTS[variant]}
    model = _kiln(raw)
    hf = _hf(raw, model)
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, raw["vocab_size"], (2, 9), generator=gen)  # > window (4)
    worst = max_logit_diff(model, hf, prompt, steps=5)
    assert worst < TOL, worst


def test_the_semantics_matter() -> None:
    """Without sinks, the window or the clamp the tiny model's logits move well past TOL (so
    the comparison above covers them)."""
    model = _kiln(TINY)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, TINY["vocab_size"], (2, 9), generator=gen)
    with torch.no_grad():
        base = model.prefill(prompt, all_logits=True)
    for change in ({"sliding_window": 64}, {"swiglu_limit": 1e5}):
        other = _kiln({**TINY, **change})
        with torch.no_grad():
            moved = (other.prefill(prompt, all_logits=True) - base).abs().max().item()
        assert moved > 100 * TOL, change
    for name in model.weights:
        if name.endswith("sinks"):
            model.weights[name].fill_(-1e4)  # in place: the bound sites hold these tensors
    with torch.no_grad():
        assert (model.prefill(prompt, all_logits=True) - base).abs().max().item() > 100 * TOL


def test_the_real_config_parses() -> None:
    config = parse_config(REAL, "gpt-oss-20b")
    assert config.model_type == "gpt_oss" and config.attention_bias
    assert config.sliding_window == 128
    assert config.sliding_layers == tuple(range(0, 24, 2))
    assert config.moe is not None and config.moe.num_experts == 32 and config.moe.top_k == 4
    assert config.moe.intermediate_size == 2880 and config.moe.norm_topk_prob
    # 24 layers x 2 (K, V) x 8 KV heads x 64 x 2 bytes: every layer holds the full context.
    assert config.kv_bytes_per_token() == 24 * 2 * 8 * 64 * 2 == 49152
    site = _kiln(TINY).slots.layers
    assert [layer.attention.params["window"] for layer in site] == [4, None, 4, None]


def test_a_two_layer_build_of_the_real_shape() -> None:
    config = parse_config(REAL, "gpt-oss-20b")
    model = build_model(config, layers=2, max_seq_len=16)
    assert model.config.num_hidden_layers == 2
    assert any("mxfp4" in note for note in model.weights.notes)
    gate_up = model.weights["model.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up.shape == (32, 2 * 2880, 2880) and gate_up.dtype == torch.bfloat16
    with torch.no_grad():
        logits = model.prefill(torch.tensor([[1, 2, 3]]))
    assert logits.shape[-1] == 201088 and torch.isfinite(logits).all()


def test_checkpoints_are_read() -> None:
    """A directory is read (MXFP4 experts dequantized: test_mxfp4_checkpoint); a missing one is
    a WeightError."""
    with pytest.raises(WeightError, match="not a directory"):
        build_model(parse_config(REAL, "gpt-oss-20b"), layers=1, weights_dir="/nonexistent")


@pytest.mark.parametrize("recipe", [{"attention": "sdpa"}, {"moe": "gathered"}, {"moe": "dense"}])
def test_implementations_without_the_semantics_are_refused(recipe: dict[str, str]) -> None:
    with pytest.raises(BindError):
        build_model(parse_config(TINY, "tiny-gpt-oss"), dtype=torch.float32, recipe=recipe)


def test_the_support_statement_refuses_them() -> None:
    for device in ("cpu", "cuda"):
        support = support_for(REAL, device, name="gpt-oss-20b")
        for op, impl in (
            ("attention", "sdpa"), ("moe", "gathered"), ("moe", "dense"), ("moe", "triton_gather"),
        ):  # fmt: skip
            assert support.op_reason(op, impl), (device, op, impl)
        # The decode kernel takes sinks and window: refused on CPU for its device only.
        reason = support.op_reason("attention", "flash_decoding")
        assert reason is None if device == "cuda" else "cuda only" in (reason or "")
        assert support.op_reason("qkv_proj", "fused") is None
        assert support.transform_reason("fused_decode")
    assert "sinks" in (unsupported_reason(parse_config(REAL, "gpt-oss-20b")) or "")
