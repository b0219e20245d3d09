"""The forward pass of a decoder (Llama, Qwen3, Qwen3-MoE, Mixtral, DeepSeek-V3, MiniMax-M2),
written only in op-slot calls.

Per layer: ``input_norm`` (adds the residual), ``qkv_proj``, ``q_norm``/``k_norm`` (Qwen3: per
head; MiniMax-M2 ``per_layer``: over each token's heads together, :func:`_norm_heads`),
``rope``, KV-cache write, ``attention``, ``o_proj``, ``post_attention_norm`` (adds the
residual), ``ffn`` (``mlp``, or ``moe`` on expert layers) plus ``shared_ffn`` where there is
one; then ``final_norm`` and ``lm_head``. A latent-attention layer (DeepSeek-V3, transformers'
``DeepseekV3Attention``): ``qkv_proj`` (``mla_proj``) gives the query's two parts, the latent and
the rope key; ``rope`` rotates the rope parts; the cache stores the latent and the rope key;
``attention`` (``mla_attention``) reads them. A GLM-5 layer (``GlmMoeDsaAttention``) also runs
its sparse indexer: ``index_proj`` and ``rope`` give the index queries and key, the key is
cached after the rope key (:mod:`kiln.workloads.models.kv_cache`), ``indexer`` picks each
query's top-k slots and ``attention`` attends to those only (``topk_indices``).
"""

from __future__ import annotations

import torch

from kiln.workloads.config import ModelConfig
from kiln.workloads.models.binding import BoundOp, OpBinding
from kiln.workloads.models.expert_load import ExpertLoadReport
from kiln.workloads.models.kv_cache import StaticKVCache
from kiln.workloads.models.slots import LayerSlots, ModelSlots, Site, dense_decoder_slots
from kiln.workloads.weights import WeightStore

Tensor = torch.Tensor


def _norm_heads(norm: BoundOp, x: Tensor) -> Tensor:
    """``norm`` (an ``rms_norm``) over each token's heads together: ``x [B, H, T, D]`` seen as
    ``[B, T, H*D]`` (transformers' ``MiniMaxM2Attention`` norms the projection before splitting
    heads), returned as ``[B, H, T, D]``."""
    b, h, t, d = x.shape
    normed, _ = norm(x.transpose(1, 2).reshape(b, t, h * d))
    return normed.unflatten(-1, (h, d)).transpose(1, 2)


