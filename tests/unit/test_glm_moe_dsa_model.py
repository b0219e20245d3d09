"""GLM-5 (``glm_moe_dsa``: DeepSeek-V3's MLA and MoE plus the sparse-attention indexer) against
transformers' ``GlmMoeDsaForCausalLM`` with the same weights, in float32, on a tiny config of the
family whose ``index_topk`` is below the sequence length: prefill (every position) and greedy
decode steps, eager and SDPA masks; the selection really matters (the same weights with top-k >=
the sequence give other logits, equal to transformers' at that top-k); the absorbed MLA decode
with the selection; the cache's bytes (latent + rope key + index key) for glm-5.json; the real
config's weight layout and a meta forward of its real geometry (3 dense layers and 1 MoE layer).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln.runtime.device_memory import kv_bytes_per_sequence
from kiln.workloads.config import parse_config
from kiln.workloads.glm_moe_dsa_weights import glm_shapes
from kiln.workloads.models import DecoderModel, OpBinding, StaticKVCache, build_model
from kiln.workloads.models.build import check_buildable
from kiln.workloads.models.rope_frequencies import mla_softmax_scale
from kiln.workloads.weights import WeightStore

from .hf_testing import load_weights, max_logit_diff

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.glm_moe_dsa")

MODELS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "models"
TOL = 1e-5
"""Max |logit difference|: measured 1.3e-6 (logits up to ~3); a wrong choice of slots moves
them by ~3 (:func:`test_the_selection_changes_the_logits`)."""

TINY: dict[str, Any] = {
    "model_type": "glm_moe_dsa",
    "architectures": ["GlmMoeDsaForCausalLM"],
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 8,
    "num_experts_per_tok": 3,
    "n_group": 1,
    "topk_group": 1,
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
    "head_dim": 8,
    "index_n_heads": 8,
    "index_head_dim": 16,
    "index_topk": 3,
    "indexer_rope_interleave": True,
    "rope_interleave": True,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}
PROMPT_LEN, STEPS = 6, 4
"""A 6-token prompt and 4 decode steps: queries see up to 10 slots, the indexer keeps 3."""


def _kiln(raw: dict[str, Any], batch: int = 2, max_len: int = 16) -> DecoderModel:
    config = parse_config(raw, "tiny-glm")
    model = build_model(config, dtype=torch.float32, seed=3, max_batch=batch, max_seq_len=max_len)
    gen = torch.Generator().manual_seed(7)
    for name in model.weights:  # a selection bias and a key-norm bias that change results
        if name.endswith(("e_score_correction_bias", "indexer.k_norm.bias")):
            t = model.weights[name]
            t.copy_(torch.randn(t.shape, generator=gen) * 0.1)
    return model


def _hf(raw: dict[str, Any], model: DecoderModel, attn: str = "eager") -> Any:
    hf_config = transformers.GlmMoeDsaConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    hf_config._attn_implementation = attn
    state = {name: t.clone() for name, t in model.weights.items()}
    return load_weights(transformers.GlmMoeDsaForCausalLM(hf_config), state)


def _prompt() -> torch.Tensor:
    gen = torch.Generator().manual_seed(11)
    return torch.randint(0, TINY["vocab_size"], (2, PROMPT_LEN), generator=gen)


YARN = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32, "beta_slow": 1,
    "mscale": 0.5, "mscale_all_dim": 1.0, "original_max_position_embeddings": 16,
}  # fmt: skip
"""YaRN with a cos/sin factor != 1 (it scales the indexer's rotated dims too)."""


@pytest.mark.parametrize(("attn", "rope"), [("eager", None), ("sdpa", None), ("eager", YARN)])
def test_prefill_and_decode_match_transformers(attn: str, rope: dict[str, Any] | None) -> None:
    raw = {**TINY, "rope_parameters": rope} if rope else TINY
    model = _kiln(raw)
    assert max_logit_diff(model, _hf(raw, model, attn), _prompt(), steps=STEPS) < TOL


def test_the_selection_changes_the_logits() -> None:
    """Top-3 of up to 10 slots against top-64 (every slot): other logits, and the dense kiln
    model still matches transformers at that top-k (so the parity above covers a selection)."""
    sparse, dense = _kiln(TINY), _kiln({**TINY, "index_topk": 64})
    prompt = _prompt()
    a = sparse.prefill(prompt, all_logits=True)
    b = dense.prefill(prompt, all_logits=True)
    assert (a[:, : TINY["index_topk"]] - b[:, : TINY["index_topk"]]).abs().max() < TOL
    assert (a - b).abs().max().item() > 0.1
    dense = _kiln({**TINY, "index_topk": 64})
    assert max_logit_diff(dense, _hf({**TINY, "index_topk": 64}, dense), prompt, STEPS) < TOL


def test_every_layer_runs_the_indexer() -> None:
    model = _kiln(TINY)
    for i, layer in enumerate(model.slots.layers):
        assert layer.index_proj is not None and layer.index_proj.op == "dsa_index_proj"
        assert layer.indexer is not None and layer.indexer.params["topk"] == 3
        assert layer.attention.call_params == ("topk_indices",)
        assert (layer.shared_ffn is not None) == (i >= 1)
    assert model.slots.layers[1].ffn.params["routed_scaling_factor"] == 2.5


def test_absorbed_attention_takes_the_selection() -> None:
    gen = torch.Generator().manual_seed(5)
    ref, model = _kiln(TINY), _kiln(TINY)
    model.rebind(OpBinding.from_recipe({"mla_attention": "absorbed", "rope": "cos_sin_cache"}))
    prompt = torch.randint(0, TINY["vocab_size"], (2, 5), generator=gen)
    assert (model.prefill(prompt) - ref.prefill(prompt)).abs().max().item() < TOL
    token = prompt[:, -1:]
    for _ in range(3):
        want, got = ref.decode_step(token), model.decode_step(token)
        assert (got - want).abs().max().item() < TOL
        token = want.argmax(-1, keepdim=True)


@pytest.mark.skipif(not MODELS.is_dir(), reason="../shared/data/models is not here")
def test_the_cache_holds_the_latent_the_rope_key_and_the_index_key() -> None:
    config = parse_config(json.loads((MODELS / "glm-5.json").read_text()), "glm-5")
    assert config.dsa is not None and config.dsa.topk == 2048
    assert config.kv_elements_per_layer() == 512 + 64 + 128
    assert config.kv_bytes_per_token("bfloat16") == 109_824  # (512 + 64 + 128) x 2 B x 78
    assert kv_bytes_per_sequence(config, 78, 1000, 2) == 109_824 * 1000  # the engine's sizing
    tiny = _kiln(TINY, batch=2, max_len=16)
    assert tiny.cache.k[0].shape == (2, 1, 16, 24) and tiny.cache.v[0].shape == (2, 1, 16, 8 + 16)
    assert tiny.cache.nbytes() == tiny.config.kv_bytes_per_token("float32") * 2 * 16


@pytest.mark.skipif(not MODELS.is_dir(), reason="../shared/data/models is not here")
def test_the_real_config_has_transformers_layout_and_runs_on_meta() -> None:
    raw = json.loads((MODELS / "glm-5.json").read_text())
    config = parse_config(raw, "glm-5").with_layers(4)  # 3 dense layers, 1 MoE
    check_buildable(config)
    shapes = glm_shapes(config)
    hf_raw = {k: v for k, v in raw.items() if k != "model_type"}
    hf_config = transformers.GlmMoeDsaConfig(**{**hf_raw, "num_hidden_layers": 4})
    with torch.device("meta"):
        hf = transformers.GlmMoeDsaForCausalLM(hf_config)
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
    assert hidden.shape == (2, 3, 6144)


def test_random_weights_are_seeded_and_transformers_dtypes() -> None:
    config = parse_config(TINY, "tiny-glm")
    a = build_model(config, dtype=torch.bfloat16, seed=1).weights
    b = build_model(config, dtype=torch.bfloat16, seed=1).weights
    name = "model.layers.0.self_attn.indexer.weights_proj.weight"
    assert a[name].dtype == torch.float32  # transformers' _keep_in_fp32_modules
    assert a["model.layers.0.self_attn.indexer.wk.weight"].dtype == torch.bfloat16
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_an_engine_checks_and_times_the_family() -> None:
    """The engine's whole path (fast tier of a dense and an MoE layer, its random-filled cache
    with index keys, the float64 reference) on the tiny config: the reference and the absorbed
    MLA are correct; what the family does not run is refused with the support statement's
    reason."""
    from kiln.domain.candidate import Candidate, Transform
    from kiln.runtime.engine import Engine
    from kiln.runtime.request import RunRequest
    from kiln.runtime.spec import EngineLimits, EngineSpec

    from .engine_testing import tiny_workload

    workload = tiny_workload(batch=2, context=8, name="tiny-glm")
    workload["model"]["config_json"] = json.dumps(TINY)
    limits = EngineLimits(max_batch=2, max_context=16, fast_layers=2, prompt_len=4, check_steps=2)
    engine = Engine(EngineSpec.from_workload(workload, "fast", limits))
    for recipe in ({}, {"mla_attention": "absorbed", "rope": "cos_sin_cache"}):
        m = engine.run(RunRequest("exp", Candidate.make(recipe), warmup=1, repeats=2))
        assert m.status == "ok" and m.correct, (recipe, m.error)
    for refused, why in (
        (Candidate.make({"attention": "sdpa"}), "its attention is latent (MLA)"),
        (Candidate.make(transforms=[Transform.of("fused_decode")]), "latent attention (MLA)"),
    ):
        m = engine.run(RunRequest("exp", refused, warmup=1, repeats=2))
        assert m.status == "rejected" and why in (m.error or ""), m.error


def test_a_ragged_batch_decodes_as_its_sequences_alone() -> None:
    """Right-padded prompts (6 and 4 tokens): each row's greedy continuation equals its own
    batch-of-one run, so the indexer never selects padding or another row's slots."""
    prompt = _prompt()
    both = _kiln(TINY).generate(prompt, torch.tensor([6, 4]), steps=4)
    first = _kiln(TINY, batch=1).generate(prompt[:1], steps=4)
    second = _kiln(TINY, batch=1).generate(prompt[1:, :4], steps=4)
    assert torch.equal(both, torch.cat((first, second)))
