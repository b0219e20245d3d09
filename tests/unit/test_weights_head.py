"""The output head against ``tie_word_embeddings`` when a safetensors checkpoint disagrees with
its config (issue 17): transformers' choice where it makes one, a warning and a note each time."""

from __future__ import annotations

from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from structlog.testing import capture_logs

from kiln.workloads.config import ModelConfig, parse_config
from kiln.workloads.weights import (
    EMBED,
    LM_HEAD,
    WeightError,
    expected_shapes,
    load_safetensors,
    seeded_random,
)

TINY = {
    "model_type": "llama",
    "vocab_size": 40,
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def _config(tie: bool) -> ModelConfig:
    return parse_config({**TINY, "tie_word_embeddings": tie}, "tiny")


def _save(root: Path, head: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The tied model's tensors, plus ``head`` as ``lm_head.weight`` when given."""
    store = seeded_random(_config(True), torch.float32, "cpu", seed=2)
    tensors = {n: t.clone() for n, t in store.items() if n in expected_shapes(_config(True))}
    if head is not None:
        tensors[LM_HEAD] = head
    save_file(tensors, str(root / "model.safetensors"))
    return tensors


def _events(logs: list[MutableMapping[str, Any]]) -> list[object]:
    return [e["event"] for e in logs if e["log_level"] == "warning"]


def test_config_ties_but_the_files_head_differs_uses_the_files_head(tmp_path: Path) -> None:
    head = torch.randn(40, 16, generator=torch.Generator().manual_seed(9))
    _save(tmp_path, head)
    with capture_logs() as logs:
        store = load_safetensors(tmp_path, _config(True), torch.float32)
    assert torch.equal(store[LM_HEAD], head) and store[LM_HEAD] is not store[EMBED]
    assert _events(logs) == ["checkpoint_head_untied"]
    assert len(store.notes) == 1 and "as transformers does" in store.notes[0]


def test_config_ties_and_the_files_head_is_the_embedding_ties_quietly(tmp_path: Path) -> None:
    tensors = _save(tmp_path, None)
    save_file({**tensors, LM_HEAD: tensors[EMBED].clone()}, str(tmp_path / "model.safetensors"))
    with capture_logs() as logs:
        store = load_safetensors(tmp_path, _config(True), torch.float32)
    assert store[LM_HEAD] is store[EMBED] and store.notes == () and _events(logs) == []


def test_config_unties_but_the_files_have_no_head_ties_with_a_warning(tmp_path: Path) -> None:
    tensors = _save(tmp_path, None)
    with capture_logs() as logs:
        store = load_safetensors(tmp_path, _config(False), torch.float32)
    assert store[LM_HEAD] is store[EMBED] and torch.equal(store[EMBED], tensors[EMBED])
    assert _events(logs) == ["checkpoint_head_tied"]
    assert len(store.notes) == 1 and "tie_word_embeddings false" in store.notes[0]


def test_an_untied_checkpoint_with_its_head_is_read_as_is(tmp_path: Path) -> None:
    head = torch.ones(40, 16)
    _save(tmp_path, head)
    with capture_logs() as logs:
        store = load_safetensors(tmp_path, _config(False), torch.float32)
    assert torch.equal(store[LM_HEAD], head) and store.notes == () and _events(logs) == []


def test_a_head_of_the_wrong_shape_is_still_refused(tmp_path: Path) -> None:
    _save(tmp_path, torch.zeros(41, 16))
    with pytest.raises(WeightError, match=r"lm_head.weight has shape \[41, 16\]"):
        load_safetensors(tmp_path, _config(True), torch.float32)
