"""GLM-5 (``glm_moe_dsa``) checkpoints read by kiln's loader, on the tiny config of
``test_glm_moe_dsa_model``: a random ``GlmMoeDsaForCausalLM`` written by transformers'
``save_pretrained`` (per-expert names; the indexer's ``wq_b``, ``wk``, ``k_norm`` weight and bias,
``weights_proj``) builds from its directory a kiln model holding its tensors, whose prefill and
decode match transformers' in float32; a block-FP8 form (every projection and the indexer's
``wq_b`` / ``wk`` FP8, ``weights_proj`` as stored) loads the dequantized tensors and matches
transformers on them; a missing or mis-shaped indexer tensor is refused naming it; the tensors
kiln does not build (the MTP layer) are ignored.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.workloads.config import load_config, parse_config
from kiln.workloads.models import DecoderModel, build_model
from kiln.workloads.weights import WeightError

from .hf_testing import load_weights, max_logit_diff
from .quantized_files import FP8_WEIGHTS, fp8_files, write_checkpoint
from .test_glm_moe_dsa_model import PROMPT_LEN, STEPS, TINY

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.glm_moe_dsa")

TOL = 1e-5
"""Max |logit difference| in float32 (the random-weight parity test's bound)."""
INDEXER = "model.layers.{}.self_attn.indexer."
WQ_B, WK = INDEXER.format(1) + "wq_b.weight", INDEXER.format(2) + "wk.weight"
HEAD = INDEXER.format(0) + "weights_proj.weight"
BLOCK = (16, 16)
"""kv_b_proj's 24 inputs and wk's 16 rows: partial and whole edge blocks."""
FP8_RAW: dict[str, Any] = {
    **TINY,
    "quantization_config": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK),
    },
}


