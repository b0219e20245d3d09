"""The ``fused_decode`` transform: a decode step of any dense decoder kiln builds (Llama, Qwen3)
as a short chain of fused kernels (design: docs/design/kernels.md).

A layer: RMSNorm, QKV, (Q/K norm), RoPE and KV write; split-KV attention and combine; ``o_proj``
+ residual; RMSNorm, gate/up and SiLU·mul; ``down`` + residual; then the final norm and LM head.
An expert layer (Qwen3-MoE, Mixtral) runs its RMSNorm fused and then the ``moe`` op the candidate
bound (so the expert kernel stays a search dimension). Products run as matrix-vector kernels or
cuBLAS GEMMs. Outputs match the reference within the engine's bf16 tolerance.

Parameters (strings; unset = each kernel's default for its shape): ``projections`` (``gemv`` up
to :data:`kiln.ops.kernels.gemv.MAX_M` sequences, ``tensor_core`` always; unset: GEMV below
:data:`TENSOR_CORE_BATCH`), ``block_k``, ``num_warps``, ``o_block_n``, ``gate_up_block_n``,
``down_block_n``, ``down_split_k``, ``lm_block_n``, ``qkv_block``, ``split_s`` (cache positions
per attention split), ``fused_combine`` (0/1), ``pdl`` (0 off, 1 wait then release, 2 release
then wait; default :data:`DEFAULT_PDL`; ignored before Hopper).

Multi-token steps run through the bound ops. Needs Triton on CUDA (or its interpreter).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from kiln.ops import moe_triton
from kiln.ops.kernels import runtime
from kiln.ops.mlp import FUSED_GATE_UP
from kiln.ops.qkv_proj import FUSED_QKV
from kiln.ops.rope import COS_SIN_TABLE
from kiln.workloads.config import ModelConfig
from kiln.workloads.models import DecoderModel
from kiln.workloads.models.rope_frequencies import rotary_dim
from kiln.workloads.models.slots import Site

Tensor = torch.Tensor

PARAMS = (
    "projections",
    "block_k",
    "num_warps",
    "o_block_n",
    "gate_up_block_n",
    "down_block_n",
    "down_split_k",
    "lm_block_n",
    "qkv_block",
    "split_s",
    "fused_combine",
    "pdl",
)
"""The transform's parameters (see the module docs)."""

PROJECTIONS = ("gemv", "tensor_core")
"""Values of the ``projections`` parameter."""

TENSOR_CORE_BATCH = 8
"""With ``projections`` unset, batches from this one up run the products as tensor-core GEMMs. A
starting point, not a measurement (docs/design/kernels.md); the search decides through
``projections``.
"""

MAX_HEAD_DIM = 256
"""Largest head_dim the fused kernels take (a head is one tile of the attention kernels)."""

DEFAULT_PDL = 2
"""``pdl`` when unset: release the next kernel at entry, then wait. Measured on an H200
(Llama-3.2-1B, batch 1, context 1,085): 858 µs a graphed step against 926-929 without PDL, 896 with
mode 1 (benchmarks/RESULTS.md).
"""


class FusedDecodeUnsupported(ValueError):
    """The model or the parameters do not fit the fused path (the message says why)."""


def _int_params(params: Mapping[str, str]) -> tuple[dict[str, int], str | None]:
    """The integer parameters, and ``projections`` (None when unset)."""
    unknown = sorted(set(params) - set(PARAMS))
    if unknown:
        raise FusedDecodeUnsupported(
            f"fused_decode: unknown parameter(s) {unknown} (known: {list(PARAMS)})"
        )
    out: dict[str, int] = {}
    projections = params.get("projections")
    if projections is not None and projections not in PROJECTIONS:
        raise FusedDecodeUnsupported(
            f"fused_decode: projections={projections!r} is not one of {list(PROJECTIONS)}"
        )
    for key, text in params.items():
        if key == "projections":
            continue
        try:
            value = int(text)
        except ValueError:
            message = f"fused_decode: {key}={text!r} is not an integer"
            raise FusedDecodeUnsupported(message) from None
        if key == "fused_combine":
            if value not in (0, 1):
                raise FusedDecodeUnsupported(f"fused_decode: fused_combine={value} is not 0 or 1")
        elif key == "pdl":
            if value not in range(runtime.PDL_MODES):
                raise FusedDecodeUnsupported(f"fused_decode: pdl={value} is not 0, 1 or 2")
        elif value < 1:
            raise FusedDecodeUnsupported(f"fused_decode: {key}={value} must be positive")
        out[key] = value
    return out, projections


