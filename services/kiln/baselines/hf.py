"""transformers, imported lazily, and kiln's weights in a transformers model."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from kiln.baselines.harness import BaselineSetup, Runner, SkipBaseline

Tensor = torch.Tensor
HF_MODEL_TYPES = ("llama", "qwen3", "qwen3_moe", "mixtral")
"""Architectures whose transformers parameter names kiln's weight store uses."""
SKIPPED = '("transformers not installed") without transformers'
"""When a transformers baseline is skipped, in words (its ``run`` docstring)."""


def load_transformers() -> ModuleType:
    """The transformers module; SkipBaseline when it is not installed."""
    try:
        import transformers
    except ImportError:
        raise SkipBaseline("transformers not installed") from None
    return transformers


def hf_model(point: BaselineSetup) -> Any:
    """A transformers causal LM of the point's config on its device and dtype, eval mode, with
    kiln's weights copied in (strict; a tied head shares the embedding).

    Raises:
        SkipBaseline: no transformers, or an architecture kiln's names do not map.
        RuntimeError: the state dict does not match.
    """
    transformers = load_transformers()
    config = point.config
    if config.model_type not in HF_MODEL_TYPES:
        raise SkipBaseline(f"transformers baseline of {config.model_type!r} not supported")
    raw = dict(config.raw)
    raw.pop("model_type", None)
    raw.pop("torch_dtype", None)
    raw.pop("dtype", None)
    raw["num_hidden_layers"] = config.num_hidden_layers  # a truncated config (fast tier)
    hf_config = transformers.AutoConfig.for_model(config.model_type, **raw)
    shortfall = copy_shortfall((t for _, t in point.weights.items()), point.device)
    if shortfall is not None:
        raise SkipBaseline(shortfall)
    with torch.device(point.device):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=point.dtype)
    model.eval()
    with torch.no_grad():
        model.load_state_dict(dict(point.weights.items()), strict=True)
    return model


def copy_shortfall(
    tensors: Iterable[torch.Tensor], device: torch.device, free_bytes: int | None = None
) -> str | None:
    """Why a second copy of ``tensors`` (each storage once) does not fit in ``device``'s free
    memory (``free_bytes``; None: ``torch.cuda.mem_get_info`` after emptying the cache), or None
    when it fits or ``device`` is not CUDA."""
    if device.type != "cuda" and free_bytes is None:
        return None
    seen: set[int] = set()
    need = 0
    for t in tensors:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            need += t.untyped_storage().nbytes()
    if free_bytes is None:
        torch.cuda.empty_cache()
        free_bytes = torch.cuda.mem_get_info(device)[0]
    if need <= 0.95 * free_bytes:
        return None
    return (
        f"a copy of the weights needs {need / 1e9:.1f} GB and {device} has "
        f"{free_bytes / 1e9:.1f} GB free beside kiln's engine"
    )


@dataclass
class HfCall:
    """How to call the installed ``forward`` with a cache: ``cache_key`` (``"cache"`` or
    ``"past_key_values"``) and whether it takes ``cache_position``.
    """

    cache_key: str
    cache_position: bool

    @staticmethod
    def of(model: Any) -> HfCall:
        """Read ``model.forward``'s and its decoder's signatures."""
        outer = inspect.signature(model.forward).parameters
        inner = inspect.signature(model.model.forward).parameters
        key = "cache" if "cache" in outer else "past_key_values"
        return HfCall(key, "cache_position" in outer or "cache_position" in inner)

    def kwargs(self, cache: Any, start: int, length: int, batch: int, device: torch.device) -> dict:
        """Keyword arguments of a forward over ``length`` tokens from ``start``: the cache and
        int64 positions on ``device``.
        """
        positions = torch.arange(start, start + length, device=device)
        out: dict[str, Any] = {
            self.cache_key: cache,
            "use_cache": True,
            "position_ids": positions[None].expand(batch, length),
        }
        if self.cache_position:
            out["cache_position"] = positions
        return out


def static_cache(transformers: ModuleType, model: Any, point: BaselineSetup) -> Any:
    """A ``StaticCache`` of ``point.cache_len`` slots for ``point.batch`` sequences, whichever
    constructor the installed version has.
    """
    cls = transformers.StaticCache
    params = inspect.signature(cls.__init__).parameters
    kwargs: dict[str, Any] = {"config": model.config, "max_cache_len": point.cache_len}
    optional = {
        "max_batch_size": point.batch,
        "batch_size": point.batch,
        "device": point.device,
        "dtype": point.dtype,
    }
    kwargs.update({k: v for k, v in optional.items() if k in params})
    return cls(**kwargs)


def runner(
    point: BaselineSetup,
    call: HfCall,
    cache: Callable[[], Any],
    prefill: Callable[..., Any],
    decode: Callable[..., Any],
    note: str,
    *,
    clone: bool = False,
) -> Runner:
    """A transformers model as a :class:`~kiln.baselines.harness.Runner` (steps return ``[batch,
    V]``).

    ``cache`` makes the cache at each prefill (fresh, or reset), ``prefill`` and ``decode`` are
    the forwards, ``clone`` copies each step's logits (a graph replay overwrites them).
    """
    caches: list[Any] = []

    def prefill_prompt(prompt: Tensor) -> None:
        caches[:] = [cache()]
        reset = getattr(caches[0], "reset", None)
        if reset is not None:
            reset()
        b, t = prompt.shape
        prefill(prompt, **call.kwargs(caches[0], 0, t, b, point.device))

    def step(token: Tensor, position: int) -> Tensor:
        kw = call.kwargs(caches[0], position, 1, point.batch, point.device)
        logits: Tensor = decode(token, **kw).logits[:, -1]
        return logits.clone() if clone else logits

    return Runner(prefill_prompt, step, [note])


def attention(model: Any) -> str:
    """The attention implementation the model runs (``"sdpa"``, ``"eager"``, ...), for notes."""
    return str(getattr(model.config, "_attn_implementation", None) or "default")


def versions() -> str:
    """``torch X, transformers Y`` (for notes)."""
    try:
        import transformers

        tf = transformers.__version__
    except ImportError:
        tf = "not installed"
    return f"torch {torch.__version__}, transformers {tf}"


def precheck(config: Any) -> None:
    """Raise :class:`SkipBaseline` when transformers is missing or has no counterpart of
    ``config``.
    """
    load_transformers()
    if config.model_type not in HF_MODEL_TYPES:
        raise SkipBaseline(f"transformers baseline of {config.model_type!r} not supported")
