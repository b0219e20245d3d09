"""Model weights held once per engine, and layouts derived from them.

A :class:`WeightStore` maps Hugging Face parameter names (``model.layers.0.self_attn.q_proj
.weight``) to tensors. Op implementations that want another layout (fused QKV, fused gate/up,
quantized copies) get it through :meth:`WeightStore.derived`, computed once per (transform, site)
and cached, so switching implementations re-binds code without re-reading or re-copying weights.

Weights come from :func:`seeded_random` (deterministic, for engines without a checkpoint) or
:func:`load_safetensors` (a local directory of ``*.safetensors`` files, sharded or not).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch

from kiln.workloads.config import ModelConfig

T = TypeVar("T")

LM_HEAD = "lm_head.weight"
EMBED = "model.embed_tokens.weight"


class WeightError(ValueError):
    """Weights missing, mis-shaped or unreadable; the message names the tensors."""


class WeightStore:
    """Parameters by HF name, plus a cache of derived layouts.

    Args:
        tensors: name → tensor. When ``lm_head.weight`` is absent and ``tied`` is True, it is
            the embedding table (the same tensor, not a copy).
        tied: the config's ``tie_word_embeddings``.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], *, tied: bool = False) -> None:
        self._tensors = dict(tensors)
        if tied and EMBED in self._tensors:
            self._tensors[LM_HEAD] = self._tensors[EMBED]
        self._derived: dict[tuple[str, str], Any] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        """The tensor called ``name``. Raises :class:`WeightError` (naming it) when absent."""
        try:
            return self._tensors[name]
        except KeyError:
            raise WeightError(f"no weight named {name!r} ({len(self._tensors)} held)") from None

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def get(self, name: str) -> torch.Tensor | None:
        """The tensor called ``name``, or None."""
        return self._tensors.get(name)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) pairs, tied names included."""
        return iter(self._tensors.items())

    def nbytes(self) -> int:
        """Bytes of the base weights (a tensor shared by two names counted once)."""
        seen: dict[int, int] = {}
        for t in self._tensors.values():
            seen[t.data_ptr()] = t.numel() * t.element_size()
        return sum(seen.values())

    def derived(self, transform: str, site: str, fn: Callable[[], T]) -> T:
        """The layout ``transform`` of the weights at ``site``, computed by ``fn`` the first time
        and cached after that.

        Args:
            transform: the transform's name (e.g. ``"fused_qkv"``); must identify the transform
                and its parameters.
            site: where in the model (the HF module prefix, e.g. ``"model.layers.3.self_attn"``).
            fn: computes the layout from the base weights; called at most once per key.
        """
        key = (transform, site)
        if key not in self._derived:
            self._derived[key] = fn()
        return self._derived[key]

    def derived_keys(self) -> list[tuple[str, str]]:
        """(transform, site) of every cached derived layout."""
        return list(self._derived)

    def derived_nbytes(self) -> int:
        """Bytes held by derived tensors (values that are tensors, or dicts of tensors)."""
        total = 0
        for value in self._derived.values():
            items = value.values() if isinstance(value, dict) else [value]
            for t in items:
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
        return total

    def drop_derived(self, transform: str | None = None) -> None:
        """Forget derived layouts (all, or one transform's), e.g. to free memory."""
        self._derived = {
            k: v for k, v in self._derived.items() if transform is not None and k[0] != transform
        }


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The HF parameter names and shapes of a dense Llama / Qwen3 model with ``config``'s layers
    (``lm_head.weight`` only when embeddings are not tied).

    Raises:
        WeightError: an MoE or MLA config (not a dense Llama-style layout).
    """
    if config.moe is not None or config.mla is not None:
        raise WeightError(f"{config.name}: only dense Llama-style layouts are known")
    h, d, v = config.hidden_size, config.head_dim, config.vocab_size
    hq, hkv, inter = (
        config.num_attention_heads,
        config.num_key_value_heads,
        config.intermediate_size,
    )
    shapes: dict[str, tuple[int, ...]] = {EMBED: (v, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes[LM_HEAD] = (v, h)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        for proj, out in (("q", hq * d), ("k", hkv * d), ("v", hkv * d)):
            shapes[f"{p}self_attn.{proj}_proj.weight"] = (out, h)
            if config.attention_bias:
                shapes[f"{p}self_attn.{proj}_proj.bias"] = (out,)
        shapes[p + "self_attn.o_proj.weight"] = (h, hq * d)
        if config.attention_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
    return shapes


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def _name_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def seeded_random(
    config: ModelConfig,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> WeightStore:
    """Random weights for ``config``: norms 1, everything else ``normal(0, initializer_range)``
    (0.02 when the config has none), as transformers initialises Llama.

    Each tensor is drawn in float32 from its own generator on ``device``, seeded from
    ``(seed, name)``, then cast to ``dtype``: the same seed gives the same weights on the same
    device type, and a model truncated to its first N layers (the fast tier) has exactly the full
    model's first N layers.
    """
    std = float(config.raw.get("initializer_range", 0.02))
    dev = torch.device(device)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(config).items():
        if _is_norm(name):
            tensors[name] = torch.ones(shape, dtype=dtype, device=dev)
            continue
        gen = torch.Generator(device=dev).manual_seed(_name_seed(seed, name))
        t = torch.empty(shape, dtype=torch.float32, device=dev).normal_(0.0, std, generator=gen)
        tensors[name] = t.to(dtype)
    return WeightStore(tensors, tied=config.tie_word_embeddings)


def _index(directory: Path) -> dict[str, Path]:
    """tensor name → the ``*.safetensors`` file holding it."""
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise WeightError(f"{directory}: no *.safetensors files")
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                if name in where:
                    raise WeightError(f"{name!r} is in both {where[name].name} and {f.name}")
                where[name] = f
    return where


def load_safetensors(
    directory: str | Path,
    config: ModelConfig,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
) -> WeightStore:
    """Read ``config``'s weights (HF names) from the ``*.safetensors`` files in ``directory``.

    Only the tensors ``config`` needs are read (a config truncated to N layers reads N layers);
    others in the files are ignored. Tensors are cast to ``dtype`` on ``device``. With tied
    embeddings, ``lm_head.weight`` is the embedding table even when the files hold a copy.

    Raises:
        WeightError: no such directory or no ``*.safetensors`` files in it; a tensor missing
            (the message lists them), mis-shaped (expected vs found), or in two files.
    """
    from safetensors import safe_open

    root = Path(directory)
    if not root.is_dir():
        raise WeightError(f"{root}: not a directory")
    where = _index(root)
    shapes = expected_shapes(config)
    missing = [n for n in shapes if n not in where]
    if missing:
        shown = ", ".join(missing[:8]) + (
            f", ... ({len(missing)} in all)" if len(missing) > 8 else ""
        )
        raise WeightError(f"{root}: missing weights for {config.name}: {shown}")
    tensors: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name in shapes:
        by_file.setdefault(where[name], []).append(name)
    dev = torch.device(device)
    for f, names in by_file.items():
        with safe_open(str(f), framework="pt", device=str(dev)) as handle:
            for name in names:
                found = tuple(handle.get_slice(name).get_shape())
                if found != shapes[name]:
                    raise WeightError(
                        f"{f.name}: {name} has shape {list(found)}, "
                        f"{config.name} needs {list(shapes[name])}"
                    )
                tensors[name] = handle.get_tensor(name).to(dtype)
    return WeightStore(tensors, tied=config.tie_word_embeddings)
