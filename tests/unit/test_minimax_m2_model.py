"""MiniMax-M2 models (per-layer Q/K norms, partial RoPE, sigmoid routing with a correction bias,
every layer MoE, no shared expert) against transformers' ``MiniMaxM2ForCausalLM`` with the same
weights, in float32: prefill (every position) and decode steps on tiny configs (``rotary_dim``
half of ``head_dim``, and the legacy field dropped for ``partial_rotary_factor``); the partial
rope op alone; the real config's KV bytes, weight layout and a 2-layer build over meta tensors;
what is not built, and what the fused decode chain does not run, refused by name.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln.ops.rope import cos_sin_cache, cos_sin_table
from kiln.ops.rope import reference as rope_reference
from kiln.runtime.device_memory import kv_bytes_per_sequence
from kiln.runtime.fused_decode import unsupported_reason
from kiln.runtime.support import support_for
from kiln.workloads.config import parse_config
from kiln.workloads.minimax_m2 import minimax_shapes
from kiln.workloads.models import DecoderModel, StaticKVCache, build_model
from kiln.workloads.models.build import UnbuildableModelError, check_buildable
from kiln.workloads.models.rope_frequencies import inv_freq, rotary_dim
from kiln.workloads.weights import WeightError, WeightStore

from .hf_testing import load_weights, max_logit_diff

transformers = pytest.importorskip("transformers")

MODELS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "models"
TOL = 1e-5
"""Max |logit difference| in float32."""

TINY: dict[str, Any] = {
    "model_type": "minimax_m2",
    "architectures": ["MiniMaxM2ForCausalLM"],
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rotary_dim": 16,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "scoring_func": "sigmoid",
    "use_routing_bias": True,
    "use_qk_norm": True,
    "qk_norm_type": "per_layer",
    "shared_intermediate_size": 0,
    "attn_type_list": [1, 1, 1],
    "use_mtp": True,
    "num_mtp_modules": 3,
    "mtp_transformer_layers": 1,
    "rope_theta": 10000.0,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}

VARIANTS = {
    "rotary_dim": {},
    "partial_rotary_factor": {
        "rotary_dim": None,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
    },
}


def _kiln(raw: dict[str, Any], batch: int = 2, max_len: int = 16) -> DecoderModel:
    config = parse_config(raw, "tiny-minimax")
    model = build_model(config, dtype=torch.float32, seed=3, max_batch=batch, max_seq_len=max_len)
    gen = torch.Generator().manual_seed(7)
    for name in model.weights:  # norms and a selection bias away from their defaults
        t = model.weights[name]
        if name.endswith("e_score_correction_bias"):
            t.copy_(torch.randn(t.shape, generator=gen) * 0.1)
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            t.copy_(1 + torch.randn(t.shape, generator=gen) * 0.2)
    return model


def _hf(raw: dict[str, Any], model: DecoderModel) -> Any:
    kept = {k: v for k, v in raw.items() if k != "model_type" and v is not None}
    hf_config = transformers.MiniMaxM2Config(**kept, bos_token_id=None, eos_token_id=None)
    hf_config._attn_implementation = "eager"
    state = {name: t.clone() for name, t in model.weights.items()}
    return load_weights(transformers.MiniMaxM2ForCausalLM(hf_config), state)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_match_transformers(variant: str) -> None:
    raw = {**TINY, **VARIANTS[variant]}
    model = _kiln(raw)
    hf = _hf(raw, model)
    want_dim = 16 if variant == "rotary_dim" else 8
    assert rotary_dim(model.config) == want_dim
    assert hf.model.rotary_emb.inv_freq.shape == (want_dim // 2,)
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, raw["vocab_size"], (2, 6), generator=gen)
    assert max_logit_diff(model, hf, prompt, steps=4) < TOL


def test_the_layers_use_the_minimax_pieces() -> None:
    """The sites say what the comparison above covers: sigmoid routing with the correction bias,
    no groups or scaling, no shared expert, whole-projection Q/K norm weights."""
    model = _kiln(TINY)
    for layer in model.slots.layers:
        p = layer.ffn.params
        assert layer.ffn.op == "moe" and p["scoring"] == "sigmoid" and layer.shared_ffn is None
        assert p["n_group"] == 1 and p["routed_scaling_factor"] == 1.0 and p["top_k"] == 2
        assert p["correction_bias"] is not None and p["correction_bias"].dtype == torch.float32
        assert layer.q_norm is not None and layer.q_norm.params["weight"].shape == (4 * 32,)
        assert layer.k_norm is not None and layer.k_norm.params["weight"].shape == (2 * 32,)
    no_bias = parse_config({**TINY, "use_routing_bias": False}, "tiny")
    assert (
        build_model(no_bias, dtype=torch.float32).slots.layers[0].ffn.params["correction_bias"]
        is None
    )


def test_partial_rope_rotates_the_leading_dims_only() -> None:
    """Both rope implementations: the first R dims as a full rotary of width R, the rest kept."""
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 4, 5, 32, generator=gen), torch.randn(2, 2, 5, 32, generator=gen)
    positions = torch.randint(0, 16, (2, 5), generator=gen)
    freq = inv_freq(parse_config(TINY, "tiny"))
    assert freq.shape == (8,)
    full_q, full_k = rope_reference(q[..., :16], k[..., :16], positions, inv_freq=freq,
                                    max_positions=16)  # fmt: skip
    table = cos_sin_table({"inv_freq": freq, "max_positions": 16})
    for got_q, got_k in (
        rope_reference(q, k, positions, inv_freq=freq, max_positions=16),
        cos_sin_cache(q, k, positions, **table),
    ):
        assert torch.equal(got_q[..., 16:], q[..., 16:])
        assert torch.equal(got_k[..., 16:], k[..., 16:])
        assert torch.allclose(got_q[..., :16], full_q) and torch.allclose(got_k[..., :16], full_k)
        assert not torch.allclose(got_q[..., :16], q[..., :16])


@pytest.mark.skipif(not MODELS.is_dir(), reason="../shared/data/models is not here")
def test_the_real_config_parses_with_the_right_kv_bytes() -> None:
    raw = json.loads((MODELS / "minimax-m2.7.json").read_text())
    config = parse_config(raw, "minimax-m2.7")
    check_buildable(config)
    assert config.moe is not None and config.moe.num_experts == 256 and config.moe.top_k == 8
    assert config.moe.scoring == "sigmoid" and config.moe.num_shared_experts == 0
    assert all(config.is_moe_layer(i) for i in range(62))
    assert rotary_dim(config) == 64 and config.head_dim == 128
    assert config.kv_elements_per_layer() == 2 * 8 * 128
    assert config.kv_bytes_per_token("bfloat16") == 253_952  # 2 x 8 x 128 x 2 B x 62 layers
    assert kv_bytes_per_sequence(config, 62, 1000, 2) == 253_952 * 1000


@pytest.mark.skipif(not MODELS.is_dir(), reason="../shared/data/models is not here")
def test_the_real_config_has_transformers_layout_and_runs_on_meta() -> None:
    raw = json.loads((MODELS / "minimax-m2.7.json").read_text())
    config = parse_config(raw, "minimax-m2.7").with_layers(2)
    shapes = minimax_shapes(config)
    hf_raw = {k: v for k, v in raw.items() if k not in ("model_type", "quantization_config")}
    hf_config = transformers.MiniMaxM2Config(**{**hf_raw, "num_hidden_layers": 2})
    assert hf_config.rope_parameters["partial_rotary_factor"] == 0.5
    with torch.device("meta"):
        hf = transformers.MiniMaxM2ForCausalLM(hf_config)
    assert {n: tuple(t.shape) for n, t in hf.state_dict().items()} == shapes
    assert sum(torch.Size(s).numel() for s in shapes.values()) == config.param_count() + 2 * 256
    store = WeightStore({n: torch.empty(s, device="meta") for n, s in shapes.items()})
    cache = StaticKVCache.for_config(
        config, max_batch=2, max_len=8, dtype=torch.float32, device="meta"
    )
    model = DecoderModel(config, store, cache)
    tokens = torch.zeros(2, 3, dtype=torch.int64, device="meta")
    positions = torch.zeros(2, 3, dtype=torch.int64, device="meta")
    hidden = model.forward(tokens, positions, torch.zeros(2, dtype=torch.int64, device="meta"))
    assert hidden.shape == (2, 3, 3072)


def test_what_is_not_built_is_refused_by_name() -> None:
    for change, why in (
        ({"scoring_func": "softmax"}, "router scoring 'softmax'"),
        ({"attn_type_list": [0, 1, 1]}, "lightning-attention"),
        ({"shared_intermediate_size": 64}, "shared experts"),
        ({"use_qk_norm": False}, "without Q/K norms"),
        ({"qk_norm_type": "per_head"}, "qk_norm_type 'per_head'"),
        ({"rotary_dim": 15}, "rotary_dim 15"),
        ({"rotary_dim": 64}, "rotary_dim 64"),
    ):
        with pytest.raises(UnbuildableModelError, match=why):
            check_buildable(parse_config({**TINY, **change}, "tiny"))
    with pytest.raises(WeightError, match="not a directory"):  # read: test_fp8_checkpoint_minimax
        build_model(parse_config(TINY, "tiny"), weights_dir="/nonexistent")


def test_the_fused_decode_chain_is_refused_not_wrong() -> None:
    """Its kernels rotate all of head_dim and norm per head: refused, so not in the space."""
    config = parse_config(TINY, "tiny")
    assert "per_layer" in (unsupported_reason(config) or "")
    full = parse_config({**TINY, "rotary_dim": 32}, "tiny")
    assert unsupported_reason(full) is not None
    per_head = dataclasses.replace(config, qk_norm_type="per_head")
    assert "rotates 16 of 32 dims" in (unsupported_reason(per_head) or "")
    gpu = support_for(config, "cuda")
    assert "per_layer" in (gpu.transform_reason("fused_decode") or "")
    assert "mlp" in gpu.unused_ops  # every layer routes, no shared expert


def test_an_engine_checks_and_times_the_family() -> None:
    """The engine's whole path (fast tier, expert-load skew, the routed MoE check, the float64
    reference) on the tiny config: MoE and rope alternatives are correct, fused_decode refused
    with the support statement's reason."""
    from kiln.domain.candidate import Candidate, Transform
    from kiln.runtime.engine import Engine
    from kiln.runtime.request import RunRequest
    from kiln.runtime.spec import EngineLimits, EngineSpec

    from .engine_testing import tiny_workload

    workload = tiny_workload(batch=2, context=8, name="tiny-minimax")
    workload["model"]["config_json"] = json.dumps(TINY)
    workload["traffic"]["expert_zipf_exponent"] = 1.0
    limits = EngineLimits(max_batch=2, max_context=16, fast_layers=2, prompt_len=4, check_steps=2)
    engine = Engine(EngineSpec.from_workload(workload, "fast", limits))
    for recipe in ({}, {"moe": "gathered", "rope": "cos_sin_cache"}, {"moe": "dense"}):
        m = engine.run(RunRequest("exp", Candidate.make(recipe), warmup=1, repeats=2))
        assert m.status == "ok" and m.correct, (recipe, m.error)
        assert any("moe: per-layer check" in note for note in m.notes)
    fused = Candidate.make(transforms=[Transform.of("fused_decode")])
    m = engine.run(RunRequest("exp", fused, warmup=1, repeats=2))
    assert m.status == "rejected" and "per_layer" in (m.error or ""), m.error
