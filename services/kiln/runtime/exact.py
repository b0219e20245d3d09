"""Views of the reference that read its cache without writing it: the forward in float64
arithmetic over the model's own (float32 or bfloat16) weights, for the gate's noise estimate
``|reference - exact|``, and the reference stepping several copies of its batch at once, for
verifying several timed steps in one forward (docs/design/engine.md, "Check").

The float64 forward: same graph and weight values, every op's ``reference`` fed float64
(:data:`EXACT_DTYPE`; weights upcast one layer at a time: extra memory is one layer's weights,
plus one layer's cache rows for a step on the engine's cache); nothing of the model, its cache or
its weight store is written.

- :func:`exact_step`: one decode step from the cache's current state, its lengths and buffers
  untouched; ``copies`` times the active batch at once when the tokens hold that many rows.
- :func:`stacked`: the model's own ops on ``copies`` copies of its active batch, one decode step
  from the cache's current state (each layer's rows copied when written).
- :func:`exact_model`: a model view with its own float64 cache (``max_batch x max_len``) for a
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

EXACT_DTYPE = torch.float64
"""The exact forward's arithmetic: its rounding (about 1e-16) is far below float32's (6e-8), so
``reference - exact`` is the reference's own rounding error."""
_EXACT_BYTES = 8
HEAD_CHUNK_BYTES = 64 << 20
"""Float64 LM-head rows upcast at once (a 128k-vocabulary head is 4 GiB in float64)."""


def _upcast(params: Mapping[str, Any]) -> dict[str, Any]:
    return {
        k: v.to(EXACT_DTYPE) if isinstance(v, Tensor) and v.is_floating_point() else v
        for k, v in params.items()
    }


def _bind(site: Site) -> BoundOp:
    """``site``'s reference implementation over float64 copies of its tensor params."""
    fn = get(site.op, REFERENCE).fn
    params = _upcast(site.params)

    def call(*args: Any, **kw: Any) -> Any:
        return fn(*args, **params, **kw)

    return call


