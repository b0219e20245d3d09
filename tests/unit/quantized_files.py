"""Writing tiny checkpoints in the published quantized layouts, and dequantizing them, written
here independently of kiln's loader (loops over blocks, E2M1 decoded from its bits).

Block-FP8 (DeepSeek-V3 style): ``<name>`` float8_e4m3fn, ``<name>_scale_inv`` float32
``[ceil(out/bm), ceil(in/bn)]``, the per-block max mapped to 448. MXFP4 (gpt-oss): ``<name>_blocks``
uint8 ``[..., rows, G, 16]`` (low nibble = the even column), ``<name>_scales`` uint8 E8M0.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

FP8_MAX = 448.0


def fp8_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv) of a float32 matrix, block by block."""
    (rows, cols), (bm, bn) = w.shape, block
    scale = torch.empty(math.ceil(rows / bm), math.ceil(cols / bn))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            part = w[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn]
            scale[i, j] = part.abs().max().clamp(min=1e-12) / FP8_MAX
            q[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn] = (part / scale[i, j]).to(q.dtype)
    return q, scale


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 of an FP8 matrix and its scale_inv, block by block (edge blocks partial)."""
    bm, bn = block
    out = q.float()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn] *= scale[i, j]
    return out


def _e2m1(code: int) -> float:
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    return sign * (man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2))


E2M1_VALUES = torch.tensor([_e2m1(c) for c in range(16)])


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 blocks [..., rows, G, 16], uint8 scales [..., rows, G]) of float32 ``w [..., rows,
    cols]`` (cols a multiple of 32): per group the exponent putting its max at or under 6, each
    value rounded to the nearest E2M1 code."""
    groups = w.reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = groups.abs().amax(-1).clamp(min=2.0**-120)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exp).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - E2M1_VALUES).abs().argmin(-1).to(torch.uint8)  # [..., G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8).contiguous()


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 ``[..., rows, G * 32]`` of MXFP4 blocks and scales, nibble by nibble."""
    low, high = E2M1_VALUES[(blocks & 15).long()], E2M1_VALUES[(blocks >> 4).long()]
    values = torch.empty(*blocks.shape[:-1], 32)
    values[..., 0::2], values[..., 1::2] = low, high
    values *= torch.exp2(scales.float() - 127).unsqueeze(-1)
    return values.flatten(-2)


def write_checkpoint(
    directory: Path, raw: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]
) -> Path:
    """``tensors`` as ``model.safetensors`` plus ``config.json`` in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(raw))
    return directory


DEEPSEEK_EXPERTS = ("mlp", "gate_proj", "up_proj", "down_proj")
MINIMAX_EXPERTS = ("block_sparse_moe", "w1", "w3", "w2")


FP8_WEIGHTS = ("proj.weight", "proj_with_mqa.weight")
"""Name endings of the matrices DeepSeek-V3 and MiniMax-M2 publish in FP8 (every projection)."""


def fp8_files(
    state: Mapping[str, torch.Tensor],
    block: tuple[int, int],
    experts: tuple[str, str, str, str] = DEEPSEEK_EXPERTS,
    fp8: tuple[str, ...] = FP8_WEIGHTS,
    plain: tuple[str, ...] = (),
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the files, FP8 as DeepSeek-V3, MiniMax-M2 or GLM-5 publish them: every matrix whose name
    ends in one of ``fp8`` and in none of ``plain`` FP8 with its scale_inv, experts per expert
    under ``experts`` = (module, gate, up, down) names; router, norms, embedding, head and
    correction bias as they are, under ``module``; the dequantized transformers state dict) of
    a float32 transformers state dict (stacked experts)."""
    module, gate_name, up_name, down_name = experts
    files: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}

    def put(name: str, w: torch.Tensor) -> torch.Tensor:
        q, s = fp8_quantize(w, block)
        files[name], files[name + "_scale_inv"] = q, s
        return fp8_dequantize(q, s, block)

    for name, t in state.items():
        layer = name.split(".mlp.")[0]
        if name.endswith("experts.gate_up_proj"):
            inter = t.shape[1] // 2
            parts = []
            for e in range(t.shape[0]):
                base = f"{layer}.{module}.experts.{e}."
                gate = put(f"{base}{gate_name}.weight", t[e, :inter])
                parts.append(torch.cat((gate, put(f"{base}{up_name}.weight", t[e, inter:]))))
            dequantized[name] = torch.stack(parts)
        elif name.endswith("experts.down_proj"):
            base = f"{layer}.{module}.experts.{{}}.{down_name}.weight"
            dequantized[name] = torch.stack([put(base.format(e), t[e]) for e in range(t.shape[0])])
        elif name.endswith(fp8) and not (plain and name.endswith(plain)):
            dequantized[name] = put(name, t)
        else:
            files[name.replace(".mlp.", f".{module}.")] = dequantized[name] = t
    return files, dequantized


def gpt_oss_mxfp4_files(
    state: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the files as gpt-oss publishes them: experts' ``gate_up_proj`` / ``down_proj`` as MXFP4
    blocks and scales of ``[E, out, in]``, the rest as it is; the dequantized state dict) of a
    float32 ``GptOssForCausalLM`` state dict (``gate_up_proj [E, H, 2I]``, ``down_proj [E, I,
    H]``)."""
    files: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4_quantize(t.transpose(1, 2))  # [E, out, in]
            files[name + "_blocks"], files[name + "_scales"] = blocks, scales
            dequantized[name] = mxfp4_dequantize(blocks, scales).transpose(1, 2).contiguous()
        else:
            files[name] = dequantized[name] = t
    return files, dequantized
