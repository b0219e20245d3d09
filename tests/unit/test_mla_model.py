"""DeepSeek-V3-architecture models (MLA, group-limited sigmoid routing, shared experts, dense
first layers) against transformers' ``DeepseekV3ForCausalLM`` with the same weights, in float32:
prefill (every position) and decode steps on tiny configs of the family (q LoRA set and null,
YaRN with and without a cos/sin factor, interleaved and plain rope layout); the absorbed MLA
decode against the reference; the latent cache's bytes; the real config's weight layout and a
forward over meta tensors with its real geometry (3 dense layers and 1 MoE layer).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln.ops.mla import absorb, absorbed
from kiln.ops.mla import reference as mla_reference
from kiln.runtime.device_memory import kv_bytes_per_sequence
from kiln.workloads.config import parse_config
from kiln.workloads.mla_weights import mla_shapes
from kiln.workloads.models import DecoderModel, OpBinding, StaticKVCache, build_model
from kiln.workloads.models.build import UnbuildableModelError, check_buildable
from kiln.workloads.models.rope_frequencies import mla_softmax_scale
from kiln.workloads.weights import WeightError, WeightStore

from .hf_testing import load_weights, max_logit_diff

transformers = pytest.importorskip("transformers")

MODELS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "models"
TOL = 1e-5
"""Max |logit difference|: measured 0.6-1.6e-6 (logits up to ~3); a latent norm with the wrong
epsilon (1e-5 for 1e-6) moves them by 4.7e-5."""

TINY: dict[str, Any] = {
    "model_type": "deepseek_v3",
    "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 8,
    "num_experts_per_tok": 3,
    "n_group": 4,
    "topk_group": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "q_lora_rank": 32,
    "kv_lora_rank": 24,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 16,
    },
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,  # the latent norms keep transformers' 1e-6
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}

VARIANTS = {
    "q_lora": {},
    "no_q_lora": {"q_lora_rank": None},
    "yarn_attention_factor": {"rope_scaling": {**TINY["rope_scaling"], "mscale": 0.5}},
    "plain_rope_layout": {"rope_interleave": False, "rope_scaling": None},
}


def _kiln(raw: dict[str, Any], batch: int = 2, max_len: int = 16) -> DecoderModel:
    config = parse_config(raw, "tiny-deepseek")
    model = build_model(config, dtype=torch.float32, seed=3, max_batch=batch, max_seq_len=max_len)
    gen = torch.Generator().manual_seed(7)
    for name in model.weights:  # a selection bias large enough to change choices
        if name.endswith("e_score_correction_bias"):
            bias = model.weights[name]
            bias.copy_(torch.randn(bias.shape, generator=gen) * 0.1)
    return model


def _hf(raw: dict[str, Any], model: DecoderModel) -> Any:
    hf_config = transformers.DeepseekV3Config(**{k: v for k, v in raw.items() if k != "model_type"})
    hf_config._attn_implementation = "eager"
    state = {name: t.clone() for name, t in model.weights.items()}
    return load_weights(transformers.DeepseekV3ForCausalLM(hf_config), state)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_match_transformers(variant: str) -> None:
    raw = {**TINY, **VARIANTS[variant]}
    model = _kiln(raw)
    hf = _hf(raw, model)
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, raw["vocab_size"], (2, 6), generator=gen)
    assert max_logit_diff(model, hf, prompt, steps=4) < TOL


def test_the_routing_is_the_group_limited_one() -> None:
    """The tiny model's layers really pick experts across groups (so the comparison above
    covers group-limited selection and the correction bias)."""
    model = _kiln(TINY)
    site = model.slots.layers[1].ffn
    assert site.op == "moe" and site.params["scoring"] == "sigmoid"
    assert site.params["n_group"] == 4 and site.params["topk_group"] == 2
    assert model.slots.layers[0].ffn.op == "mlp" and model.slots.layers[0].shared_ffn is None
    assert model.slots.layers[1].shared_ffn is not None
    assert model.slots.layers[1].qkv_proj.op == "mla_proj"


def test_absorbed_attention_matches_the_reference() -> None:
    """The op alone on random inputs (a prefill chunk and a decode step over a partly filled
    cache), then whole decode steps of the tiny model bound to it."""
    gen = torch.Generator().manual_seed(5)
    b, h, s, dn, dr, dv, r = 2, 4, 10, 16, 8, 12, 24
    kv_b = torch.randn(h * (dn + dv), r, generator=gen) * 0.2
    params = {"kv_b_weight": kv_b, "nope_dim": dn, "v_dim": dv, "scale": 0.3}
    latent = torch.randn(b, 1, s, r, generator=gen)
    rope = torch.randn(b, 1, s, dr, generator=gen)
    seq_lens = torch.tensor([7, 5])
    for positions in (torch.tensor([[3, 4, 5, 6], [1, 2, 3, 4]]), seq_lens[:, None] - 1):
        t = positions.shape[1]
        q_nope = torch.randn(b, h, t, dn, generator=gen)
        q_rope = torch.randn(b, h, t, dr, generator=gen)
        args = (q_nope, q_rope, latent, rope, positions, seq_lens)
        want = mla_reference(*args, **params)
        got = absorbed(*args, **absorb(params))
        assert got.shape == (b, h, t, dv)
        assert (got - want).abs().max().item() < 1e-5

    ref, model = _kiln(TINY), _kiln(TINY)
    model.rebind(OpBinding.from_recipe({"mla_attention": "absorbed"}))
    prompt = torch.randint(0, TINY["vocab_size"], (2, 5), generator=gen)
    assert (model.prefill(prompt) - ref.prefill(prompt)).abs().max().item() < TOL
    token = prompt[:, -1:]
    for _ in range(3):
        want, got = ref.decode_step(token), model.decode_step(token)
        assert (got - want).abs().max().item() < TOL
        token = want.argmax(-1, keepdim=True)


def test_the_latent_cache_holds_one_latent_and_one_rope_key_per_token() -> None:
    raw = json.loads((MODELS / "deepseek-v3.json").read_text())
    config = parse_config(raw, "deepseek-v3")
    assert config.kv_elements_per_layer() == 512 + 64
    assert config.kv_bytes_per_token("bfloat16") == 70_272  # (512 + 64) x 2 B x 61 layers
    assert kv_bytes_per_sequence(config, 61, 1000, 2) == 70_272 * 1000  # the engine's sizing
    tiny = _kiln(TINY, batch=2, max_len=16)
    cfg = tiny.config
    assert tiny.cache.k[0].shape == (2, 1, 16, 24) and tiny.cache.v[0].shape == (2, 1, 16, 8)
    assert tiny.cache.nbytes() == cfg.kv_bytes_per_token("float32") * 2 * 16


@pytest.mark.skipif(not MODELS.is_dir(), reason="../shared/data/models is not here")
def test_the_real_config_has_transformers_layout_and_runs_on_meta() -> None:
    raw = json.loads((MODELS / "deepseek-v3.json").read_text())
    config = parse_config(raw, "deepseek-v3").with_layers(4)  # 3 dense layers, 1 MoE
    check_buildable(config)
    shapes = mla_shapes(config)
    hf_raw = {k: v for k, v in raw.items() if k not in ("model_type", "quantization_config")}
    hf_config = transformers.DeepseekV3Config(**{**hf_raw, "num_hidden_layers": 4})
    with torch.device("meta"):
        hf = transformers.DeepseekV3ForCausalLM(hf_config)
    assert {n: tuple(t.shape) for n, t in hf.state_dict().items()} == shapes
    assert mla_softmax_scale(config) == pytest.approx(hf.model.layers[0].self_attn.scaling)
    assert sum(torch.Size(s).numel() for s in shapes.values()) == config.param_count() + 256
    store = WeightStore({n: torch.empty(s, device="meta") for n, s in shapes.items()})
    cache = StaticKVCache.for_config(
        config, max_batch=2, max_len=8, dtype=torch.float32, device="meta"
    )
    model = DecoderModel(config, store, cache)
    tokens = torch.zeros(2, 3, dtype=torch.int64, device="meta")
    positions = torch.zeros(2, 3, dtype=torch.int64, device="meta")
    hidden = model.forward(tokens, positions, torch.zeros(2, dtype=torch.int64, device="meta"))
    assert hidden.shape == (2, 3, 7168)


def test_what_is_not_built_is_refused_by_name() -> None:
    for change, why in (
        ({"scoring_func": "softmax"}, "router scoring 'softmax'"),
        ({"topk_method": "greedy"}, "top-k method 'greedy'"),
        ({"n_group": 3}, "8 experts in 3 groups"),
        ({"attention_bias": True}, "MLA with projection biases"),
    ):
        with pytest.raises(UnbuildableModelError, match=why):
            check_buildable(parse_config({**TINY, **change}, "tiny"))
    with pytest.raises(WeightError, match="not a directory"):  # read: test_fp8_checkpoint
        build_model(parse_config(TINY, "tiny"), weights_dir="/nonexistent")
    kimi = parse_config({**TINY, "model_type": "kimi_k2", "n_group": 1, "topk_group": 1}, "kimi")
    check_buildable(kimi)
    assert kimi.mla is not None and kimi.moe is not None and kimi.moe.scoring == "sigmoid"


def test_an_engine_checks_and_times_the_family() -> None:
    """The engine's whole path (fast tier of dense + MoE layer, expert-load skew, the routed MoE
    check, the float64 reference) on a tiny config: MLA and MoE alternatives are correct, what the
    family does not run is refused with the support statement's reason."""
    from kiln.domain.candidate import Candidate, Transform
    from kiln.runtime.engine import Engine
    from kiln.runtime.request import RunRequest
    from kiln.runtime.spec import EngineLimits, EngineSpec

    from .engine_testing import tiny_workload

    workload = tiny_workload(batch=2, context=8, name="tiny-deepseek")
    workload["model"]["config_json"] = json.dumps(TINY)
    workload["traffic"]["expert_zipf_exponent"] = 1.0
    limits = EngineLimits(max_batch=2, max_context=16, fast_layers=2, prompt_len=4, check_steps=2)
    engine = Engine(EngineSpec.from_workload(workload, "fast", limits))
    for recipe in ({}, {"mla_attention": "absorbed"}, {"moe": "gathered", "rope": "cos_sin_cache"}):
        m = engine.run(RunRequest("exp", Candidate.make(recipe), warmup=1, repeats=2))
        assert m.status == "ok" and m.correct, (recipe, m.error)
        assert any("moe: per-layer check" in note for note in m.notes)
    for refused, why in (
        (Candidate.make({"attention": "sdpa"}), "its attention is latent (MLA)"),
        (Candidate.make(transforms=[Transform.of("fused_decode")]), "latent attention (MLA)"),
    ):
        m = engine.run(RunRequest("exp", refused, warmup=1, repeats=2))
        assert m.status == "rejected" and why in (m.error or ""), m.error