class _Layers(Sequence[LayerSlots[BoundOp]]):
    """A model's layers bound on access (one layer's float64 weights alive at a time while the
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
    """:class:`ModelSlots` of float64 reference ops, each bound when read."""

    def __init__(self, slots: ModelSlots[Site]) -> None:
        self._slots = slots
        self.layers = _Layers(slots.layers)

    @property
    def embedding(self) -> BoundOp:
        """The reference's row gather on the model's own table, its rows upcast: the same
        values as gathering from an upcast table, without upcasting the whole vocabulary."""
        site = self._slots.embedding
        fn = get(site.op, REFERENCE).fn

        def call(*args: Any, **kw: Any) -> Any:
            return fn(*args, **site.params, **kw).to(EXACT_DTYPE)

        return call

    @property
    def final_norm(self) -> BoundOp:
        return _bind(self._slots.final_norm)

    @property
    def lm_head(self) -> BoundOp:
        """The reference LM head over float64 copies of :data:`HEAD_CHUNK_BYTES` of vocabulary
        rows at a time, joined: each logit is its own dot product, so the same logits as one
        product over an upcast table, without a float64 copy of the whole vocabulary."""
        site = self._slots.lm_head
        fn = get(site.op, REFERENCE).fn
        weight: Tensor = site.params["weight"]
        others = _upcast({k: v for k, v in site.params.items() if k != "weight"})
        rows = max(1, HEAD_CHUNK_BYTES // (weight.shape[1] * _EXACT_BYTES))

        def call(x: Tensor) -> Tensor:
            parts = [
                fn(x, weight=weight[i : i + rows].to(EXACT_DTYPE), **others)
                for i in range(0, weight.shape[0], rows)
            ]
            return torch.cat(parts, dim=-1)

        return call

    @property
    def sampler(self) -> BoundOp:
        return _bind(self._slots.sampler)


class _StepCache:
    """One decode step on a copy: positions from ``cache``'s state, each layer's active rows
    copied ``copies`` times (sequence ``j`` of copy ``c`` at row ``c x batch + j``) to ``dtype``
    when written; ``cache`` is never changed."""

    def __init__(self, cache: StaticKVCache, dtype: torch.dtype, copies: int = 1) -> None:
        self._cache = cache
        self._dtype = dtype
        self._copies = copies
        self.batch = cache.batch * copies
        self.max_len = cache.max_len

    def next_positions(self) -> tuple[Tensor, Tensor]:
        positions, seq_lens = self._cache.next_positions()
        return positions.repeat(self._copies, 1), seq_lens.repeat(self._copies)

    def advance(self, steps: int = 1) -> None:
        """Nothing to record: the step's copies are dropped."""

    def _rows(self, buffer: Tensor) -> Tensor:
        active = buffer[: self._cache.batch]
        out = torch.empty((self._copies, *active.shape), dtype=self._dtype, device=active.device)
        out.copy_(active)  # broadcast over the copies, cast once
        return out.flatten(0, 1)

    def write(self, layer: int, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        b = k.shape[0]
        rows = torch.arange(b, device=positions.device)[:, None]
        k_cache, v_cache = self._rows(self._cache.k[layer]), self._rows(self._cache.v[layer])
        k_cache[rows, :, positions] = k.transpose(1, 2).to(self._dtype)
        v_cache[rows, :, positions] = v.transpose(1, 2).to(self._dtype)
        return k_cache, v_cache


def copies_of(cache: StaticKVCache, tokens: Tensor) -> int:
    """How many copies of ``cache``'s active batch ``tokens [copies x B, 1]`` step.

    Raises:
        ValueError: the rows are not a positive multiple of the active batch.
    """
    rows, batch = int(tokens.shape[0]), cache.batch
    if batch < 1 or rows < batch or rows % batch:
        raise ValueError(f"{rows} token rows are not copies of the active batch of {batch}")
    return rows // batch


def step_bytes(model: DecoderModel, dtype: torch.dtype = EXACT_DTYPE) -> int:
    """Bytes one more copy of ``model``'s active batch adds to a step of :func:`stacked` or
    :func:`exact_step` in ``dtype``: one layer's K and V rows (MLA: latent and rope key) and the
    logits."""
    cache, config = model.cache, model.config
    per_row = cache.k[0][0].numel() + cache.v[0][0].numel()
    per_row += config.vocab_size
    return cache.batch * per_row * torch.empty((), dtype=dtype).element_size()


def _view(model: DecoderModel, cache: Any, ops: Any) -> DecoderModel:
    view = object.__new__(DecoderModel)  # no __init__: it would bind every layer at once
    view.config, view.weights, view.cache = model.config, model.weights, cache
    view.slots, view.binding, view.expert_load = model.slots, model.binding, None
    view.ops = ops
    return view


@torch.no_grad()
def exact_step(model: DecoderModel, tokens: Tensor) -> Tensor:
    """``model.decode_step(tokens)`` in float64 arithmetic, from its cache's current state.

    Args:
        model: the reference model (its cache holds the state to step from).
        tokens: ``[copies x B, 1]`` int64, B the cache's active batch: row ``c x B + j``
            continues sequence ``j``.

    Returns:
        ``[copies x B, V]`` float64 logits.

    Raises:
        kiln.workloads.models.kv_cache.CacheCapacityError: as ``decode_step``.
        ValueError: the rows are not copies of the active batch.
    """
    cache = _StepCache(model.cache, EXACT_DTYPE, copies_of(model.cache, tokens))
    return _view(model, cache, _Ops(model.slots)).decode_step(tokens)


def stacked(model: DecoderModel, copies: int) -> DecoderModel:
    """A view of ``model`` (its ops and weights) whose ``decode_step`` takes ``[copies x B, 1]``
    tokens, row ``c x B + j`` continuing sequence ``j`` of its cache from the cache's current
    state, and returns ``[copies x B, V]`` logits; the cache is not written (each layer's rows
    copied in the cache's dtype when written)."""
    cache = _StepCache(model.cache, model.cache.k[0].dtype, copies)
    return _view(model, cache, model.ops)


def exact_model(model: DecoderModel, *, max_batch: int, max_len: int) -> DecoderModel:
    """A view of ``model`` computing in float64 with its own float64 cache of ``max_batch``
    sequences of ``max_len`` slots (use its ``prefill`` then ``decode_step``)."""
    cache = StaticKVCache.for_config(
        model.config,
        max_batch=max_batch,
        max_len=max_len,
        dtype=EXACT_DTYPE,
        device=model.cache.lengths.device,
    )
    return _view(model, cache, _Ops(model.slots))
