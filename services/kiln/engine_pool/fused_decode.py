"""The ``fused_decode`` transform: a decode step as a short chain of fused Triton kernels.

At batch 1 a decode step reads every weight once and does little else, so its floor is the
weights' bytes over memory bandwidth (Llama-3.2-1B: 2.47 GB / 4.26 TB/s ≈ 0.58 ms on an H200) and
what separates an implementation from that floor is how far each kernel is from full bandwidth
and how many kernels there are (each launch costs a few µs even inside a CUDA graph). The op
slots of :class:`~kiln.workloads.models.decoder.DecoderModel` cost ~17 kernels a layer; this
transform fuses across op boundaries (DESIGN.md: "fusions across ops") into six a layer:

1. RMSNorm of the residual stream → fused QKV matrix-vector product → RoPE → K/V written into
   the static cache (:func:`kiln.ops.kernels.qkv_rope.rms_norm_qkv_rope`);
2. split-KV (flash-decoding) attention, and
3. its split combine (:func:`kiln.ops.kernels.decode_attention.decode_attention`);
4. ``o_proj`` with the residual add as epilogue (:func:`kiln.ops.kernels.gemv.gemv`);
5. RMSNorm → fused gate/up matrix-vector product → SiLU·mul
   (:func:`kiln.ops.kernels.norm_gemv.rms_norm_gemv`);
6. ``down`` with the residual add as epilogue;

then the final RMSNorm fused into the LM head. The residual stream is carried between layers by
the epilogues, so no separate norm or add kernel runs. Rounding follows the reference ops (each
projection rounded to the model dtype, norms and RoPE in float32), so outputs match the reference
forward within the engine's bf16 tolerance.

Parameters (strings, as candidates carry them; unset = the kernels' default for each shape):
``block_k``, ``num_warps`` (all matrix-vector kernels), ``o_block_n``, ``gate_up_block_n``,
``down_block_n``, ``down_split_k``, ``lm_block_n`` (output rows per program of each product),
``qkv_block`` (rotary pairs per program of the QKV kernel), ``split_s`` (cache positions per
attention split), ``fused_combine`` (1: the attention splits are combined by the last program
of each group instead of a second kernel; 0: two kernels), ``pdl`` (programmatic dependent
launch of every kernel of the chain, :mod:`kiln.ops.kernels.pdl`: 0 off, 1 wait then release
the next kernel, 2 release then wait; default :data:`DEFAULT_PDL`; Hopper and later only,
ignored elsewhere).

Applies to dense decoders whose layers are Llama-shaped (no Q/K norms, no projection biases, no
experts); other models, batches over :data:`kiln.ops.kernels.gemv.MAX_M`, and steps of more than
one token (prefill, the check's prompts) run through the bound ops as before. Needs Triton on a
CUDA device (or Triton's interpreter, for tests).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from kiln.ops.kernels import runtime
from kiln.ops.mlp import FUSED_GATE_UP
from kiln.ops.qkv_proj import FUSED_QKV
from kiln.ops.rope import COS_SIN_TABLE
from kiln.workloads.models import DecoderModel
from kiln.workloads.models.slots import Site

Tensor = torch.Tensor

PARAMS = (
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


DEFAULT_PDL = 2
"""``pdl`` when a candidate leaves it unset: release the next kernel at entry, then wait.
Measured on an H200 (Llama-3.2-1B, batch 1, context 1,085, step in a CUDA graph): 858 µs a
step against 926-929 without PDL and 896 with mode 1 (``benchmarks/fused_decode_profile.py``);
through the engine, 0.909-0.920 ms against 0.973-0.986 (``benchmarks/decode_candidates.py``;
benchmarks/RESULTS.md)."""


class FusedDecodeUnsupported(ValueError):
    """The model or the parameters do not fit the fused path (the message says why)."""


def _int_params(params: Mapping[str, str]) -> dict[str, int]:
    unknown = sorted(set(params) - set(PARAMS))
    if unknown:
        raise FusedDecodeUnsupported(
            f"fused_decode: unknown parameter(s) {unknown} (known: {list(PARAMS)})"
        )
    out: dict[str, int] = {}
    for key, text in params.items():
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
    return out


@dataclass(frozen=True)
class _Layer:
    """One layer's tensors for the fused chain (views of, or layouts derived from, the
    engine's weight store)."""

    input_norm: Tensor
    input_eps: float
    qkv_weight: Tensor
    scale: float
    o_weight: Tensor
    post_norm: Tensor
    post_eps: float
    gate_up_weight: Tensor
    down_weight: Tensor


