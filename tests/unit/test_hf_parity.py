"""kiln's models vs Hugging Face transformers on the same config and weights.

Llama-3.2-1B's and Qwen3-0.6B's real ``config.json`` (``../shared/data/models``), shrunk for
speed (2 layers, hidden 256, GQA ratio kept, vocab 1000; RoPE settings, llama3 scaling included,
kept). kiln draws seeded weights (norm scales jittered so a swapped norm weight would show);
transformers gets copies of them. Prefill of a right-padded batch of two lengths and decode steps
must match transformers' eager model run per sequence with its own cache; every registered op
alternative must match kiln's reference forward; a safetensors round trip must load the same model.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln.ops.registry import get, implementations, ops
from kiln.workloads.config import parse_config
from kiln.workloads.models import DecoderModel, OpBinding, build_model
from kiln.workloads.weights import WeightStore, seeded_random

transformers = pytest.importorskip("transformers")

MODELS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "models"
pytestmark = pytest.mark.skipif(not MODELS.is_dir(), reason="../shared/data/models is not here")

FILES = {"llama": "llama-3.2-1b.json", "qwen3": "qwen3-0.6b.json"}
VOCAB = 1000
SEQ_LENS = torch.tensor([7, 4])
DECODE_STEPS = 3
HF_ATOL = 1e-4
ALTERNATIVES = [
    (op, i)
    for op in ops()
    for i in implementations(op)
    if i != "reference" and get(op, i).runs_on("cpu") and not get(op, i).lossy
]
# Logits of a swapped op vs the reference forward: float32 only reorders sums; bfloat16 rounds
# intermediates differently (tolerance relative to the largest logit).
MODEL_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def shrunk_config(name: str, *, tie: bool | None = None) -> dict[str, Any]:
    """The real config with small sizes (GQA ratio, head_dim presence and RoPE kept)."""
    raw = json.loads((MODELS / FILES[name]).read_text())
    ratio = raw["num_attention_heads"] // raw["num_key_value_heads"]
    raw.update(
        num_hidden_layers=2,
        hidden_size=256,
        num_key_value_heads=2,
        num_attention_heads=2 * ratio,
        intermediate_size=512,
        vocab_size=VOCAB,
        bos_token_id=None,
        eos_token_id=None,
    )
    if "head_dim" in raw:  # Qwen3's head_dim is not hidden/heads: keep it that way
        raw["head_dim"] = 32 if name == "qwen3" else 256 // raw["num_attention_heads"]
    if tie is not None:
        raw["tie_word_embeddings"] = tie
    return raw


def jittered_weights(raw: dict[str, Any], dtype: torch.dtype) -> WeightStore:
    store = seeded_random(parse_config(raw), torch.float32, "cpu", seed=0)
    gen = torch.Generator().manual_seed(1)
    for name, t in store.items():
        if name.endswith("norm.weight"):
            t.add_(0.1 * torch.randn(t.shape, generator=gen))
    tied = bool(raw.get("tie_word_embeddings"))
    return WeightStore({n: t.to(dtype) for n, t in store.items()}, tied=tied)


def kiln_model(
    raw: dict[str, Any], weights: WeightStore, dtype: torch.dtype, recipe: dict[str, str] | None
) -> DecoderModel:
    return build_model(
        parse_config(raw, "shrunk"),
        dtype=dtype,
        weights=weights,
        max_batch=2,
        max_seq_len=16,
        recipe=recipe,
    )


def hf_model(raw: dict[str, Any], weights: WeightStore) -> Any:
    config = transformers.AutoConfig.for_model(**raw)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model = model.float().eval()  # the config says bfloat16: float32 before loading
    model.load_state_dict(dict(weights.items()), strict=True)
    return model


def hf_run(model: Any, prompt: torch.Tensor, steps: torch.Tensor) -> list[torch.Tensor]:
    """Logits of one sequence (no padding): every prompt position, then each decode step
    (tokens ``steps``), with transformers' own cache."""
    try:
        cache = transformers.DynamicCache(config=model.config)
    except TypeError:  # transformers < 4.56
        cache = transformers.DynamicCache()
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = [model(prompt[None], use_cache=True, **{key: cache}).logits[0]]
        for tok in steps.tolist():
            out.append(model(torch.tensor([[tok]]), use_cache=True, **{key: cache}).logits[0])
    return out


