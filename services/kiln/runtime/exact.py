"""The reference forward in float32 arithmetic over the model's own (e.g. bfloat16) weights, for the
gate's noise estimate ``max |reference - exact|`` (docs/design/engine.md, "Check").

Same graph and weight values, every op's ``reference`` fed float32 (weights upcast one layer at a
time: extra memory is one layer's weights, plus one layer's cache rows for a step on the engine's
cache); nothing of the model, its cache or its weight store is written.

- :func:`exact_step`: one decode step from the cache's current state, its lengths and buffers
  untouched.
- :func:`exact_model`: a model view with its own float32 cache (``max_batch x max_len``) for a
  prefill and decode steps of fresh prompts.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from kiln.ops.registry import REFERENCE, get
from kiln.workloads.models.binding import BoundOp
from kiln.workloads.models.decoder import DecoderModel
from kiln.workloads.models.kv_cache import StaticKVCache
from kiln.workloads.models.slots import LayerSlots, ModelSlots, Site

Tensor = torch.Tensor


def _upcast(params: Mapping[str, Any]) -> dict[str, Any]:
    return {
        k: v.float() if isinstance(v, Tensor) and v.is_floating_point() else v
        for k, v in params.items()
    }


def _bind(site: Site) -> BoundOp:
    """``site``'s reference implementation over float32 copies of its tensor params."""
    fn = get(site.op, REFERENCE).fn
    params = _upcast(site.params)

    def call(*args: Any, **kw: Any) -> Any:
        return fn(*args, **params, **kw)

    return call


class _Layers(Sequence[LayerSlots[BoundOp]]):
    """A model's layers bound on access (one layer's float32 weights alive at a time while the
    forward iterates)."""

    def __init__(self, layers: tuple[LayerSlots[Site], ...]) -> None:
        self._layers = layers

    def __len__(self) -> int:
        return len(self._layers)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [layer.map(_bind) for layer in self._layers[i]]
        return self._layers[i].map(_bind)

    def __iter__(self) -> Iterator[LayerSlots[BoundOp]]:
        return (layer.map(_bind) for layer in self._layers)


class _Ops:
    """:class:`ModelSlots` of float32 reference ops, each bound when read."""

    def __init__(self, slots: ModelSlots[Site]) -> None:
        self._slots = slots
        self.layers = _Layers(slots.layers)

    @property
    def embedding(self) -> BoundOp:
        return _bind(self._slots.embedding)

    @property
    def final_norm(self) -> BoundOp:
        return _bind(self._slots.final_norm)

    @property
    def lm_head(self) -> BoundOp:
        return _bind(self._slots.lm_head)

    @property
    def sampler(self) -> BoundOp:
        return _bind(self._slots.sampler)


class _StepCache:
    """One decode step on a copy: positions from ``cache``'s state, each layer's active rows
    copied to float32 when written; ``cache`` is never changed."""

    def __init__(self, cache: StaticKVCache) -> None:
        self._cache = cache
        self.batch = cache.batch
        self.max_len = cache.max_len

    def next_positions(self) -> tuple[Tensor, Tensor]:
        return self._cache.next_positions()

    def advance(self, steps: int = 1) -> None:
        """Nothing to record: the step's copies are dropped."""

    def write(self, layer: int, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        b = k.shape[0]
        rows = torch.arange(b, device=positions.device)[:, None]
        k_cache = self._cache.k[layer][:b].float()
        v_cache = self._cache.v[layer][:b].float()
        k_cache[rows, :, positions] = k.transpose(1, 2).float()
        v_cache[rows, :, positions] = v.transpose(1, 2).float()
        return k_cache, v_cache


def _view(model: DecoderModel, cache: Any) -> DecoderModel:
    view = object.__new__(DecoderModel)  # no __init__: it would bind every layer at once
    view.config, view.weights, view.cache = model.config, model.weights, cache
    view.slots, view.binding, view.expert_load = model.slots, model.binding, None
    view.ops = _Ops(model.slots)  # type: ignore[assignment]
    return view


@torch.no_grad()
def exact_step(model: DecoderModel, tokens: Tensor) -> Tensor:
    """``model.decode_step(tokens)`` in float32 arithmetic, from its cache's current state.

    Args:
        model: the reference model (its cache holds the state to step from).
        tokens: ``[B, 1]`` int64, B the cache's active batch.

    Returns:
        ``[B, V]`` float32 logits.

    Raises:
        kiln.workloads.models.kv_cache.CacheCapacityError: as ``decode_step``.
    """
    return _view(model, _StepCache(model.cache)).decode_step(tokens)


def exact_model(model: DecoderModel, *, max_batch: int, max_len: int) -> DecoderModel:
    """A view of ``model`` computing in float32 with its own float32 cache of ``max_batch``
    sequences of ``max_len`` slots (use its ``prefill`` then ``decode_step``)."""
    cache = StaticKVCache.for_config(
        model.config,
        max_batch=max_batch,
        max_len=max_len,
        dtype=torch.float32,
        device=model.cache.lengths.device,
    )
    return _view(model, cache)
