"""Device memory of an engine: how large a KV cache fits, and what a step's workspace costs.

A CUDA engine sizes its measured model's static KV cache from the traffic shape *and* the
memory free once its weights are on the device: the shape's batch is kept when
``batch x (KV cache + activations per sequence)`` fits in :data:`USABLE_FRACTION` of the free
memory less :data:`RESERVE_BYTES`, and lowered (with a note) otherwise. CPU engines are capped
by ``KILN_ENGINE_MAX_BATCH`` / ``_MAX_CONTEXT`` instead (host memory is shared with the
services).
"""

from __future__ import annotations

import dataclasses

import torch

from kiln.runtime.spec import EngineSpec
from kiln.workloads.config import ModelConfig

USABLE_FRACTION = 0.9
"""Share of the device's free memory an engine's KV cache and activations may take (vLLM's
default ``gpu_memory_utilization`` is 0.9 too)."""
RESERVE_BYTES = 2 << 30
"""Kept free for CUDA graph pools, cuBLAS workspaces, torch.compile and candidates' derived
weight layouts, bytes (2 GiB)."""


class DeviceMemoryError(RuntimeError):
    """Not even one sequence at the traffic shape's context fits in the device's free memory."""


def kv_bytes_per_sequence(config: ModelConfig, layers: int, cache_len: int, elem: int) -> int:
    """KV-cache bytes of one sequence of ``cache_len`` slots over ``layers`` layers: K and V, or
    for MLA the latent and rope key (:meth:`ModelConfig.kv_elements_per_layer`)."""
    return layers * config.kv_elements_per_layer() * cache_len * elem


def activation_bytes_per_sequence(config: ModelConfig, cache_len: int, elem: int) -> int:
    """Estimated activations of one sequence in one decode step, bytes: float32 logits,
    hidden/MLP intermediates in the model dtype, float32 attention scores over the cache; for
    MLA also one layer's per-head keys and values the reference expands from the latents (model
    dtype and their float32 copies)."""
    expanded = 0
    if config.mla is not None:
        m = config.mla
        width = m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim
        expanded = config.num_attention_heads * cache_len * width * (elem + 4)
    return (
        config.vocab_size * 4
        + (4 * config.hidden_size + 3 * config.intermediate_size) * elem
        + 2 * config.num_attention_heads * cache_len * 4
        + expanded
    )


def fit_batch(spec: EngineSpec, config: ModelConfig, free_bytes: int) -> EngineSpec:
    """``spec`` with its batch lowered to what ``free_bytes`` holds (unchanged when it fits).

    Args:
        spec: the engine's spec (its ``batch_size`` from the traffic shape).
        config: the architecture (``spec.layers`` layers are held).
        free_bytes: device memory free after the weights were placed, bytes.

    Raises:
        DeviceMemoryError: not even one sequence fits.
    """
    elem = torch.empty((), dtype=getattr(torch, spec.dtype)).element_size()
    per_seq = kv_bytes_per_sequence(
        config, spec.layers, spec.cache_len, elem
    ) + activation_bytes_per_sequence(config, spec.cache_len, elem)
    budget = int(free_bytes * USABLE_FRACTION) - RESERVE_BYTES
    fits = max(0, budget) // per_seq
    if fits >= spec.batch_size:
        return spec
    if fits < 1:
        raise DeviceMemoryError(
            f"one sequence of {spec.cache_len} slots needs {per_seq / 2**30:.2f} GiB of KV cache "
            f"and activations; {free_bytes / 2**30:.2f} GiB are free on {spec.device}"
        )
    note = (
        f"batch lowered from {spec.batch_size} to {fits}: the KV cache for more does not fit in "
        f"{USABLE_FRACTION:.0%} of the {free_bytes / 2**30:.1f} GiB free on {spec.device}"
    )
    return dataclasses.replace(
        spec,
        batch_size=fits,
        check_batch=min(spec.check_batch, fits),
        notes=(*spec.notes, note),
    )


def free_bytes(device: torch.device) -> int:
    """Free memory of a CUDA device, bytes (``cudaMemGetInfo``)."""
    return int(torch.cuda.mem_get_info(device)[0])


def reset_peak(device: torch.device) -> None:
    """Start a new peak-allocation window on a CUDA device (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_allocated(device: torch.device) -> int | None:
    """Peak bytes allocated by PyTorch on a CUDA device since :func:`reset_peak`; None on CPU."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.max_memory_allocated(device))