def _hf(seed: int = 0) -> Any:
    """A random float32 transformers model of ``TINY`` (eager), its norms, the indexer's key
    norm and the correction biases moved off their initial ones and zeros."""
    hf_config = transformers.GlmMoeDsaConfig(**{k: v for k, v in TINY.items() if k != "model_type"})
    hf_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = transformers.GlmMoeDsaForCausalLM(hf_config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in hf.state_dict().items():
            if name.endswith(("norm.weight", "norm.bias", "e_score_correction_bias")):
                t.add_(torch.randn(t.shape, generator=gen) * 0.1)
    return hf


def _saved(tmp_path: Path) -> tuple[Any, Path]:
    """(the transformers model, its ``save_pretrained`` directory)."""
    hf = _hf()
    directory = tmp_path / "glm-tiny"
    hf.save_pretrained(str(directory))
    return hf, directory


def _build(directory: Path, dtype: torch.dtype = torch.float32) -> DecoderModel:
    config = load_config(directory / "config.json")
    return build_model(config, dtype=dtype, weights_dir=directory, max_batch=2, max_seq_len=16)


def _prompt() -> torch.Tensor:
    gen = torch.Generator().manual_seed(11)
    return torch.randint(0, TINY["vocab_size"], (2, PROMPT_LEN), generator=gen)


def test_a_saved_model_loads_and_matches_transformers(tmp_path: Path) -> None:
    hf, directory = _saved(tmp_path)
    stored = load_file(str(directory / "model.safetensors"))
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in stored  # per-expert, as published
    assert {WQ_B, WK, HEAD, INDEXER.format(2) + "k_norm.bias"} <= set(stored)
    model = _build(directory)
    theirs = hf.state_dict()
    assert set(model.weights) == set(theirs)
    for name, t in theirs.items():
        assert torch.equal(model.weights[name], t), name
    assert max_logit_diff(model, hf, _prompt(), steps=STEPS) < TOL


def test_bf16_engines_hold_what_the_random_path_holds(tmp_path: Path) -> None:
    """bf16 but ``weights_proj`` and the correction biases float32 (transformers' fp32 modules)."""
    hf, directory = _saved(tmp_path)
    model = _build(directory, torch.bfloat16)
    theirs = hf.state_dict()
    for name in (HEAD, "model.layers.1.mlp.gate.e_score_correction_bias"):
        assert model.weights[name].dtype == torch.float32 and torch.equal(
            model.weights[name], theirs[name]
        )
    assert torch.equal(model.weights[WK], theirs[WK].to(torch.bfloat16))
    with torch.no_grad():
        assert torch.isfinite(model.prefill(_prompt())).all()


def test_a_block_fp8_checkpoint_loads_dequantized_and_matches(tmp_path: Path) -> None:
    hf = _hf()
    state = {n: t.detach().clone() for n, t in hf.state_dict().items()}
    fp8 = (*FP8_WEIGHTS, "indexer.wq_b.weight", "indexer.wk.weight")
    files, dequantized = fp8_files(state, BLOCK, fp8=fp8, plain=("indexer.weights_proj.weight",))
    assert files[WQ_B].dtype == files[WK].dtype == torch.float8_e4m3fn
    assert files[WK + "_scale_inv"].shape == (1, 4) and files[HEAD].dtype == torch.float32
    directory = write_checkpoint(tmp_path / "glm-fp8", FP8_RAW, files)
    model = _build(directory)
    assert set(model.weights) == set(dequantized)
    for name, want in dequantized.items():
        assert torch.equal(model.weights[name], want), name
    assert not torch.equal(model.weights[WQ_B], state[WQ_B])  # the FP8 round trip moved it
    assert any("block-FP8" in note for note in model.weights.notes)
    assert max_logit_diff(model, load_weights(hf, dequantized), _prompt(), steps=STEPS) < TOL
    del files[WQ_B + "_scale_inv"]
    (directory / "model.safetensors").unlink()
    write_checkpoint(directory, FP8_RAW, files)
    with pytest.raises(WeightError, match=re.escape(f"{WQ_B} is FP8 but its scale")):
        _build(directory)


def _rewrite(directory: Path, files: dict[str, torch.Tensor]) -> None:
    save_file({n: t.contiguous() for n, t in files.items()}, str(directory / "model.safetensors"))


@pytest.mark.parametrize(
    "part", ["wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight"]
)
def test_a_missing_indexer_tensor_is_refused_by_name(tmp_path: Path, part: str) -> None:
    _, directory = _saved(tmp_path)
    files = load_file(str(directory / "model.safetensors"))
    name = INDEXER.format(2) + part
    del files[name]
    _rewrite(directory, files)
    with pytest.raises(WeightError, match=f"missing weights for glm-tiny: {re.escape(name)}$"):
        _build(directory)


@pytest.mark.parametrize(
    ("name", "cut", "found", "want"),
    [
        (WQ_B, lambda t: t.T, [32, 128], [128, 32]),
        (INDEXER.format(0) + "k_norm.bias", lambda t: t[:15], [15], [16]),
        (HEAD, lambda t: t[:4], [4, 64], [8, 64]),
    ],
)
def test_a_misshapen_indexer_tensor_is_refused_by_name(
    tmp_path: Path, name: str, cut: Any, found: list[int], want: list[int]
) -> None:
    _, directory = _saved(tmp_path)
    files = load_file(str(directory / "model.safetensors"))
    files[name] = cut(files[name])
    _rewrite(directory, files)
    why = f"{name} has shape {found}, glm-tiny needs {want}"
    with pytest.raises(WeightError, match=re.escape(why)):
        _build(directory)


def test_the_mtp_layer_and_other_extra_tensors_are_ignored(tmp_path: Path) -> None:
    """GLM-5 publishes its MTP layer as layer ``num_hidden_layers``; kiln builds the main model
    only (as transformers does) and leaves it unread."""
    hf, directory = _saved(tmp_path)
    files = load_file(str(directory / "model.safetensors"))
    files["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    files["model.layers.3.self_attn.indexer.wk.weight"] = torch.zeros(16, 64)
    _rewrite(directory, files)
    model = _build(directory)
    assert "model.layers.3.eh_proj.weight" not in model.weights
    assert torch.equal(model.weights[WK], hf.state_dict()[WK])


def test_the_fast_tier_reads_its_layers_only(tmp_path: Path) -> None:
    hf, directory = _saved(tmp_path)
    config = parse_config(TINY, "glm-tiny")
    model = build_model(config, layers=2, dtype=torch.float32, weights_dir=directory)
    assert not any(n.startswith("model.layers.2.") for n in model.weights)
    assert torch.equal(model.weights[WQ_B], hf.state_dict()[WQ_B])
