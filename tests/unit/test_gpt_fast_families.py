"""The gpt-fast baseline model (kiln.baselines.gpt_fast_model) on every dense family kiln builds,
against kiln's reference forward on the same weights, float32 on the CPU.

Tiny configs shaped like the real ones (``../shared/data/models``): Llama with GQA, ``llama3``
RoPE scaling (an original context of 16 so the scaling changes short prompts) and a tied or
untied LM head; Qwen3 with per-head q/k RMSNorm and ``heads x head_dim != hidden``; head dims 64,
128 and 256. Norm weights are jittered (all ones would hide a skipped or swapped norm). Each
case: a batch of two prompts prefilled (logits of every position), then decode steps. Negative
controls show the comparison can fail: without the q/k norms, or without the RoPE scaling, the
same weights give different logits. The real configs: dense ones build, MoE/MLA/biased ones are
skipped with a reason.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln.baselines import gpt_fast, gpt_fast_model
from kiln.workloads.config import ModelConfig, MoEConfig, load_config, parse_config
from kiln.workloads.models import build_model
from kiln.workloads.weights import WeightStore, seeded_random

MODELS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "models"
VOCAB = 101
BATCH, PROMPT, STEPS = 2, 9, 4
RTOL = 1e-5  # float32: summation order only (observed 5e-7 to 7e-7 of the largest logit)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def raw_config(family: str, **over: Any) -> dict[str, Any]:
    """A tiny config of ``family`` (2 layers, vocab 101), ``over`` replacing fields."""
    raw: dict[str, Any] = {
        "model_type": family,
        "vocab_size": VOCAB,
        "hidden_size": 128,
        "intermediate_size": 192,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6 if family == "qwen3" else 5e5,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "initializer_range": 0.05,
    }
    if family == "llama":
        raw["rope_scaling"] = LLAMA3_ROPE
    raw.update(over)
    return raw


CASES: dict[str, dict[str, Any]] = {
    # Llama-3.2-1B-like: GQA 4:1, head_dim 64, tied head
    "llama-d64-tied": raw_config("llama", hidden_size=256, num_key_value_heads=1, head_dim=64),
    # Llama-3.1-8B-like: untied head, head_dim 128
    "llama-d128-untied": raw_config(
        "llama", hidden_size=512, head_dim=128, tie_word_embeddings=False
    ),
    "llama-d256": raw_config("llama", hidden_size=512, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=256),
    # Qwen3-0.6B-like: heads x head_dim (4 x 64 = 256) wider than hidden (128), tied
    "qwen3-d64-wide": raw_config("qwen3", head_dim=64),
    # Qwen3-8B-like: head_dim 128, untied, 4 x 128 = 512 vs hidden 256
    "qwen3-d128-untied": raw_config(
        "qwen3", hidden_size=256, head_dim=128, tie_word_embeddings=False
    ),
    "qwen3-d256": raw_config("qwen3", num_attention_heads=2, num_key_value_heads=1, head_dim=256),
}  # fmt: skip


def jittered(config: ModelConfig, seed: int = 0) -> WeightStore:
    """kiln's seeded float32 weights with every norm scale jittered (distinct per norm)."""
    store = seeded_random(config, torch.float32, "cpu", seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    for name, t in store.items():
        if name.endswith("norm.weight"):
            t.add_(0.3 * torch.randn(t.shape, generator=gen))
    return store


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """``prompt [B, P]`` and decode tokens ``[STEPS, B, 1]``, int64."""
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(VOCAB, (BATCH, PROMPT), generator=gen)
    return prompt, torch.randint(VOCAB, (STEPS, BATCH, 1), generator=gen)


def kiln_logits(config: ModelConfig, store: WeightStore) -> list[torch.Tensor]:
    """kiln's reference: prefill logits ``[B, P, V]``, then ``[B, V]`` per decode step."""
    prompt, tokens = inputs()
    model = build_model(
        config, weights=store, dtype=torch.float32, max_batch=BATCH, max_seq_len=PROMPT + STEPS
    )
    out = [model.prefill(prompt, all_logits=True)]
    out += [model.decode_step(tokens[s]) for s in range(STEPS)]
    return out


def gpt_fast_logits(config: ModelConfig, store: WeightStore, decode: Any = None) -> list[Any]:
    """The gpt-fast model's logits in the layout of :func:`kiln_logits`; ``decode`` replaces
    :func:`gpt_fast_model.decode_one_token` (e.g. a compiled one)."""
    prompt, tokens = inputs()
    step = decode or gpt_fast_model.decode_one_token
    model = gpt_fast_model.GptFastTransformer(config, store, BATCH, PROMPT + STEPS)
    with torch.no_grad():
        out = [model(prompt, torch.arange(PROMPT)).float()]
        for s in range(STEPS):
            out.append(step(model, tokens[s], torch.tensor([PROMPT + s])))
    return out


def max_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> tuple[float, float]:
    """``(max |got - want|, max |want|)`` over every compared logit."""
    assert [g.shape for g in got] == [w.shape for w in want]
    err = max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True))
    return err, max(float(w.abs().max()) for w in want)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_kiln_reference(name: str) -> None:
    config = parse_config(CASES[name], name)
    assert config.qk_norm == name.startswith("qwen3")
    store = jittered(config)
    want = kiln_logits(config, store)
    got = gpt_fast_logits(config, store)
    assert got[0].shape == (BATCH, PROMPT, VOCAB) and got[1].shape == (BATCH, VOCAB)
    assert all(g.dtype == torch.float32 for g in got)
    err, scale = max_error(got, want)
    assert err <= RTOL * scale, (err, scale)


