"""Block-FP8 checkpoints (DeepSeek-V3's published layout: per-expert FP8 projections with float32
``weight_scale_inv``) read by kiln's loader, on a tiny DeepSeek-V3 config: the dequantized
tensors equal this file's own block-by-block dequantization (edge blocks partial),
transformers' ``Fp8Dequantize`` and (with accelerate installed) transformers' ``from_pretrained``
of the same files with ``dequantize=True``; kiln's forward on them matches transformers' on the same
dequantized weights; what the format does not allow is refused naming the tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kiln.workloads.config import parse_config
from kiln.workloads.mla_weights import seeded_random_mla
from kiln.workloads.models import build_model
from kiln.workloads.quantized_checkpoint import Quantization
from kiln.workloads.weights import WeightError

from .hf_testing import load_weights, max_logit_diff
from .quantized_files import fp8_dequantize, fp8_files, fp8_quantize, write_checkpoint
from .test_mla_model import TINY as MLA_TINY

transformers = pytest.importorskip("transformers")

TOL = 1e-5
"""Max |logit difference| in float32 (the same bound as the random-weight parity test)."""


def _raw(block: list[int], **quant: Any) -> dict[str, Any]:
    q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    return {**MLA_TINY, "quantization_config": {**q, "weight_block_size": block, **quant}}


def _files(
    tmp_path: Path, block: list[int], raw: dict[str, Any] | None = None
) -> tuple[Path, dict[str, Any], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(directory, config, files, dequantized state) of the tiny model with seeded weights
    (non-zero correction biases so the routing depends on them) quantized in ``block``s."""
    raw = raw or _raw(block)
    state = dict(seeded_random_mla(parse_config(raw, "tiny"), torch.float32, seed=3).items())
    gen = torch.Generator().manual_seed(7)
    for name, t in state.items():
        if name.endswith("e_score_correction_bias"):
            state[name] = torch.randn(t.shape, generator=gen) * 0.1
    files, dequantized = fp8_files(state, (block[0], block[1]))
    return write_checkpoint(tmp_path / "ckpt", raw, files), raw, files, dequantized


def _build(directory: Path, raw: dict[str, Any], dtype: torch.dtype = torch.float32) -> Any:
    config = parse_config(raw, "tiny-deepseek-fp8")
    return build_model(config, dtype=dtype, weights_dir=directory, max_batch=2, max_seq_len=16)


@pytest.mark.parametrize("block", [[16, 16], [8, 8], [128, 128]])
def test_the_loaded_tensors_are_the_dequantized_ones(tmp_path: Path, block: list[int]) -> None:
    """16: kv_b_proj's 24 inputs end in a partial block; 128: every matrix is one edge block."""
    directory, raw, files, dequantized = _files(tmp_path, block)
    assert files["model.layers.0.self_attn.kv_b_proj.weight_scale_inv"].shape[1] == -(
        -24 // block[1]
    )
    model = _build(directory, raw)
    assert set(model.weights) == set(dequantized)
    for name, want in dequantized.items():
        got = model.weights[name]
        assert got.dtype == torch.float32 and torch.equal(got, want), name
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert torch.equal(model.weights[bias], files[bias])
    assert any("block-FP8" in note and "dequantized" in note for note in model.weights.notes)


