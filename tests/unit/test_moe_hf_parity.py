"""kiln's MoE models vs transformers' Qwen3MoeForCausalLM and MixtralForCausalLM.

Qwen3-30B-A3B's and Mixtral-8x7B's real ``config.json`` (``../shared/data/models``), shrunk
(2 layers, hidden 128, vocab 1000, 16 experts top-4 for Qwen3-MoE, Mixtral's own 8 experts
top-2; GQA kept), plus a Qwen3-MoE variant with a dense layer (``decoder_sparse_step`` 2) and no
top-k renormalisation. kiln draws seeded weights (norm scales jittered); transformers (eager
attention and experts) gets the same tensors. Prefill of a right-padded batch and decode steps
must match within 1e-4 in float32; the ``moe`` alternatives must match kiln's reference; and
checkpoints that name experts one by one (Qwen3-MoE's and Mixtral's on-disk names) must load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln.ops.registry import implementations
from kiln.workloads.config import parse_config
from kiln.workloads.models import DecoderModel, build_model
from kiln.workloads.weights import WeightStore, seeded_random
from tests.unit.test_hf_parity import (
    HF_ATOL,
    MODEL_TOL,
    SEQ_LENS,
    VOCAB,
    Case,
    hf_run,
    inputs,
    max_diff_vs_hf,
    run_kiln,
)

transformers = pytest.importorskip("transformers")

MODELS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "models"
pytestmark = pytest.mark.skipif(not MODELS.is_dir(), reason="../shared/data/models is not here")

VARIANTS = {
    "qwen3_moe": (
        "qwen3-30b-a3b.json",
        {"num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 32},
    ),
    "qwen3_moe-sparse2-nonorm": (
        "qwen3-30b-a3b.json",
        {
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 48,
            "decoder_sparse_step": 2,
            "norm_topk_prob": False,
        },
    ),
    "mixtral": ("mixtral-8x7b-v0.1.json", {"intermediate_size": 64}),
}
ALTERNATIVES = [i for i in implementations("moe") if i != "reference"]


def shrunk_moe_config(variant: str) -> dict[str, Any]:
    """The real config, small (GQA ratio and head_dim presence kept)."""
    file, change = VARIANTS[variant]
    raw = json.loads((MODELS / file).read_text())
    ratio = raw["num_attention_heads"] // raw["num_key_value_heads"]
    raw.update(
        num_hidden_layers=2,
        hidden_size=128,
        num_key_value_heads=2,
        num_attention_heads=2 * ratio,
        intermediate_size=96,
        vocab_size=VOCAB,
        bos_token_id=None,
        eos_token_id=None,
    )
    if "head_dim" in raw:
        raw["head_dim"] = 32
    raw.update(change)
    return raw


def jittered(raw: dict[str, Any], dtype: torch.dtype) -> WeightStore:
    store = seeded_random(parse_config(raw), torch.float32, "cpu", seed=0)
    gen = torch.Generator().manual_seed(1)
    for name, t in store.items():
        if name.endswith("norm.weight"):
            t.add_(0.1 * torch.randn(t.shape, generator=gen))
    return WeightStore({n: t.to(dtype) for n, t in store.items()})


def hf_model(raw: dict[str, Any], weights: WeightStore) -> Any:
    config = transformers.AutoConfig.for_model(**raw)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", experts_implementation="eager"
    )
    model = model.float().eval()
    model.load_state_dict(dict(weights.items()), strict=True)
    return model


def kiln(raw: dict[str, Any], weights: WeightStore, dtype: torch.dtype, **kw: Any) -> DecoderModel:
    return build_model(
        parse_config(raw, "shrunk"), dtype=dtype, weights=weights, max_batch=2, max_seq_len=16, **kw
    )


@pytest.fixture(scope="module", params=list(VARIANTS))
def case(request: pytest.FixtureRequest) -> Case:
    c = inputs(shrunk_moe_config(request.param))
    hf = hf_model(c.raw, jittered(c.raw, torch.float32))
    c.hf = [hf_run(hf, c.prompt[b, :n], c.steps[b]) for b, n in enumerate(SEQ_LENS.tolist())]
    return c


def test_layers_are_moe_where_transformers_has_experts(case: Case) -> None:
    model = kiln(case.raw, jittered(case.raw, torch.float32), torch.float32)
    hf = hf_model(case.raw, jittered(case.raw, torch.float32))
    want = ["experts" in dict(layer.mlp.named_children()) for layer in hf.model.layers]
    assert [layer.ffn.op == "moe" for layer in model.slots.layers] == want
    assert any(want)


def test_reference_matches_transformers(case: Case) -> None:
    model = kiln(case.raw, jittered(case.raw, torch.float32), torch.float32)
    logits = run_kiln(model, case)
    assert logits[0].shape == (2, 7, VOCAB) and logits[0].dtype == torch.float32
    assert max_diff_vs_hf(logits, case) <= HF_ATOL


def _per_expert_checkpoint(state: dict[str, torch.Tensor], style: str) -> dict[str, torch.Tensor]:
    """transformers' stacked experts written back one by one, with the family's on-disk names
    (what ``save_pretrained`` of transformers 4 and the Hub checkpoints hold)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        layer, _, rest = name.partition(".mlp.")
        if rest not in ("experts.gate_up_proj", "experts.down_proj", "gate.weight"):
            out[name] = t
            continue
        mod = "block_sparse_moe" if style == "mixtral" else "mlp"
        if rest == "gate.weight":
            out[f"{layer}.{mod}.gate.weight"] = t
            continue
        gate, up, down = (
            ("w1", "w3", "w2") if style == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        )
        for e in range(t.shape[0]):
            base = f"{layer}.{mod}.experts.{e}."
            if rest == "experts.down_proj":
                out[f"{base}{down}.weight"] = t[e].contiguous()
            else:
                g, u = t[e].chunk(2)
                out[f"{base}{gate}.weight"] = g.contiguous()
                out[f"{base}{up}.weight"] = u.contiguous()
    return out


@pytest.mark.parametrize("layout", ["stacked", "per-expert"])
def test_safetensors_checkpoints_load(case: Case, layout: str, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    hf = hf_model(case.raw, jittered(case.raw, torch.float32))
    state = {n: t.contiguous() for n, t in hf.state_dict().items()}
    if layout == "per-expert":
        state = _per_expert_checkpoint(state, case.raw["model_type"])
        assert not any(n.endswith("gate_up_proj") for n in state)
    names = sorted(state)
    save_file({n: state[n] for n in names[::2]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(
        {n: state[n] for n in names[1::2]}, str(tmp_path / "model-00002-of-00002.safetensors")
    )
    model = build_model(
        parse_config(case.raw),
        dtype=torch.float32,
        weights_dir=tmp_path,
        max_batch=2,
        max_seq_len=16,
    )
    assert max_diff_vs_hf(run_kiln(model, case), case) <= HF_ATOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("impl", ALTERNATIVES)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_alternatives_match_reference(variant: str, impl: str, dtype: torch.dtype) -> None:
    case = inputs(shrunk_moe_config(variant))
    weights = jittered(case.raw, dtype)
    reference = run_kiln(kiln(case.raw, weights, dtype), case)
    swapped = run_kiln(kiln(case.raw, weights, dtype, recipe={"moe": impl}), case)
    for want, got in zip(reference, swapped, strict=True):
        scale = float(want.abs().max())
        assert float((got - want).abs().max()) <= MODEL_TOL[dtype] * max(scale, 1.0)