class DecoderModel:
    """A decoder over a weight store (may be shared, e.g. with the reference) and a static KV
    cache.

    Attributes:
        slots: the sites (op, HF prefix, base params) of every op call; ``ops`` the same bound.
        expert_load: for an MoE model whose routers were biased at build, the load measured on
            held-out prompts; else None.
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: WeightStore,
        cache: StaticKVCache,
        binding: OpBinding | None = None,
    ) -> None:
        self.config = config
        self.weights = weights
        self.cache = cache
        self.slots: ModelSlots[Site] = dense_decoder_slots(
            config, weights, max_positions=cache.max_len
        )
        self.binding = binding or OpBinding.from_recipe()
        self.ops: ModelSlots[BoundOp] = self.binding.bind_model(self.slots, weights)
        self.expert_load: ExpertLoadReport | None = None

    def rebind(self, binding: OpBinding) -> None:
        """Swap op implementations (hot reload); weights and cache stay, derived layouts are
        cached.
        """
        ops = binding.bind_model(self.slots, self.weights)
        self.binding, self.ops = binding, ops

    def _layer(
        self,
        i: int,
        ops: LayerSlots[BoundOp],
        h: Tensor,
        residual: Tensor | None,
        positions: Tensor,
        seq_lens: Tensor,
    ) -> tuple[Tensor, Tensor]:
        x, residual = ops.input_norm(h, residual)
        if self.config.mla is not None:
            q_nope, q_rope, latent, k_rope = ops.qkv_proj(x)
            q_rope, k_rope = ops.rope(q_rope, k_rope, positions)
            if ops.index_proj is None or ops.indexer is None:
                latent_cache, rope_cache = self.cache.write(i, latent, k_rope, positions)
                attn = ops.attention(q_nope, q_rope, latent_cache, rope_cache, positions, seq_lens)
            else:  # GLM-5: the index key is cached after the rope key
                q_index, k_index, head_w = ops.index_proj(x)
                q_index, k_index = ops.rope(q_index, k_index, positions)
                both = torch.cat((k_rope, k_index.to(k_rope.dtype)), dim=-1)
                latent_cache, tail = self.cache.write(i, latent, both, positions)
                rope_cache, index_cache = tail.split([k_rope.shape[-1], k_index.shape[-1]], -1)
                topk = ops.indexer(q_index, head_w, index_cache, positions, seq_lens)
                attn = ops.attention(
                    q_nope, q_rope, latent_cache, rope_cache, positions, seq_lens,
                    topk_indices=topk,
                )  # fmt: skip
        else:
            q, k, v = ops.qkv_proj(x)
            if ops.q_norm is not None and ops.k_norm is not None:
                whole = self.config.qk_norm_type == "per_layer"
                q = _norm_heads(ops.q_norm, q) if whole else ops.q_norm(q)[0]
                k = _norm_heads(ops.k_norm, k) if whole else ops.k_norm(k)[0]
            q, k = ops.rope(q, k, positions)
            k_cache, v_cache = self.cache.write(i, k, v, positions)
            attn = ops.attention(q, k_cache, v_cache, positions, seq_lens)
        x, residual = ops.post_attention_norm(ops.o_proj(attn), residual)
        out = ops.ffn(x)
        if ops.shared_ffn is not None:
            out = out + ops.shared_ffn(x)
        return out, residual

    def forward(self, tokens: Tensor, positions: Tensor, seq_lens: Tensor) -> Tensor:
        """Final-normed hidden states ``[B, T, H]`` (model dtype) of ``tokens [B, T]`` at
        ``positions [B, T]``, ``seq_lens [B]`` the cache length after the step (int64 all);
        writes the step's K/V but not the cache's lengths.
        """
        h = self.ops.embedding(tokens)
        residual: Tensor | None = None
        for i, layer in enumerate(self.ops.layers):
            h, residual = self._layer(i, layer, h, residual, positions, seq_lens)
        x, _ = self.ops.final_norm(h, residual)
        return x

    @torch.no_grad()
    def prefill(
        self, tokens: Tensor, seq_lens: Tensor | None = None, *, all_logits: bool = False
    ) -> Tensor:
        """Start new sequences from prompts (the cache's previous contents are dropped).

        Args:
            tokens: ``[B, T]`` int64 prompts, right-padded.
            seq_lens: ``[B]`` int64 lengths in ``1..T``; all T when None.
            all_logits: every position's logits instead of the last valid one's.

        Returns float32 logits ``[B, V]`` (or ``[B, T, V]``). Raises CacheCapacityError when the
        cache cannot hold them.
        """
        b, t = tokens.shape
        if seq_lens is None:
            seq_lens = torch.full((b,), t, dtype=torch.int64)
        seq_lens = seq_lens.to(tokens.device)
        positions = self.cache.start(seq_lens, t)
        hidden = self.forward(tokens, positions, seq_lens)
        if not all_logits:
            hidden = hidden[torch.arange(b, device=hidden.device), seq_lens - 1]
        return self.ops.lm_head(hidden)

    @torch.no_grad()
    def decode_step(self, tokens: Tensor) -> Tensor:
        """Append one token to every active sequence: ``[B, 1]`` int64 -> ``[B, V]`` float32
        logits. CacheCapacityError when nothing is prefilled or a sequence fills the cache.
        """
        positions, seq_lens = self.cache.next_positions()
        if tokens.shape != (self.cache.batch, 1):
            raise ValueError(
                f"decode_step takes [{self.cache.batch}, 1] tokens, got {tokens.shape}"
            )
        hidden = self.forward(tokens, positions, seq_lens)
        self.cache.advance()
        return self.ops.lm_head(hidden[:, -1])

    def sample(self, logits: Tensor) -> Tensor:
        """Next tokens ``[B]`` int64 from ``[B, V]`` logits (the ``sampler`` slot)."""
        return self.ops.sampler(logits)

    @torch.no_grad()
    def generate(self, tokens: Tensor, seq_lens: Tensor | None = None, steps: int = 1) -> Tensor:
        """Greedy continuation (prefill, then ``steps - 1`` decode steps): ``[B, steps]`` int64."""
        out = [self.sample(self.prefill(tokens, seq_lens))]
        for _ in range(steps - 1):
            out.append(self.sample(self.decode_step(out[-1][:, None])))
        return torch.stack(out, dim=1)