def _derived(model: DecoderModel, site: Site, derivation: Any) -> dict[str, Any]:
    result: dict[str, Any] = model.weights.derived(
        derivation.name, site.name, lambda: derivation.fn(site.params)
    )
    return result


def _layers(model: DecoderModel) -> list[_Layer]:
    config = model.config
    if config.is_moe:
        raise FusedDecodeUnsupported(f"fused_decode: {config.name} has experts (dense models only)")
    layers = []
    for slots in model.slots.layers:
        if slots.q_norm is not None or slots.k_norm is not None:
            raise FusedDecodeUnsupported(
                f"fused_decode: {config.name} normalises queries and keys (Qwen3-style), "
                "which the fused QKV kernel does not do"
            )
        if slots.ffn.op != "mlp":
            raise FusedDecodeUnsupported("fused_decode: a layer without a dense MLP")
        qkv = _derived(model, slots.qkv_proj, FUSED_QKV)
        if qkv["qkv_bias"] is not None or slots.o_proj.params.get("bias") is not None:
            raise FusedDecodeUnsupported(f"fused_decode: {config.name} has projection biases")
        mlp = _derived(model, slots.ffn, FUSED_GATE_UP)
        layers.append(
            _Layer(
                input_norm=slots.input_norm.params["weight"],
                input_eps=float(slots.input_norm.params["eps"]),
                qkv_weight=qkv["qkv_weight"],
                scale=float(slots.attention.params["scale"]),
                o_weight=slots.o_proj.params["weight"],
                post_norm=slots.post_attention_norm.params["weight"],
                post_eps=float(slots.post_attention_norm.params["eps"]),
                gate_up_weight=mlp["gate_up_weight"],
                down_weight=mlp["down_weight"],
            )
        )
    return layers


ATTENTION_PROGRAMS = 4 * 132
"""Split-KV programs the default attention launch aims at most for (4 per SM of an H200)."""