def unsupported_reason(config: ModelConfig) -> str | None:
    """Why ``fused_decode`` cannot run ``config`` on a CUDA engine, or None: any dense decoder
    runs (Q/K norms, any GQA ratio, even head_dim up to 256, llama3 RoPE), expert layers through
    the bound ``moe`` op; not MLA, biases, partial rotary or whole-projection (``per_layer``)
    Q/K norms (MiniMax-M2: its kernels rotate all of head_dim and norm each head).
    """
    if config.mla is not None:
        return f"fused_decode: {config.name} uses latent attention (MLA)"
    if config.model_type == "gpt_oss":  # its decode kernels have no sinks or window
        return f"fused_decode: {config.name} has attention sinks and sliding windows (gpt-oss)"
    if config.qk_norm and config.qk_norm_type != "per_head":
        return f"fused_decode: {config.name} norms Q and K over whole projections (per_layer)"
    if rotary_dim(config) != config.head_dim:
        return f"fused_decode: {config.name} rotates {rotary_dim(config)} of {config.head_dim} dims"
    if config.attention_bias:
        return f"fused_decode: {config.name} has projection biases"
    if config.head_dim % 2 or config.head_dim > MAX_HEAD_DIM:
        return f"fused_decode: head_dim {config.head_dim} is odd or over {MAX_HEAD_DIM}"
    return None


@dataclass(frozen=True)
class _Layer:
    """One layer's tensors for the chain (weight-store views or derived layouts)."""

    input_norm: Tensor
    input_eps: float
    qkv_weight: Tensor
    q_norm: Tensor | None
    k_norm: Tensor | None
    qk_eps: float
    scale: float
    o_weight: Tensor
    post_norm: Tensor
    post_eps: float
    gate_up_weight: Tensor | None
    """None on an expert layer (its ``ffn`` is the bound ``moe`` op)."""
    down_weight: Tensor | None


def _derived(model: DecoderModel, site: Site, derivation: Any) -> dict[str, Any]:
    result: dict[str, Any] = model.weights.derived(
        derivation.name, site.name, lambda: derivation.fn(site.params)
    )
    return result


def _layers(model: DecoderModel) -> list[_Layer]:
    config = model.config
    reason = unsupported_reason(config)
    if reason is not None:
        raise FusedDecodeUnsupported(reason)
    layers = []
    for slots in model.slots.layers:
        if slots.ffn.op not in ("mlp", "moe"):
            raise FusedDecodeUnsupported(f"fused_decode: a layer whose ffn is {slots.ffn.op!r}")
        qkv = _derived(model, slots.qkv_proj, FUSED_QKV)
        if qkv["qkv_bias"] is not None or slots.o_proj.params.get("bias") is not None:
            raise FusedDecodeUnsupported(f"fused_decode: {config.name} has projection biases")
        mlp = (
            _derived(model, slots.ffn, FUSED_GATE_UP)
            if slots.ffn.op == "mlp"
            else {"gate_up_weight": None, "down_weight": None}
        )
        q_norm = None if slots.q_norm is None else slots.q_norm.params
        k_norm = None if slots.k_norm is None else slots.k_norm.params
        qk_eps = (q_norm or k_norm or {"eps": 0.0})["eps"]
        if q_norm is not None and k_norm is not None and q_norm["eps"] != k_norm["eps"]:
            raise FusedDecodeUnsupported("fused_decode: the Q and K norms have different eps")
        layers.append(
            _Layer(
                input_norm=slots.input_norm.params["weight"],
                input_eps=float(slots.input_norm.params["eps"]),
                qkv_weight=qkv["qkv_weight"],
                q_norm=None if q_norm is None else q_norm["weight"].contiguous(),
                k_norm=None if k_norm is None else k_norm["weight"].contiguous(),
                qk_eps=float(qk_eps),
                scale=float(slots.attention.params["scale"]),
                o_weight=slots.o_proj.params["weight"],
                post_norm=slots.post_attention_norm.params["weight"],
                post_eps=float(slots.post_attention_norm.params["eps"]),
                gate_up_weight=mlp["gate_up_weight"],
                down_weight=mlp["down_weight"],
            )
        )
    return layers


