"""Model configs from the real Hugging Face config.json files in ../shared/data/models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.workloads.config import UnsupportedModelError, load_config, parse_config

MODELS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "models"

pytestmark = pytest.mark.skipif(not MODELS.is_dir(), reason="../shared/data/models is not here")


@pytest.mark.parametrize(
    ("file", "params"),
    [
        # Published sizes: Llama-3.2-1B 1,235,814,400 (the figure); the rest to the
        # precision their model cards give.
        ("llama-3.2-1b.json", 1_235_814_400),
        ("llama-3.1-8b.json", 8.03e9),
        ("qwen3-8b.json", 8.19e9),
        ("qwen3-30b-a3b.json", 30.5e9),
        ("mixtral-8x7b-v0.1.json", 46.7e9),
        ("deepseek-v3.json", 671e9),
    ],
)
def test_parameter_counts_match_published_sizes(file: str, params: float) -> None:
    cfg = load_config(MODELS / file)
    if isinstance(params, int):
        assert cfg.param_count() == params
    else:
        assert cfg.param_count() == pytest.approx(params, rel=0.005)


def test_moe_active_parameters_are_a_fraction_of_total() -> None:
    cfg = load_config(MODELS / "qwen3-30b-a3b.json")
    assert cfg.is_moe and cfg.moe is not None and cfg.moe.top_k == 8
    embed = cfg.vocab_size * cfg.hidden_size
    # Qwen3-30B-A3B activates 3.3B parameters per token (model card), embedding included.
    assert cfg.active_param_count() + embed == pytest.approx(3.3e9, rel=0.02)


def test_kv_cache_bytes_per_token() -> None:
    llama = load_config(MODELS / "llama-3.2-1b.json")
    assert llama.kv_bytes_per_token("bfloat16") == 16 * 2 * 8 * 64 * 2
    ds = load_config(MODELS / "deepseek-v3.json")
    assert ds.kv_elements_per_token() == 61 * (512 + 64)


def test_fast_tier_truncates_layers() -> None:
    cfg = load_config(MODELS / "llama-3.2-1b.json")
    fast = cfg.with_layers(2)
    assert fast.num_hidden_layers == 2 and fast.hidden_size == cfg.hidden_size
    with pytest.raises(ValueError, match=r"1\.\.16"):
        cfg.with_layers(17)


@pytest.mark.parametrize("model_type", ["mamba2", "qwen3_next", ""])
def test_unsupported_architectures_are_named(tmp_path: Path, model_type: str) -> None:
    cfg = json.loads((MODELS / "llama-3.2-1b.json").read_text())
    cfg["model_type"] = model_type
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="unsupported architecture"):
        load_config(path)


def test_malformed_configs(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(UnsupportedModelError, match="not valid JSON"):
        load_config(bad)
    cfg = json.loads((MODELS / "llama-3.2-1b.json").read_text())
    del cfg["hidden_size"]
    with pytest.raises(UnsupportedModelError, match="hidden_size"):
        parse_config(cfg, "x")
