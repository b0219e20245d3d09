"""The baselines' compiled paths on a CUDA device (torch.compile with CUDA graphs), on a small
Llama and a small Qwen3 (q/k norms, heads x head_dim wider than hidden): each runs, is faster
than transformers eager, and agrees with kiln's reference."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kiln.baselines.runner import run_named
from kiln.workloads.config import parse_config

from ..unit.engine_testing import TINY_LLAMA

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available"),
]

CONFIG = parse_config(
    {**TINY_LLAMA, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4,
     "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 4096},
    "small-llama",
)  # fmt: skip
QWEN3 = parse_config(
    {**TINY_LLAMA, "model_type": "qwen3", "hidden_size": 512, "intermediate_size": 1408,
     "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
     "vocab_size": 4096, "rope_theta": 1e6, "rope_scaling": None, "tie_word_embeddings": False},
    "small-qwen3",
)  # fmt: skip
CONFIGS = {"llama": CONFIG, "qwen3": QWEN3}
POINT: dict[str, Any] = {
    "batch": 1,
    "context": 256,
    "device": "cuda",
    "dtype": torch.bfloat16,
    "seed": 3,
    "steps": 20,
    "warmup": 3,
}


@pytest.mark.parametrize("family", list(CONFIGS))
@pytest.mark.parametrize("name", ["hf_eager", "hf_static", "hf_compile", "gpt_fast"])
def test_baseline_on_cuda(name: str, family: str) -> None:
    if name.startswith("hf_"):
        pytest.importorskip("transformers")
    result = run_named(name, CONFIGS[family], **POINT)
    assert result.status == "ok", (result.error, result.notes)
    assert result.correct and result.tokens_per_s > 0
    assert result.prefill_median_ms > 0, result.notes  # timed after the CUDA-graph replays
    assert torch.cuda.memory_allocated() < 64 * 2**20  # what it allocated was freed


@pytest.mark.parametrize("family", list(CONFIGS))
def test_compiled_baselines_beat_eager(family: str) -> None:
    pytest.importorskip("transformers")
    eager = run_named("hf_eager", CONFIGS[family], **POINT)
    fast = run_named("gpt_fast", CONFIGS[family], **POINT)
    assert fast.status == "ok" and fast.correct, (fast.error, fast.notes)
    assert fast.tokens_per_s > eager.tokens_per_s