ATTENTION_PROGRAMS = 24 * 132
"""Split-KV programs above which the default attention launch doubles its split (24 per SM of an
H200; the sweep's best at batch 30, context 1,085).
"""


def attention_default(
    *, cache_batch: int, kv_heads: int, cache_len: int, head_dim: int = 128
) -> Any:
    """The split-KV attention launch for a cache of ``cache_len`` positions: tensor-core scores,
    splits of 64 positions doubled (up to 512) while ``batch x kv_heads x splits`` exceeds
    :data:`ATTENTION_PROGRAMS`, blocks of 32 for heads over 128 wide (docs/design/kernels.md).
    """
    from kiln.ops.kernels.decode_attention import DecodeAttentionConfig

    split = 64
    while split < 512 and cache_batch * kv_heads * -(-cache_len // split) > ATTENTION_PROGRAMS:
        split *= 2
    return DecodeAttentionConfig(split_s=split, block_s=64 if head_dim <= 128 else 32, use_dot=True)


class FusedDecode:
    """The fused decode step of ``model`` (the contract of :meth:`DecoderModel.decode_step`);
    built once per experiment. The bound ops serve the steps the fused path does not take.

    Raises:
        FusedDecodeUnsupported: the model does not fit, or a parameter is unknown or out of
            range.
        kiln.ops.kernels.runtime.KernelUnavailableError: no Triton, or a CPU without the
            interpreter.
    """

    def __init__(self, model: DecoderModel, params: Mapping[str, str]) -> None:
        runtime.require(model.cache.lengths.device)
        from kiln.ops.kernels import (
            add_rms_norm,
            decode_attention,
            gemv,
            norm_gemv,
            qk_norm_rope,
            qkv_rope,
        )

        # The kernels, imported once here (Triton decides compiled vs interpreted at import):
        # the step below runs them without a lookup per call.
        self._qkv_rope = qkv_rope.rms_norm_qkv_rope
        self._qk_norm_rope = qk_norm_rope.qk_norm_rope
        self._attention = decode_attention.decode_attention
        self._gemv = gemv.gemv
        self._norm_gemv = norm_gemv.rms_norm_gemv
        self._add_rms_norm = add_rms_norm.add_rms_norm

        self.model = model
        self.params, projections = _int_params(params)
        self.pdl: int = self.params.get("pdl", DEFAULT_PDL)
        self._eager: Callable[[Tensor], Tensor] = model.decode_step
        self.layers = _layers(model)
        rope = _derived(model, model.slots.layers[0].rope, COS_SIN_TABLE)
        self.cos, self.sin = rope["cos"], rope["sin"]
        final = model.slots.final_norm.params
        self.final_norm, self.final_eps = final["weight"], float(final["eps"])
        self.lm_weight: Tensor = model.slots.lm_head.params["weight"]
        config = model.config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.max_m: int = gemv.MAX_M
        #: Batches below this run the matrix-vector kernels, from it up tensor-core GEMMs.
        self.tensor_core_batch = {
            None: TENSOR_CORE_BATCH,
            "gemv": self.max_m + 1,
            "tensor_core": 1,
        }[projections]
        b = max(1, model.cache.batch or 1)
        p = self.params
        hidden, inter = config.hidden_size, config.intermediate_size
        q_width = self.num_heads * self.head_dim
        qkv_rows = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        m = min(b, self.max_m)
        self.o_config = self._tuned(gemv.default_config(hidden, q_width, m=m), p.get("o_block_n"))
        self.gate_up_config = self._tuned(
            gemv.default_config(inter, hidden, m=m, paired=True), p.get("gate_up_block_n")
        )
        self.down_config = self._tuned(
            gemv.default_config(hidden, inter, m=m), p.get("down_block_n"), p.get("down_split_k")
        )
        self.lm_config = self._tuned(
            gemv.default_config(config.vocab_size, hidden, m=m), p.get("lm_block_n")
        )
        self.qkv_config = self._tuned(
            qkv_rope.default_qkv_rope_config(
                self.num_heads, self.num_kv_heads, self.head_dim, hidden
            ),
            p.get("qkv_block"),
        )
        self.qkv_gemv_config = self._tuned(
            gemv.default_config(qkv_rows, hidden, m=m), p.get("qkv_block")
        )
        self.attention_config = self._attention_config(model)

    def _attention_config(self, model: DecoderModel) -> Any:
        attention = attention_default(
            cache_batch=model.cache.batch or 1,
            kv_heads=self.num_kv_heads,
            cache_len=model.cache.max_len,
            head_dim=self.head_dim,
        )
        p = self.params
        changes: dict[str, int] = {}
        if "split_s" in p:
            changes["split_s"] = p["split_s"]
            changes["block_s"] = min(attention.block_s, p["split_s"])
        if "num_warps" in p:
            changes["num_warps"] = p["num_warps"]
        if "fused_combine" in p:
            changes["fused_combine"] = bool(p["fused_combine"])
        changes["pdl"] = self.pdl
        try:
            return replace(attention, **changes)
        except ValueError as exc:
            raise FusedDecodeUnsupported(f"fused_decode: {exc}") from None

    def _tuned(self, config: Any, block_n: int | None, split_k: int | None = None) -> Any:
        """``config`` (a kernel's default for its shape) with the candidate's parameters."""
        changes: dict[str, int] = {}
        if block_n is not None:
            changes["block_n"] = block_n
        if split_k is not None:
            changes["split_k"] = split_k
        changes["pdl"] = self.pdl
        for key in ("block_k", "num_warps"):
            if key in self.params:
                changes[key] = self.params[key]
        try:
            return replace(config, **changes)
        except ValueError as exc:
            raise FusedDecodeUnsupported(f"fused_decode: {exc}") from None

    def uses_tensor_cores(self, batch: int) -> bool:
        """Whether a step at ``batch`` runs its products as tensor-core GEMMs."""
        return batch >= self.tensor_core_batch or batch > self.max_m

    def __call__(self, tokens: Tensor) -> Tensor:
        """One decode step: ``tokens [B, 1]`` int64 -> ``[B, V]`` float32 logits (rounded to the
        model dtype first). Raises CacheCapacityError as the eager step.
        """
        cache = self.model.cache
        if tokens.shape != (cache.batch, 1):
            return self._eager(tokens)
        if self.uses_tensor_cores(tokens.shape[0]):
            return self._gemm_step(tokens, cache)
        return self._gemv_step(tokens, cache)

    def _prologue(self, i: int, layer: _Layer, x: Tensor, pos: Tensor, cache: Any) -> Tensor:
        """q ``[B, Hq, D]`` from the QKV product; Q/K norms, RoPE and the cache write."""
        return self._qk_norm_rope(
            x, layer.q_norm, layer.k_norm, layer.qk_eps, self.cos, self.sin, pos,
            cache.k[i], cache.v[i], num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, pdl=self.pdl,
        )  # fmt: skip

    def _experts(self, i: int, x: Tensor, residual: Tensor) -> Tensor:
        """``residual`` plus layer ``i``'s bound ``moe`` op on the normed ``x [B, H]`` -> ``[B,
        H]`` (the add fused into ``triton_gather``'s down kernel where it runs)."""
        ffn = self.model.ops.layers[i].ffn
        fused = moe_triton.with_residual(ffn, x, residual)
        if fused is not None:
            return fused
        out: Tensor = ffn(x[:, None, :])
        return residual + out[:, 0]

    def _gemv_step(self, tokens: Tensor, cache: Any) -> Tensor:
        """The step with matrix-vector products."""
        rms_norm_qkv_rope, decode_attention = self._qkv_rope, self._attention
        gemv, rms_norm_gemv = self._gemv, self._norm_gemv
        positions, seq_lens = cache.next_positions()
        b = tokens.shape[0]
        s = self.model.ops.embedding(tokens)[:, 0]  # [B, H] residual stream
        pos = positions[:, 0]
        for i, layer in enumerate(self.layers):
            if layer.q_norm is None and layer.k_norm is None:
                q = rms_norm_qkv_rope(
                    s, layer.input_norm, layer.input_eps, layer.qkv_weight, self.cos,
                    self.sin, pos, cache.k[i], cache.v[i], num_heads=self.num_heads,
                    num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                    config=self.qkv_config,
                )  # fmt: skip
            else:
                qkv = rms_norm_gemv(
                    s, layer.input_norm, layer.input_eps, layer.qkv_weight,
                    config=self.qkv_gemv_config,
                )  # fmt: skip
                q = self._prologue(i, layer, qkv, pos, cache)
            attn = decode_attention(
                q, cache.k[i][:b], cache.v[i][:b], seq_lens, scale=layer.scale,
                config=self.attention_config,
            )  # fmt: skip
            s = gemv(attn.reshape(b, -1), layer.o_weight, residual=s, config=self.o_config)
            if layer.gate_up_weight is None or layer.down_weight is None:
                x, _ = self._add_rms_norm(s, None, layer.post_norm, layer.post_eps)
                s = self._experts(i, x, s)
                continue
            act = rms_norm_gemv(
                s, layer.post_norm, layer.post_eps, layer.gate_up_weight,
                activation="silu_mul", config=self.gate_up_config,
            )  # fmt: skip
            s = gemv(act, layer.down_weight, residual=s, config=self.down_config)
        logits = rms_norm_gemv(
            s, self.final_norm, self.final_eps, self.lm_weight, config=self.lm_config
        )
        cache.advance()
        return logits.float()

    def _gemm_step(self, tokens: Tensor, cache: Any) -> Tensor:
        """The step with cuBLAS GEMMs, each residual add fused into the next RMSNorm."""
        add_rms_norm, decode_attention = self._add_rms_norm, self._attention
        positions, seq_lens = cache.next_positions()
        b = tokens.shape[0]
        s = self.model.ops.embedding(tokens)[:, 0]  # [B, H] residual stream
        pos = positions[:, 0]
        delta: Tensor | None = None  # the last product, not yet added to s
        for i, layer in enumerate(self.layers):
            x, s = add_rms_norm(*_pending(s, delta), layer.input_norm, layer.input_eps)
            q = self._prologue(i, layer, F.linear(x, layer.qkv_weight), pos, cache)
            attn = decode_attention(
                q, cache.k[i][:b], cache.v[i][:b], seq_lens, scale=layer.scale,
                config=self.attention_config,
            )  # fmt: skip
            o = F.linear(attn.reshape(b, -1), layer.o_weight)
            x, s = add_rms_norm(o, s, layer.post_norm, layer.post_eps)
            if layer.gate_up_weight is None or layer.down_weight is None:
                out: Tensor = self.model.ops.layers[i].ffn(x[:, None, :])
                delta = out[:, 0]
                continue
            gate, up = F.linear(x, layer.gate_up_weight).chunk(2, dim=-1)
            delta = F.linear(F.silu(gate) * up, layer.down_weight)
        x, _ = add_rms_norm(*_pending(s, delta), self.final_norm, self.final_eps)
        logits = F.linear(x, self.lm_weight)
        cache.advance()
        return logits.float()


def _pending(s: Tensor, delta: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """``(x, residual)`` of ``add_rms_norm`` adding ``delta`` (if any) to the residual stream
    ``s``.
    """
    return (s, None) if delta is None else (delta, s)


def install(model: DecoderModel, params: Mapping[str, str]) -> Callable[[], None]:
    """Route ``model``'s decode step through :class:`FusedDecode` (this instance only) and return
    the undo; apply before ``cuda_graph``. Raises as :class:`FusedDecode`.
    """
    fused = FusedDecode(model, params)
    model.__dict__["decode_step"] = fused

    def undo() -> None:
        if model.__dict__.get("decode_step") is fused:
            model.__dict__.pop("decode_step")

    return undo