def attention_default(*, cache_batch: int, kv_heads: int, cache_len: int) -> Any:
    """The split-KV attention launch for a cache of ``cache_len`` positions: the smallest split
    (from 32 positions, doubling up to 512) whose ``batch x kv_heads x splits`` programs stay
    within :data:`ATTENTION_PROGRAMS`. On an H200, Llama-3.2-1B at batch 1 and context 1,085:
    split 32 (34 splits, 272 programs), 151 µs for 16 layers against 433 µs at the kernel's
    default split of 256 (``benchmarks/fused_decode_profile.py --sweep``)."""
    from kiln.ops.kernels.decode_attention import DecodeAttentionConfig

    split = 32
    while split < 512 and cache_batch * kv_heads * -(-cache_len // split) > ATTENTION_PROGRAMS:
        split *= 2
    return DecodeAttentionConfig(split_s=split, block_s=32 if split <= 64 else 64)


class FusedDecode:
    """The fused decode step of ``model`` (same contract as
    :meth:`DecoderModel.decode_step`); built once per experiment.

    Args:
        model: a dense Llama-shaped decoder on a device Triton runs on, bound to any ops (they
            serve the steps the fused path does not take).
        params: the transform's parameters (strings).

    Raises:
        FusedDecodeUnsupported: the model does not fit (MoE, Q/K norms, biases) or a parameter
            is unknown or not a positive integer.
        kiln.ops.kernels.runtime.KernelUnavailableError: no Triton, or a CPU without the
            interpreter.
    """

    def __init__(self, model: DecoderModel, params: Mapping[str, str]) -> None:
        runtime.require(model.cache.lengths.device)
        from kiln.ops.kernels import decode_attention, gemv, norm_gemv, qkv_rope

        # The kernels, imported once here (Triton decides compiled vs interpreted at import):
        # the step below runs them without a lookup per call.
        self._qkv_rope = qkv_rope.rms_norm_qkv_rope
        self._attention = decode_attention.decode_attention
        self._gemv = gemv.gemv
        self._norm_gemv = norm_gemv.rms_norm_gemv

        self.model = model
        self.params = _int_params(params)
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
        p = self.params
        hidden, inter = config.hidden_size, config.intermediate_size
        q_width = self.num_heads * self.head_dim
        self.o_config = self._tuned(gemv.default_config(hidden, q_width), p.get("o_block_n"))
        self.gate_up_config = self._tuned(
            gemv.default_config(inter, hidden, paired=True), p.get("gate_up_block_n")
        )
        self.down_config = self._tuned(
            gemv.default_config(hidden, inter), p.get("down_block_n"), p.get("down_split_k")
        )
        self.lm_config = self._tuned(
            gemv.default_config(config.vocab_size, hidden), p.get("lm_block_n")
        )
        self.qkv_config = self._tuned(
            qkv_rope.default_qkv_rope_config(
                self.num_heads, self.num_kv_heads, self.head_dim, hidden
            ),
            p.get("qkv_block"),
        )
        attention = attention_default(
            cache_batch=model.cache.batch or 1,
            kv_heads=self.num_kv_heads,
            cache_len=model.cache.max_len,
        )
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
            attention = replace(attention, **changes)
        except ValueError as exc:
            raise FusedDecodeUnsupported(f"fused_decode: {exc}") from None
        self.attention_config = attention

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

    def __call__(self, tokens: Tensor) -> Tensor:
        """One decode step.

        Args:
            tokens: ``[B, 1]`` int64, B the cache's active batch.

        Returns:
            ``[B, V]`` float32 logits (rounded to the model dtype first, as the reference LM
            head does).

        Raises:
            kiln.workloads.models.kv_cache.CacheCapacityError: as the eager step.
        """
        cache = self.model.cache
        b = tokens.shape[0]
        if tokens.shape != (cache.batch, 1) or b > self.max_m:
            return self._eager(tokens)
        return self._step(tokens, cache)

    def _step(self, tokens: Tensor, cache: Any) -> Tensor:
        rms_norm_qkv_rope, decode_attention = self._qkv_rope, self._attention
        gemv, rms_norm_gemv = self._gemv, self._norm_gemv
        positions, seq_lens = cache.next_positions()
        b = tokens.shape[0]
        s = self.model.ops.embedding(tokens)[:, 0]  # [B, H] residual stream
        pos = positions[:, 0]
        for i, layer in enumerate(self.layers):
            q = rms_norm_qkv_rope(
                s,
                layer.input_norm,
                layer.input_eps,
                layer.qkv_weight,
                self.cos,
                self.sin,
                pos,
                cache.k[i],
                cache.v[i],
                num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim,
                config=self.qkv_config,
            )
            attn = decode_attention(
                q,
                cache.k[i][:b],
                cache.v[i][:b],
                seq_lens,
                scale=layer.scale,
                config=self.attention_config,
            )
            s = gemv(attn.reshape(b, -1), layer.o_weight, residual=s, config=self.o_config)
            act = rms_norm_gemv(
                s,
                layer.post_norm,
                layer.post_eps,
                layer.gate_up_weight,
                activation="silu_mul",
                config=self.gate_up_config,
            )
            s = gemv(act, layer.down_weight, residual=s, config=self.down_config)
        logits = rms_norm_gemv(
            s, self.final_norm, self.final_eps, self.lm_weight, config=self.lm_config
        )
        cache.advance()
        return logits.float()


def install(model: DecoderModel, params: Mapping[str, str]) -> Callable[[], None]:
    """Route ``model``'s decode step through :class:`FusedDecode` (this instance only);
    returns the undo. Apply before ``cuda_graph`` so the graph captures the fused step.

    Raises:
        FusedDecodeUnsupported, kiln.ops.kernels.runtime.KernelUnavailableError: as
            :class:`FusedDecode`.
    """
    fused = FusedDecode(model, params)
    model.__dict__["decode_step"] = fused

    def undo() -> None:
        if model.__dict__.get("decode_step") is fused:
            model.__dict__.pop("decode_step")

    return undo
