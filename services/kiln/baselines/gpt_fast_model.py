"""A compact gpt-fast-style dense decoder (after pytorch-labs/gpt-fast ``model.py``): Llama and
Qwen3 dense, fused ``wqkv`` and ``w13`` weights, a static KV cache per layer, SDPA with a
boolean causal mask, no host sync in a step. RoPE rotates halves (kiln's layout); rounding as
kiln's reference ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.workloads.config import ModelConfig
from kiln.workloads.models.rope_frequencies import inv_freq
from kiln.workloads.weights import LM_HEAD, WeightStore

Tensor = torch.Tensor
FAMILIES = ("llama", "qwen3")
"""``model_type`` values this model builds (dense configs only)."""


def unsupported(config: ModelConfig) -> str | None:
    """Why this model cannot build ``config`` (another family, MoE, MLA, biases), or None."""
    if config.model_type not in FAMILIES:
        return f"builds dense Llama and Qwen3 only, not {config.model_type!r}"
    if config.is_moe:
        return f"builds dense models only, not {config.name!r} (mixture of experts)"
    if config.mla is not None:
        return f"builds grouped-query attention only, not {config.name!r} (MLA)"
    if config.attention_bias or config.raw.get("mlp_bias"):
        return f"builds bias-free projections only, not {config.name!r} (biases)"
    return None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """kiln's reference RMSNorm: normalised in float32, cast to ``x.dtype``, then scaled."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate halves of ``x [B, h, T, D]`` by ``cos``/``sin [T, D/2]`` float32 (result in
    ``x.dtype``).
    """
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    c, s = cos[None, None], sin[None, None]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


class Block(nn.Module):
    """One decoder layer with its KV cache buffers ``[batch, Hkv, max_len, D]``."""

    k_cache: Tensor
    v_cache: Tensor

    def __init__(
        self, config: ModelConfig, store: WeightStore, i: int, batch: int, max_len: int
    ) -> None:
        super().__init__()
        p = f"model.layers.{i}."
        a = p + "self_attn."
        self.hq, self.hkv, self.d = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.eps = config.rms_norm_eps
        self.wqkv = torch.cat(
            [store[a + "q_proj.weight"], store[a + "k_proj.weight"], store[a + "v_proj.weight"]]
        )
        self.wo = store[a + "o_proj.weight"]
        self.w13 = torch.cat([store[p + "mlp.gate_proj.weight"], store[p + "mlp.up_proj.weight"]])
        self.w2 = store[p + "mlp.down_proj.weight"]
        self.attention_norm = store[p + "input_layernorm.weight"]
        self.ffn_norm = store[p + "post_attention_layernorm.weight"]
        self.q_norm = store[a + "q_norm.weight"] if config.qk_norm else None
        self.k_norm = store[a + "k_norm.weight"] if config.qk_norm else None
        like = self.wo
        shape = (batch, self.hkv, max_len, self.d)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=like.dtype, device=like.device))
        self.register_buffer("v_cache", torch.zeros(shape, dtype=like.dtype, device=like.device))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, mask: Tensor) -> Tensor:
        """``x [B, T, H]`` at positions ``pos [T]`` int64; ``mask [1, 1, T, S]`` bool;
        ``cos``/``sin`` ``[T, D/2]`` float32. Returns ``[B, T, H]`` in ``x.dtype``."""
        b, t, _ = x.shape
        h = rms_norm(x, self.attention_norm, self.eps)
        q, k, v = F.linear(h, self.wqkv).split(
            [self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1
        )
        q = q.view(b, t, self.hq, self.d)
        k = k.view(b, t, self.hkv, self.d)
        if self.q_norm is not None and self.k_norm is not None:
            q = rms_norm(q, self.q_norm, self.eps)
            k = rms_norm(k, self.k_norm, self.eps)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(b, t, self.hkv, self.d).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache.index_copy_(2, pos, v)
        rep = self.hq // self.hkv
        keys = self.k_cache.repeat_interleave(rep, dim=1)
        values = self.v_cache.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.d**-0.5)
        x = x + F.linear(y.transpose(1, 2).reshape(b, t, self.hq * self.d), self.wo)
        h = rms_norm(x, self.ffn_norm, self.eps)
        gate, up = F.linear(h, self.w13).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, self.w2)


class GptFastTransformer(nn.Module):
    """The model with static caches of ``batch`` x ``max_len`` over kiln's weights.

    Raises:
        ValueError: a config :func:`unsupported` refuses.
        UnsupportedRopeError: a RoPE type kiln does not implement.
        kiln.workloads.weights.WeightError: a weight missing from ``store``.
    """

    cos: Tensor
    sin: Tensor
    causal_mask: Tensor

    def __init__(self, config: ModelConfig, store: WeightStore, batch: int, max_len: int) -> None:
        super().__init__()
        reason = unsupported(config)
        if reason is not None:
            raise ValueError(f"the gpt-fast baseline {reason}")
        self.eps = config.rms_norm_eps
        self.tok_embeddings = store["model.embed_tokens.weight"]
        self.output = store[LM_HEAD]
        self.norm = store["model.norm.weight"]
        self.layers = nn.ModuleList(
            Block(config, store, i, batch, max_len) for i in range(config.num_hidden_layers)
        )
        freq = inv_freq(config, self.output.device)
        angles = torch.arange(max_len, device=freq.device, dtype=torch.float32)[:, None] * freq
        self.register_buffer("cos", angles.cos())
        self.register_buffer("sin", angles.sin())
        causal = torch.ones(max_len, max_len, dtype=torch.bool, device=freq.device)
        self.register_buffer("causal_mask", torch.tril(causal))

    def forward(self, idx: Tensor, input_pos: Tensor) -> Tensor:
        """Logits ``[B, T, V]`` (model dtype) of ``idx [B, T]`` at ``input_pos [T]`` (< max_len,
        unchecked); writes their K/V.
        """
        mask = self.causal_mask[None, None, input_pos]
        cos, sin = self.cos[input_pos], self.sin[input_pos]
        x = F.embedding(idx, self.tok_embeddings)
        for layer in self.layers:
            x = layer(x, cos, sin, input_pos, mask)
        return F.linear(rms_norm(x, self.norm, self.eps), self.output)


GptFastLlama = GptFastTransformer
"""The former name (the model was Llama-only)."""


def decode_one_token(model: GptFastTransformer, x: Tensor, input_pos: Tensor) -> Tensor:
    """One decode step: ``x [B, 1]`` at ``input_pos [1]`` -> ``[B, V]`` float32 logits."""
    return model(x, input_pos)[:, -1].float()


def prefill(model: GptFastTransformer, x: Tensor) -> Tensor:
    """The prompt ``x [B, T]`` from position 0 -> the last position's ``[B, V]`` float32 logits."""
    pos = torch.arange(x.shape[1], device=x.device)
    return model(x, pos)[:, -1].float()