@dataclass
class Case:
    raw: dict[str, Any]
    prompt: torch.Tensor  # [2, 7] right-padded
    steps: torch.Tensor  # [2, DECODE_STEPS] decode inputs
    hf: list[list[torch.Tensor]]  # per sequence: prompt logits, then one per step


def inputs(raw: dict[str, Any]) -> Case:
    """A seeded right-padded prompt batch and decode inputs (no transformers logits yet)."""
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, VOCAB, (2, int(SEQ_LENS.max())), generator=gen)
    steps = torch.randint(0, VOCAB, (2, DECODE_STEPS), generator=gen)
    return Case(raw, prompt, steps, [])


@pytest.fixture(scope="module", params=["llama", "qwen3", "llama-untied"])
def case(request: pytest.FixtureRequest) -> Case:
    """Inputs and transformers' logits for one shrunk config."""
    name = request.param.split("-")[0]
    c = inputs(shrunk_config(name, tie=False if request.param.endswith("untied") else None))
    hf = hf_model(c.raw, jittered_weights(c.raw, torch.float32))
    c.hf = [hf_run(hf, c.prompt[b, :n], c.steps[b]) for b, n in enumerate(SEQ_LENS.tolist())]
    return c


def run_kiln(model: DecoderModel, case: Case) -> list[torch.Tensor]:
    """[prefill logits [2, 7, V], then decode logits [2, V] per step]."""
    out = [model.prefill(case.prompt, SEQ_LENS, all_logits=True)]
    for s in range(DECODE_STEPS):
        out.append(model.decode_step(case.steps[:, s : s + 1]))
    return out


def max_diff_vs_hf(logits: list[torch.Tensor], case: Case) -> float:
    diffs = []
    for b, n in enumerate(SEQ_LENS.tolist()):
        diffs.append((logits[0][b, :n] - case.hf[b][0]).abs().max())
        for s in range(DECODE_STEPS):
            diffs.append((logits[s + 1][b] - case.hf[b][s + 1][-1]).abs().max())
    return float(torch.stack(diffs).max())


def test_reference_matches_transformers(case: Case) -> None:
    model = kiln_model(case.raw, jittered_weights(case.raw, torch.float32), torch.float32, None)
    logits = run_kiln(model, case)
    assert logits[0].shape == (2, 7, VOCAB) and logits[1].shape == (2, VOCAB)
    assert logits[0].dtype == torch.float32
    assert max_diff_vs_hf(logits, case) <= HF_ATOL


def test_safetensors_round_trip(case: Case, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    hf = hf_model(case.raw, jittered_weights(case.raw, torch.float32))
    state = {n: t.contiguous() for n, t in hf.state_dict().items()}
    if case.raw["tie_word_embeddings"]:
        del state["lm_head.weight"]  # shared with the embedding, as save_pretrained does
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
@pytest.mark.parametrize(
    "recipe",
    [{op: impl} for op, impl in ALTERNATIVES] + [dict(ALTERNATIVES)],
    ids=[f"{op}={impl}" for op, impl in ALTERNATIVES] + ["all"],
)
@pytest.mark.parametrize("name", list(FILES))
def test_alternatives_match_reference(
    name: str, recipe: dict[str, str], dtype: torch.dtype
) -> None:
    case = inputs(shrunk_config(name))
    weights = jittered_weights(case.raw, dtype)
    reference = run_kiln(kiln_model(case.raw, weights, dtype, None), case)
    swapped = run_kiln(kiln_model(case.raw, weights, dtype, recipe), case)
    for want, got in zip(reference, swapped, strict=True):
        scale = float(want.abs().max())
        assert float((got - want).abs().max()) <= MODEL_TOL[dtype] * max(scale, 1.0)


def test_rebind_swaps_code_not_weights(case: Case) -> None:
    weights = jittered_weights(case.raw, torch.float32)
    model = kiln_model(case.raw, weights, torch.float32, None)
    before = run_kiln(model, case)
    base = {n: t.data_ptr() for n, t in weights.items()}
    fused = OpBinding.from_recipe({"qkv_proj": "fused", "mlp": "fused_gate_up"})
    model.rebind(fused)
    keys = weights.derived_keys()
    assert len(keys) == 2 * len(model.ops.layers)
    model.rebind(OpBinding.from_recipe())
    model.rebind(fused)
    assert weights.derived_keys() == keys  # computed once, reused on the next rebind
    assert {n: t.data_ptr() for n, t in weights.items()} == base
    after = run_kiln(model, case)
    for a, b in zip(before, after, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
