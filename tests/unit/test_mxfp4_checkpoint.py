"""MXFP4 checkpoints (gpt-oss's published layout: experts' ``gate_up_proj`` / ``down_proj`` as
``*_blocks`` / ``*_scales``) read by kiln's loader, on a tiny gpt-oss config: the dequantized
experts equal this file's own nibble-by-nibble dequantization and transformers' (the same files
loaded with ``Mxfp4Config(dequantize=True)``, which runs on CPU); kiln's forward matches that
transformers model's; what the format does not allow is refused naming the tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kiln.workloads.config import parse_config
from kiln.workloads.gpt_oss_weights import seeded_random_gpt_oss, to_transformers
from kiln.workloads.models import build_model
from kiln.workloads.quantized_checkpoint import dequantize_mxfp4
from kiln.workloads.weights import WeightError

from .hf_testing import max_logit_diff
from .quantized_files import gpt_oss_mxfp4_files, mxfp4_dequantize, write_checkpoint
from .test_gpt_oss_model import REAL
from .test_gpt_oss_model import TINY as GPT_OSS_TINY

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.gpt_oss")

TOL = 1e-5
"""Max |logit difference| in float32 (the random-weight parity test's bound)."""
RAW: dict[str, Any] = {**GPT_OSS_TINY, "quantization_config": REAL["quantization_config"]}
GATE_UP = "model.layers.1.mlp.experts.gate_up_proj"
DOWN = "model.layers.2.mlp.experts.down_proj"


def _files(
    tmp_path: Path, raw: dict[str, Any] = RAW
) -> tuple[Path, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(directory, files, dequantized transformers state dict) of the tiny model's seeded
    weights with MXFP4 experts."""
    config = parse_config(raw, "tiny")
    state = to_transformers(seeded_random_gpt_oss(config, torch.float32, seed=3), config)
    files, dequantized = gpt_oss_mxfp4_files(state)
    return write_checkpoint(tmp_path / "ckpt", raw, files), files, dequantized


def _build(directory: Path, raw: dict[str, Any] = RAW, dtype: torch.dtype = torch.float32) -> Any:
    config = parse_config(raw, "tiny-gpt-oss-mxfp4")
    return build_model(config, dtype=dtype, weights_dir=directory, max_batch=2, max_seq_len=32)


def _hf(directory: Path) -> Any:
    config = transformers.Mxfp4Config(dequantize=True)
    hf = transformers.GptOssForCausalLM.from_pretrained(
        str(directory), quantization_config=config, dtype=torch.float32
    )
    hf.config._attn_implementation = "eager"
    return hf.eval()


def test_the_loaded_experts_are_the_dequantized_ones(tmp_path: Path) -> None:
    directory, files, dequantized = _files(tmp_path)
    model = _build(directory)
    assert files[GATE_UP + "_blocks"].shape == (4, 64, 2, 16)  # [E, 2I, H / 32, 16]
    ours = to_transformers(model.weights, model.config)  # back to transformers' layout
    assert set(ours) == set(dequantized)
    for name, want in dequantized.items():
        assert torch.equal(ours[name], want), name
    assert any("MXFP4" in note and "dequantized" in note for note in model.weights.notes)


def test_transformers_dequantizes_the_same_files_alike(tmp_path: Path) -> None:
    directory, _, _ = _files(tmp_path)
    model = _build(directory)
    theirs = _hf(directory).state_dict()
    for name, ours in to_transformers(model.weights, model.config).items():
        assert torch.equal(ours, theirs[name]), name


def test_the_forward_matches_transformers(tmp_path: Path) -> None:
    directory, _, _ = _files(tmp_path)
    model = _build(directory)
    prompt = torch.randint(0, RAW["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(4))
    assert max_logit_diff(model, _hf(directory), prompt, steps=5) < TOL


def test_the_kernel_decodes_every_code_and_exponent() -> None:
    """All 256 bytes (both nibble orders) under exponents from 2**-127 to 2**127 (254)."""
    blocks = torch.arange(256, dtype=torch.uint8).reshape(16, 1, 16).repeat(16, 1, 1)
    scales = torch.linspace(0, 254, 256).to(torch.uint8).reshape(16, 16, 1)
    blocks = blocks.reshape(16, 16, 1, 16)
    assert torch.equal(dequantize_mxfp4(blocks, scales), mxfp4_dequantize(blocks, scales))


def test_bf16_engines_hold_bf16(tmp_path: Path) -> None:
    directory, _, dequantized = _files(tmp_path)
    model = _build(directory, dtype=torch.bfloat16)
    down = model.weights[DOWN]
    assert down.dtype == torch.bfloat16
    assert torch.equal(down, dequantized[DOWN].transpose(1, 2).to(torch.bfloat16))


def _rewrite(directory: Path, files: dict[str, torch.Tensor], raw: dict[str, Any] = RAW) -> None:
    (directory / "model.safetensors").unlink()
    write_checkpoint(directory, raw, files)


def test_missing_scales_are_refused(tmp_path: Path) -> None:
    directory, files, _ = _files(tmp_path)
    del files[DOWN + "_scales"]
    _rewrite(directory, files)
    with pytest.raises(WeightError, match=f"{DOWN}_blocks has no scales"):
        _build(directory)


def test_scales_of_the_wrong_shape_are_refused(tmp_path: Path) -> None:
    directory, files, _ = _files(tmp_path)
    files[GATE_UP + "_scales"] = files[GATE_UP + "_scales"][:, :, :1]
    _rewrite(directory, files)
    with pytest.raises(WeightError, match=f"{GATE_UP}_scales is torch.uint8 \\[4, 64, 1\\]"):
        _build(directory)


def test_a_nan_scale_is_refused(tmp_path: Path) -> None:
    directory, files, _ = _files(tmp_path)
    files[GATE_UP + "_scales"][0, 0, 0] = 255
    _rewrite(directory, files)
    with pytest.raises(WeightError, match=f"{GATE_UP}_scales holds E8M0 NaN"):
        _build(directory)


def test_other_quantizations_are_refused(tmp_path: Path) -> None:
    directory, _, _ = _files(tmp_path)
    with pytest.raises(WeightError, match="quant_method 'awq' is not read"):
        _build(directory, {**RAW, "quantization_config": {"quant_method": "awq"}})
    plain = {k: v for k, v in RAW.items() if k != "quantization_config"}
    with pytest.raises(WeightError, match="read as published, with quantization_config"):
        _build(directory, plain)


def test_unquantized_experts_are_refused(tmp_path: Path) -> None:
    """Unquantized experts' layout ([E, H, 2I] interleaved or kiln's) is ambiguous here (H = 2I):
    refused rather than guessed."""
    directory, files, dequantized = _files(tmp_path)
    del files[GATE_UP + "_blocks"], files[GATE_UP + "_scales"]
    files[GATE_UP] = dequantized[GATE_UP]
    _rewrite(directory, files)
    with pytest.raises(WeightError, match=f"{GATE_UP} is stored unquantized"):
        _build(directory)


def test_the_random_path_is_unchanged() -> None:
    """No directory: the seeded store, with its note that the config's MXFP4 is not applied."""
    config = parse_config(RAW, "tiny")
    model = build_model(config, dtype=torch.float32, seed=3, max_seq_len=8)
    seeded = seeded_random_gpt_oss(config, torch.float32, seed=3)
    assert all(torch.equal(model.weights[n], t) for n, t in seeded.items())
    assert any("random weights" in note for note in model.weights.notes)
