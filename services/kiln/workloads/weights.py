"""Model weights held once per engine, and layouts derived from them.

A :class:`WeightStore` maps Hugging Face names to tensors. MoE experts are held stacked per
layer as transformers >= 5 holds them: ``mlp.experts.gate_up_proj [E, 2I, H]`` (gate rows
first), ``mlp.experts.down_proj [E, H, I]``, router ``mlp.gate.weight [E, H]``; per-expert
checkpoints are stacked on load. Block-FP8 and MXFP4 checkpoints are dequantized at load
(:mod:`kiln.workloads.quantized_checkpoint`).

The output head against ``tie_word_embeddings`` (:func:`load_safetensors`), each case logged as a
structlog warning and kept in :attr:`WeightStore.notes`:

- config ties, the files hold an ``lm_head.weight`` equal to the embedding: tied, no warning;
  one that differs: the files' head is used, untied (``checkpoint_head_untied``). This is what
  transformers 5.x does (``PreTrainedModel.tie_weights``: "both are present in the checkpoints
  with different values, so we will NOT tie them").
- config does not tie, the files hold no ``lm_head.weight``: the head is tied to the embedding
  (``checkpoint_head_tied``). transformers leaves that head newly (randomly) initialised
  instead; kiln ties, since a random head would be measured as if it were the model's.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import structlog
import torch

from kiln.workloads.config import ModelConfig
from kiln.workloads.weight_errors import WeightError

log = structlog.get_logger(__name__)

T = TypeVar("T")

LM_HEAD = "lm_head.weight"
EMBED = "model.embed_tokens.weight"
ROUTER_BIAS = "gate.kiln_skew_bias"
"""Suffix (after a layer's ``...mlp.``) of kiln's float32 ``[E]`` router-logit bias on random-weight
MoE routers (:mod:`kiln.workloads.models.routing`; not a checkpoint weight).
"""


class WeightStore:
    """Parameters by HF name, plus a cache of derived layouts; with ``tied``, ``lm_head.weight``
    is the embedding table. ``notes``: what the loader decided about the files (warnings).
    """

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        *,
        tied: bool = False,
        notes: tuple[str, ...] = (),
    ) -> None:
        self._tensors = dict(tensors)
        if tied and EMBED in self._tensors:
            self._tensors[LM_HEAD] = self._tensors[EMBED]
        self.notes = notes
        self._derived: dict[tuple[str, str], Any] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        """The tensor called ``name``; :class:`WeightError` when absent."""
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

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Hold one more base tensor; WeightError if ``name`` is held already."""
        if name in self._tensors:
            raise WeightError(f"a weight named {name!r} is held already")
        self._tensors[name] = tensor

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
        """The layout ``transform`` (a name identifying it and its parameters) of the weights at
        ``site``, computed by ``fn`` at most once and cached.
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
    """HF names and shapes of a Llama / Qwen3 / Qwen3-MoE / Mixtral / MiniMax-M2 model with
    ``config``'s layers (MiniMax-M2's correction biases: :mod:`kiln.workloads.minimax_m2`);
    WeightError for MLA or shared experts.
    """
    if config.mla is not None or (config.moe is not None and config.moe.num_shared_experts):
        raise WeightError(f"{config.name}: MLA and shared-expert layouts are not known")
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
        if config.qk_norm:  # per head ([D]) or, per_layer (MiniMax-M2), the whole projection
            whole_proj = config.qk_norm_type == "per_layer"
            shapes[p + "self_attn.q_norm.weight"] = (hq * d,) if whole_proj else (d,)
            shapes[p + "self_attn.k_norm.weight"] = (hkv * d,) if whole_proj else (d,)
        if config.moe is not None and config.is_moe_layer(i):
            e, mi = config.moe.num_experts, config.moe.intermediate_size
            shapes[p + "mlp.gate.weight"] = (e, h)
            shapes[p + "mlp.experts.gate_up_proj"] = (e, 2 * mi, h)
            shapes[p + "mlp.experts.down_proj"] = (e, h, mi)
            continue
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
    return shapes


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def _name_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def seeded_tensors(
    shapes: Mapping[str, tuple[int, ...]],
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int,
    zeros: tuple[str, ...] = (),
) -> dict[str, torch.Tensor]:
    """Random tensors of ``shapes``: norms 1, names ending in one of ``zeros`` float32 zeros,
    the rest ``normal(0, initializer_range)`` drawn in float32 from a generator on ``device``
    seeded by ``(seed, name)`` (stacked experts one expert at a time, to bound the float32
    copy), then cast to ``dtype``: same seed, same weights on the same device type, and a fast
    tier's layers equal the full model's."""
    std = float(config.raw.get("initializer_range", 0.02))
    dev = torch.device(device)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        if _is_norm(name):
            tensors[name] = torch.ones(shape, dtype=dtype, device=dev)
            continue
        if zeros and name.endswith(zeros):
            tensors[name] = torch.zeros(shape, dtype=torch.float32, device=dev)
            continue
        gen = torch.Generator(device=dev).manual_seed(_name_seed(seed, name))
        t = torch.empty(shape, dtype=dtype, device=dev)
        for part in [t[e] for e in range(shape[0])] if len(shape) == 3 else [t]:
            drawn = torch.empty(part.shape, dtype=torch.float32, device=dev)
            part.copy_(drawn.normal_(0.0, std, generator=gen))
        tensors[name] = t
    return tensors


def seeded_random(
    config: ModelConfig,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> WeightStore:
    """Random weights for ``config`` (:func:`seeded_tensors` of its expected shapes)."""
    tensors = seeded_tensors(expected_shapes(config), config, dtype, device, seed)
    return WeightStore(tensors, tied=config.tie_word_embeddings)


def _index(directory: Path) -> dict[str, Path]:
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


Part = tuple[str, tuple[int | slice, ...]]
"""One checkpoint tensor feeding a held tensor: (name in the files, index into the held tensor;
``()`` = all of it).
"""

_MOE_NAME = re.compile(
    r"(model\.layers\.\d+)\.mlp\."
    r"(gate\.weight|e_score_correction_bias|experts\.gate_up_proj|experts\.down_proj)"
)


def checkpoint_sources(name: str, shape: tuple[int, ...]) -> list[list[Part]]:
    """The ways a checkpoint may hold ``name`` of ``shape``, preferred first: its own name, or
    per expert (Qwen3-MoE or Mixtral / MiniMax-M2 ``block_sparse_moe`` names).
    """
    options: list[list[Part]] = [[(name, ())]]
    m = _MOE_NAME.fullmatch(name)
    if m is None:
        return options
    layer, what = m.groups()
    if what in ("gate.weight", "e_score_correction_bias"):
        options.append([(f"{layer}.block_sparse_moe.{what}", ())])
        return options
    experts = shape[0]
    if what == "experts.gate_up_proj":
        inter = shape[1] // 2
        for mod, gate, up in (("mlp", "gate_proj", "up_proj"), ("block_sparse_moe", "w1", "w3")):
            parts: list[Part] = []
            for e in range(experts):
                base = f"{layer}.{mod}.experts.{e}."
                parts.append((f"{base}{gate}.weight", (e, slice(0, inter))))
                parts.append((f"{base}{up}.weight", (e, slice(inter, 2 * inter))))
            options.append(parts)
    else:
        for mod, down in (("mlp", "down_proj"), ("block_sparse_moe", "w2")):
            options.append(
                [(f"{layer}.{mod}.experts.{e}.{down}.weight", (e,)) for e in range(experts)]
            )
    return options


def load_safetensors(
    directory: str | Path,
    config: ModelConfig,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    *,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
    float32: tuple[str, ...] = (),
) -> WeightStore:
    """Read the weights ``config`` needs (``shapes``, default :func:`expected_shapes`) from
    ``directory``'s ``*.safetensors``, cast to ``dtype`` on ``device`` (names ending in one of
    ``float32``: float32); the head against ``tie_word_embeddings`` as the module says. Block-FP8
    and MXFP4 checkpoints (``quantization_config``) are dequantized into ``dtype`` at load
    (:mod:`kiln.workloads.quantized_checkpoint`; logged, and said in the store's ``notes``).
    WeightError: no directory or files, a tensor missing, mis-shaped or in two files, a
    quantization kiln does not read or a scale missing or mis-shaped.
    """
    from kiln.workloads.quantized_checkpoint import CheckpointReader, quantization

    root = Path(directory)
    if not root.is_dir():
        raise WeightError(f"{root}: not a directory")
    quant = quantization(config)
    where = _index(root)
    shapes = dict(shapes) if shapes is not None else expected_shapes(config)
    tied = config.tie_word_embeddings
    notes: list[str] = []
    dev = torch.device(device)
    with CheckpointReader(where, quant, dev) as files:
        file_head = tied and LM_HEAD in files
        if file_head:  # compared with the embedding once both are read
            shapes[LM_HEAD] = shapes[EMBED]
        elif not tied and LM_HEAD not in files and EMBED in files:
            del shapes[LM_HEAD]
            tied = True
            notes.append(
                f"{root}: config.json has tie_word_embeddings false but the files hold no "
                f"{LM_HEAD}; the head is tied to {EMBED} (transformers would initialise it "
                "randomly)"
            )
            log.warning("checkpoint_head_tied", directory=str(root), model=config.name)
        plan: dict[str, list[Part]] = {}
        missing: list[str] = []
        for name, shape in shapes.items():
            options = checkpoint_sources(name, shape)
            chosen = next((o for o in options if all(src in files for src, _ in o)), None)
            if chosen is None:
                missing.append(name if len(options) == 1 else f"{name} (or per-expert tensors)")
            else:
                plan[name] = chosen
        if missing:
            shown = ", ".join(missing[:8]) + (
                f", ... ({len(missing)} in all)" if len(missing) > 8 else ""
            )
            raise WeightError(f"{root}: missing weights for {config.name}: {shown}")
        tensors: dict[str, torch.Tensor] = {}
        for name, parts in plan.items():
            held = torch.float32 if float32 and name.endswith(float32) else dtype
            for src, index in parts:
                found = files.shape(src)
                want = tuple(torch.empty(shapes[name], device="meta")[index].shape)
                if found != want:
                    part = f"{name}{list(index)}" if index else name
                    raise WeightError(
                        f"{files.file(src)}: {src} has shape {list(found)}, "
                        f"{config.name} needs {list(want)} (for {part})"
                    )
                if not index:
                    tensors[name] = files.read(src, held)
                    continue
                if name not in tensors:
                    tensors[name] = torch.empty(shapes[name], dtype=held, device=dev)
                tensors[name][index].copy_(files.read(src, held))
    if quant.method is not None:
        notes.append(
            f"{root}: {quant.describe()} checkpoint dequantized at load into {dtype} "
            "(kiln computes in that dtype; no FP8/FP4 GEMM yet)"
        )
        log.info(
            "checkpoint_dequantized",
            directory=str(root),
            model=config.name,
            format=quant.describe(),
            dtype=str(dtype),
        )
    if file_head:
        if torch.equal(tensors[LM_HEAD], tensors[EMBED]):
            del tensors[LM_HEAD]
        else:
            tied = False
            notes.append(
                f"{root}: config.json has tie_word_embeddings true but the files' {LM_HEAD} "
                f"differs from {EMBED}; the files' head is used, untied (as transformers does)"
            )
            log.warning("checkpoint_head_untied", directory=str(root), model=config.name)
    return WeightStore(tensors, tied=tied, notes=tuple(notes))
