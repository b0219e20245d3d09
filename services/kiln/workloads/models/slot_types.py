"""The slot types: :class:`Site` (one op call site) and :class:`LayerSlots` / :class:`ModelSlots`
(each site's role in the forward, later the bound callables); the sites themselves come from
:mod:`kiln.workloads.models.slots` (and per-family modules such as ``gpt_oss_slots``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Generic, TypeVar

S = TypeVar("S")
U = TypeVar("U")


@dataclass(frozen=True)
class Site:
    """One op call site: ``op``, ``name`` (the HF module prefix, which keys derived layouts),
    ``params`` (the reference implementation's keyword params here) and ``call_params`` (keyword
    inputs the forward passes at each call, e.g. GLM-5's ``topk_indices``; an implementation
    must accept them to bind).
    """

    op: str
    name: str
    params: Mapping[str, Any]
    call_params: tuple[str, ...] = ()


@dataclass(frozen=True)
class LayerSlots(Generic[S]):
    """One decoder layer's op slots (``q_norm``/``k_norm`` may be None; ``ffn`` is ``mlp`` or
    ``moe``; ``shared_ffn`` an ``mlp`` added to ``ffn``'s output, or None; MLA roles: module
    docstring; ``index_proj``/``indexer``: GLM-5's ``dsa_index_proj`` and ``dsa_indexer``, None
    elsewhere).
    """

    input_norm: S
    qkv_proj: S
    q_norm: S | None
    k_norm: S | None
    rope: S
    attention: S
    o_proj: S
    post_attention_norm: S
    ffn: S
    shared_ffn: S | None = None
    index_proj: S | None = None
    indexer: S | None = None

    def map(self, fn: Callable[[S], U]) -> LayerSlots[U]:
        """The same slots with ``fn`` applied to each filled one."""
        return LayerSlots(
            input_norm=fn(self.input_norm),
            qkv_proj=fn(self.qkv_proj),
            q_norm=None if self.q_norm is None else fn(self.q_norm),
            k_norm=None if self.k_norm is None else fn(self.k_norm),
            rope=fn(self.rope),
            attention=fn(self.attention),
            o_proj=fn(self.o_proj),
            post_attention_norm=fn(self.post_attention_norm),
            ffn=fn(self.ffn),
            shared_ffn=None if self.shared_ffn is None else fn(self.shared_ffn),
            index_proj=None if self.index_proj is None else fn(self.index_proj),
            indexer=None if self.indexer is None else fn(self.indexer),
        )


@dataclass(frozen=True)
class ModelSlots(Generic[S]):
    """The whole model's op slots."""

    embedding: S
    layers: tuple[LayerSlots[S], ...]
    final_norm: S
    lm_head: S
    sampler: S

    def map(self, fn: Callable[[S], U]) -> ModelSlots[U]:
        """The same slots with ``fn`` applied to each."""
        return ModelSlots(
            embedding=fn(self.embedding),
            layers=tuple(layer.map(fn) for layer in self.layers),
            final_norm=fn(self.final_norm),
            lm_head=fn(self.lm_head),
            sampler=fn(self.sampler),
        )

    def sites(self) -> list[S]:
        """Every filled slot, in forward order."""
        out = [self.embedding]
        for layer in self.layers:
            slots = [getattr(layer, f.name) for f in fields(layer)]
            out += [slot for slot in slots if slot is not None]
        return [*out, self.final_norm, self.lm_head, self.sampler]