def test_transformers_dequantizes_the_same_files_alike(tmp_path: Path) -> None:
    """transformers' own FP8 dequantization (``Fp8Dequantize``, the op ``dequantize=True``
    loading runs; loading through ``from_pretrained`` needs accelerate and a GPU for FP8, so the
    op is called on the files' tensors) gives kiln's tensors. Its block size comes from the
    scale grid, so it needs whole blocks: [8, 8] here."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    directory, raw, files, _ = _files(tmp_path, [8, 8])
    model = _build(directory, raw)
    op = fp8.Fp8Dequantize(None)
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    theirs = op._dequantize_one(files[name], files[name + "_scale_inv"], torch.float32)
    assert torch.equal(model.weights[name], theirs)
    gate_up = model.weights["model.layers.2.mlp.experts.gate_up_proj"]
    base = "model.layers.2.mlp.experts.5."
    gate = op._dequantize_one(
        files[base + "gate_proj.weight"], files[base + "gate_proj.weight_scale_inv"], torch.float32
    )
    assert torch.equal(gate_up[5, : gate.shape[0]], gate)


def test_transformers_loads_the_same_files_alike(tmp_path: Path) -> None:
    """The same files through ``from_pretrained`` with ``FineGrainedFP8Config(dequantize=True)``
    (CPU; transformers asks for accelerate to load FP8): every tensor equals kiln's and the
    forward matches."""
    pytest.importorskip("accelerate", reason="transformers loads FP8 checkpoints with accelerate")
    directory, raw, _, _ = _files(tmp_path, [8, 8])
    model = _build(directory, raw)
    quant = transformers.FineGrainedFP8Config(dequantize=True, weight_block_size=(8, 8))
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(
        str(directory), quantization_config=quant, dtype=torch.float32
    )
    theirs = hf.state_dict()
    assert set(theirs) == set(model.weights)
    for name, t in theirs.items():
        assert torch.equal(model.weights[name], t), name
    hf.config._attn_implementation = "eager"
    prompt = torch.randint(0, raw["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(2))
    assert max_logit_diff(model, hf.eval(), prompt, steps=4) < TOL


@pytest.mark.parametrize("block", [[16, 16], [8, 8]])
def test_the_forward_matches_transformers_on_the_dequantized_weights(
    tmp_path: Path, block: list[int]
) -> None:
    directory, raw, _, dequantized = _files(tmp_path, block)
    model = _build(directory, raw)
    fields = {k: v for k, v in raw.items() if k not in ("model_type", "quantization_config")}
    hf_config = transformers.DeepseekV3Config(**fields)
    hf_config._attn_implementation = "eager"
    hf = load_weights(transformers.DeepseekV3ForCausalLM(hf_config), dequantized)
    prompt = torch.randint(0, raw["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(1))
    assert max_logit_diff(model, hf, prompt, steps=4) < TOL


def test_bf16_engines_hold_bf16(tmp_path: Path) -> None:
    directory, raw, _, dequantized = _files(tmp_path, [16, 16])
    model = _build(directory, raw, torch.bfloat16)
    name = "model.layers.1.mlp.experts.down_proj"
    assert model.weights[name].dtype == torch.bfloat16
    assert torch.equal(model.weights[name], dequantized[name].to(torch.bfloat16))
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert model.weights[bias].dtype == torch.float32  # as the random path holds it
    with torch.no_grad():
        assert torch.isfinite(model.prefill(torch.tensor([[1, 2, 3]]))).all()


def _rewrite(directory: Path, raw: dict[str, Any], files: dict[str, torch.Tensor]) -> Path:
    (directory / "model.safetensors").unlink()
    return write_checkpoint(directory, raw, files)


KV_B = "model.layers.0.self_attn.kv_b_proj.weight"
EXPERT = "model.layers.1.mlp.experts.3.up_proj.weight"


def test_a_missing_scale_is_refused(tmp_path: Path) -> None:
    directory, raw, files, _ = _files(tmp_path, [16, 16])
    del files[EXPERT + "_scale_inv"]
    _rewrite(directory, raw, files)
    with pytest.raises(WeightError, match=f"{EXPERT} is FP8 but its scale {EXPERT}_scale_inv"):
        _build(directory, raw)


def test_a_scale_of_the_wrong_shape_is_refused(tmp_path: Path) -> None:
    directory, raw, files, _ = _files(tmp_path, [16, 16])
    files[KV_B + "_scale_inv"] = files[KV_B + "_scale_inv"][:, :1]
    _rewrite(directory, raw, files)
    with pytest.raises(WeightError, match=f"{KV_B}_scale_inv has shape \\[7, 1\\]"):
        _build(directory, raw)


def test_a_block_size_other_than_the_configs_is_refused(tmp_path: Path) -> None:
    directory, _, _, _ = _files(tmp_path, [16, 16])
    with pytest.raises(WeightError, match=r"_scale_inv has shape .* 8x8 blocks needs"):
        _build(directory, _raw([8, 8]))


@pytest.mark.parametrize(
    ("quant", "why"),
    [
        ({"quant_method": "gptq"}, "quant_method 'gptq' is not read"),
        ({"fmt": "e5m2"}, "fmt 'e5m2' is not read"),
        ({"weight_block_size": [128]}, "weight_block_size \\[128\\] is not two positive"),
        ({"activation_scheme": "static"}, "activation_scheme 'static'"),
    ],
)
def test_unknown_formats_are_refused(tmp_path: Path, quant: dict[str, Any], why: str) -> None:
    directory, _, _, _ = _files(tmp_path, [16, 16])
    with pytest.raises(WeightError, match=why):
        _build(directory, _raw([16, 16], **quant))


def test_fp8_without_a_quantization_config_is_refused(tmp_path: Path) -> None:
    directory, raw, _, _ = _files(tmp_path, [16, 16])
    plain = {k: v for k, v in raw.items() if k != "quantization_config"}
    with pytest.raises(WeightError, match=r"stored as torch\.float8_e4m3fn but config\.json"):
        _build(directory, plain)


def test_modules_to_not_convert_stay_as_stored(tmp_path: Path) -> None:
    """A listed module stored in float32 is read as stored; one stored in FP8 is refused."""
    o_proj = "model.layers.0.self_attn.o_proj"
    raw = _raw([16, 16], modules_to_not_convert=[o_proj, "lm_head"])
    directory, raw, files, _ = _files(tmp_path, [16, 16], raw)
    with pytest.raises(WeightError, match=f"{o_proj}.weight is stored as FP8 but is in modules"):
        _build(directory, raw)
    state = dict(seeded_random_mla(parse_config(raw, "tiny"), torch.float32, seed=3).items())
    files[o_proj + ".weight"] = state[o_proj + ".weight"]
    del files[o_proj + ".weight_scale_inv"]
    _rewrite(directory, raw, files)
    assert torch.equal(
        _build(directory, raw).weights[o_proj + ".weight"], state[o_proj + ".weight"]
    )


def test_the_quantizer_here_is_lossy_but_close() -> None:
    """Guards the comparison's meaning: the FP8 round trip moves weights (so equality above is
    with the dequantized values, not the originals) by under e4m3's half-ulp."""
    w = torch.randn(40, 24, generator=torch.Generator().manual_seed(0))
    q, s = fp8_quantize(w, (16, 16))
    back = fp8_dequantize(q, s, (16, 16))
    assert not torch.equal(back, w) and (back - w).abs().max() < 0.07 * w.abs().max()


def test_modules_to_not_convert_match_as_transformers_matches_them() -> None:
    """A prefix up to a module boundary, a regex, or a suffix (transformers'
    ``should_convert_module``); MiniMax-M2's and gpt-oss's lists."""
    quant = Quantization(
        "fp8", keep=("model.layers.*.self_attn", "gate", "e_score_correction_bias", "lm_head")
    )
    for name, kept in (
        ("model.layers.3.self_attn.q_proj.weight", True),
        ("model.layers.0.block_sparse_moe.gate.weight", True),
        ("model.layers.0.block_sparse_moe.e_score_correction_bias", True),
        ("lm_head.weight", True),
        ("model.layers.0.mlp.gate_proj.weight", False),
        ("model.layers.0.block_sparse_moe.experts.0.w1.weight", False),
    ):
        assert quant.kept(name) is kept, name