def test_qwen3_without_its_qk_norms_differs() -> None:
    config = parse_config(CASES["qwen3-d64-wide"], "q")
    store = jittered(config)
    want = kiln_logits(config, store)
    err, scale = max_error(gpt_fast_logits(replace(config, qk_norm=False), store), want)
    assert err > 100 * RTOL * scale  # the q/k norms are applied, and matter here


def test_qwen3_with_swapped_qk_norms_differs() -> None:
    config = parse_config(CASES["qwen3-d128-untied"], "q")
    store = jittered(config)
    want = kiln_logits(config, store)
    for i in range(config.num_hidden_layers):
        a = f"model.layers.{i}.self_attn."
        q, k = store[a + "q_norm.weight"].clone(), store[a + "k_norm.weight"].clone()
        store[a + "q_norm.weight"].copy_(k)
        store[a + "k_norm.weight"].copy_(q)
    err, scale = max_error(gpt_fast_logits(config, store), want)
    assert err > 100 * RTOL * scale


def test_llama_without_its_rope_scaling_differs() -> None:
    config = parse_config(CASES["llama-d64-tied"], "l")
    store = jittered(config)
    want = kiln_logits(config, store)
    plain = parse_config({**CASES["llama-d64-tied"], "rope_scaling": None}, "l")
    err, scale = max_error(gpt_fast_logits(plain, store), want)
    assert err > 100 * RTOL * scale  # llama3 scaling changes these positions' angles


def test_untied_head_is_the_lm_head_weight() -> None:
    config = parse_config(CASES["llama-d128-untied"], "l")
    store = jittered(config)
    model = gpt_fast_model.GptFastTransformer(config, store, 1, 4)
    assert model.output is store["lm_head.weight"]
    assert model.output is not store["model.embed_tokens.weight"]
    tied = parse_config(CASES["llama-d64-tied"], "t")
    tied_store = jittered(tied)
    tied_model = gpt_fast_model.GptFastTransformer(tied, tied_store, 1, 4)
    assert tied_model.output is tied_store["model.embed_tokens.weight"]


def test_compiles_in_one_graph_and_agrees() -> None:
    # dynamo alone (no inductor): a graph break or host sync in the step fails fullgraph
    torch._dynamo.reset()
    config = parse_config(CASES["qwen3-d64-wide"], "q")
    store = jittered(config)
    step = torch.compile(gpt_fast_model.decode_one_token, backend="eager", fullgraph=True)
    err, scale = max_error(gpt_fast_logits(config, store, step), gpt_fast_logits(config, store))
    assert err <= RTOL * scale


@pytest.mark.parametrize(
    ("over", "why"),
    [
        ({"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
         "dense Llama and Qwen3 only"),
        ({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
          "moe_intermediate_size": 64}, "dense Llama and Qwen3 only"),
        ({"attention_bias": True}, "biases"),
        ({"mlp_bias": True}, "biases"),
    ],
    ids=["mixtral", "qwen3_moe", "attention_bias", "mlp_bias"],
)  # fmt: skip
def test_refuses_what_it_cannot_build(over: dict[str, Any], why: str) -> None:
    config = parse_config({**CASES["qwen3-d64-wide"], **over}, "x")
    reason = gpt_fast_model.unsupported(config)
    assert reason is not None and why in reason
    with pytest.raises(ValueError, match=why):
        gpt_fast_model.GptFastTransformer(config, WeightStore({}), 1, 4)
    result = gpt_fast.run(
        config, batch=1, context=4, device="cpu", dtype=torch.float32, seed=0, steps=1, warmup=0
    )
    assert result.status == "skipped" and why in result.skipped_reason
    assert result.skipped_reason.startswith("gpt-fast baseline")


def test_moe_flag_alone_is_refused() -> None:
    # a Llama-typed config with experts attached is still not dense
    config = parse_config(CASES["llama-d64-tied"], "l")
    moe = replace(config, moe=MoEConfig(num_experts=4, top_k=2, intermediate_size=64))
    assert "mixture of experts" in (gpt_fast_model.unsupported(moe) or "")


@pytest.mark.skipif(not MODELS.is_dir(), reason="../shared/data/models is not here")
def test_real_configs_dense_build_others_are_skipped() -> None:
    dense = {"llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "qwen3-0.6b", "qwen3-8b"}
    seen = set()
    for path in sorted(MODELS.glob("*.json")):
        try:
            config = load_config(path)
        except ValueError:
            continue  # an architecture kiln does not parse at all
        seen.add(path.stem)
        reason = gpt_fast_model.unsupported(config)
        if path.stem in dense:
            assert reason is None, (path.stem, reason)
        else:
            assert reason is not None, path.stem
    assert dense <= seen
    qwen = json.loads((MODELS / "qwen3-0.6b.json").read_text())
    assert qwen["num_attention_heads"] * qwen["head_dim"] != qwen["hidden_size"]


@pytest.mark.parametrize("name", ["qwen3-d64-wide", "llama-d64-tied"])
def test_bfloat16_baseline_run_is_correct(name: str) -> None:
    result = gpt_fast.run(
        parse_config(CASES[name], name), batch=2, context=12, device="cpu",
        dtype=torch.bfloat16, seed=5, steps=2, warmup=1, compile_mode=None,
    )  # fmt: skip
    assert result.status == "ok" and result.correct, (result.error, result.notes)
    assert result.max_abs_error <= result.tolerance
    assert any(("q/k norms" in n) == name.startswith("qwen3") for n in result.notes[1:])
