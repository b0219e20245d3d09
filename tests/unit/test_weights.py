"""Weight store, seeded weights and the safetensors loader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kiln.workloads.config import ModelConfig, parse_config
from kiln.workloads.weights import (
    LM_HEAD,
    WeightError,
    WeightStore,
    expected_shapes,
    load_safetensors,
    seeded_random,
)

TINY = {
    "model_type": "qwen3",
    "vocab_size": 50,
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "tie_word_embeddings": True,
}


def _config(**overrides: object) -> ModelConfig:
    return parse_config({**TINY, **overrides}, "tiny")


def test_seeded_random_is_deterministic_and_prefix_stable() -> None:
    cfg = _config()
    a = seeded_random(cfg, torch.float32, "cpu", seed=3)
    b = seeded_random(cfg, torch.float32, "cpu", seed=3)
    c = seeded_random(cfg, torch.float32, "cpu", seed=4)
    fast = seeded_random(cfg.with_layers(1), torch.float32, "cpu", seed=3)
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(a[name], b[name]) and not torch.equal(a[name], c[name])
    assert torch.equal(fast[name], a[name])
    assert "model.layers.1.mlp.up_proj.weight" not in fast
    assert torch.equal(a["model.layers.2.self_attn.q_norm.weight"], torch.ones(8))
    assert 0.015 < float(a[name].std()) < 0.025  # initializer_range 0.02


def test_tied_head_is_the_embedding_and_counted_once() -> None:
    store = seeded_random(_config(), torch.bfloat16, "cpu")
    assert store[LM_HEAD] is store["model.embed_tokens.weight"]
    assert store[LM_HEAD].dtype == torch.bfloat16
    untied = seeded_random(_config(tie_word_embeddings=False), torch.bfloat16, "cpu")
    assert untied.nbytes() == store.nbytes() + 50 * 16 * 2


def test_derived_is_computed_once_per_transform_and_site() -> None:
    store = WeightStore({"w": torch.ones(2)})
    calls: list[str] = []

    def make(tag: str) -> torch.Tensor:
        calls.append(tag)
        return store["w"] * 2

    first = store.derived("double", "a", lambda: make("a"))
    assert store.derived("double", "a", lambda: make("again")) is first
    store.derived("double", "b", lambda: make("b"))
    assert calls == ["a", "b"]
    assert store.derived_nbytes() == 2 * 2 * 4
    store.drop_derived("double")
    assert store.derived_keys() == []
    with pytest.raises(WeightError, match="'nope'"):
        store["nope"]


def _save(cfg: ModelConfig, path: Path, shards: int = 2, **changes: torch.Tensor) -> None:
    store = seeded_random(cfg, torch.float32, "cpu", seed=1)
    tensors = {n: t.clone() for n, t in store.items() if n in expected_shapes(cfg)}
    tensors.update(changes)
    names = sorted(tensors)
    for i in range(shards):
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, str(path / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"))


def test_load_sharded_casts_and_truncates(tmp_path: Path) -> None:
    cfg = _config()
    _save(cfg, tmp_path)
    store = load_safetensors(tmp_path, cfg.with_layers(2), torch.bfloat16, "cpu")
    want = seeded_random(cfg, torch.float32, "cpu", seed=1)
    name = "model.layers.1.self_attn.k_proj.weight"
    assert store[name].dtype == torch.bfloat16
    assert torch.equal(store[name], want[name].to(torch.bfloat16))
    assert "model.layers.2.self_attn.k_proj.weight" not in store
    assert store[LM_HEAD] is store["model.embed_tokens.weight"]


def test_load_errors_name_the_tensors(tmp_path: Path) -> None:
    cfg = _config()
    with pytest.raises(WeightError, match=r"no \*\.safetensors"):
        load_safetensors(tmp_path, cfg)
    with pytest.raises(WeightError, match="not a directory"):
        load_safetensors(tmp_path / "absent", cfg)
    _save(cfg, tmp_path, shards=1, **{"model.layers.0.mlp.up_proj.weight": torch.zeros(24, 17)})
    with pytest.raises(WeightError, match=r"up_proj.weight has shape \[24, 17\].*\[24, 16\]"):
        load_safetensors(tmp_path, cfg)
