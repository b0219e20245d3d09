"""What one engine is built for: model, tier, dtype, device and the traffic's operating point.

Equal :attr:`EngineSpec.key` share one engine; every clamp or default is in
:attr:`EngineSpec.notes`. No torch at module level.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from kiln.domain.operating_point import DerivedPoint, OperatingPoint, OperatingPointError
from kiln.runtime.native_dtype import is_native
from kiln.workloads.config import (
    ModelConfig,
    UnsupportedModelError,
    parse_config,
    parse_config_json,
)
from kiln.workloads.traffic.experts import exponent_for_hot_ratio, hot_ratio

Tier = Literal["fast", "full"]
ENGINE_DTYPES = ("float32", "bfloat16", "float16")
"""Dtypes an engine can hold weights, activations and KV cache in."""


class SpecError(ValueError):
    """A workload an engine cannot be built for; the message names the field."""


@dataclass(frozen=True)
class EngineLimits:
    """Host caps and defaults applied when a spec is derived.

    Attributes:
        device: ``"cpu"`` or ``"cuda[:N]"``.
        dtype: forced for every engine; None = the workload's, else the device default.
        max_batch, max_context: largest decode batch and context (tokens).
        fast_layers: layers of a fast-tier engine (clamped to the model's).
        prompt_len, check_steps, check_batch: the check's prompt tokens, decode steps and prompts
            (clamped to the context and batch).
        max_layers: most decoder layers an engine holds (None = all).
    """

    device: str = "cpu"
    dtype: str | None = None
    max_batch: int = 8
    max_context: int = 512
    fast_layers: int = 2
    prompt_len: int = 16
    check_steps: int = 1
    check_batch: int = 2
    max_layers: int | None = None


@dataclass(frozen=True)
class EngineSpec:
    """Everything an engine is built for.

    Attributes:
        tier: "fast" (first ``layers`` layers plus embedding and LM head) or "full".
        layers, total_layers: decoder layers held; the model's.
        dtype: one of :data:`ENGINE_DTYPES`. device: ``"cpu"`` or ``"cuda[:N]"``.
        seed: of random weights (ignored with ``weights_dir``, a ``*.safetensors`` directory).
        batch_size, context_len: the decode batch and the tokens in each KV cache measured at.
        prompt_len, check_steps, check_batch: the check's prompt tokens, decode steps and
            prompts.
        expert_zipf_exponent: MoE expert-load skew imposed on random routers; 0.0 for dense
            models and checkpoints (in the key only when non-zero).
        notes: clamps and defaults applied, in words (not part of the key).
    """

    model_name: str
    config: dict[str, Any]
    tier: Tier
    layers: int
    total_layers: int
    dtype: str
    device: str
    seed: int
    weights_dir: str | None
    batch_size: int
    context_len: int
    prompt_len: int
    check_steps: int
    check_batch: int
    expert_zipf_exponent: float = 0.0
    notes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def key(self) -> str:
        """Hash of the build-relevant fields (24 hex digits): same key, same engine."""
        body = {k: v for k, v in asdict(self).items() if k != "notes"}
        if not self.expert_zipf_exponent:  # dense specs keep the keys they had
            del body["expert_zipf_exponent"]
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:24]

    @property
    def cache_len(self) -> int:
        """KV slots per sequence: the context plus the timed step, at least the check's prompt
        and steps.
        """
        return max(self.context_len + 1, self.prompt_len + self.check_steps)

    def model_config(self) -> ModelConfig:
        """The architecture (all layers), with the expert-load skew set on MoE configs."""
        config = parse_config(self.config, self.model_name)
        if self.expert_zipf_exponent:
            config = config.with_expert_skew(self.expert_zipf_exponent)
        return config

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-compatible form (what the worker process receives)."""
        out = asdict(self)
        out["notes"] = list(self.notes)
        return out

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> EngineSpec:
        values = dict(data)
        values["notes"] = tuple(values.get("notes", ()))
        return EngineSpec(**values)

    @staticmethod
    def from_workload(workload: Mapping[str, Any], tier: str, limits: EngineLimits) -> EngineSpec:
        """The spec for ``workload`` (``MessageToDict`` with proto field names) on ``tier`` under
        ``limits``.

        Raises:
            SpecError: a missing or invalid config, an architecture kiln cannot build, an unknown
                dtype or tier, a bad seed.
        """
        if tier not in ("fast", "full"):
            raise SpecError(f"invalid tier {tier!r}: expected 'fast' or 'full'")
        model = dict(workload.get("model") or {})
        name = str(model.get("name") or "model")
        config = _parse(model, name)
        check_buildable(config)
        notes: list[str] = []

        dtype = limits.dtype or str(model.get("dtype") or "")
        if not dtype:
            dtype = _default_dtype(config.torch_dtype, limits.device, notes)
        if dtype not in ENGINE_DTYPES:
            raise SpecError(f"workload.model.dtype {dtype!r} is not one of {ENGINE_DTYPES}")
        try:
            seed = int(model.get("seed") or 0)
        except (TypeError, ValueError):
            raise SpecError(
                f"workload.model.seed {model.get('seed')!r} is not an integer"
            ) from None

        total = config.num_hidden_layers
        layers = total if tier == "full" else min(limits.fast_layers, total)
        if limits.max_layers is not None and layers > limits.max_layers:
            notes.append(
                f"scaled to fit by layer count: {limits.max_layers} of {total} layers held "
                f"on the {tier} tier (KILN_ENGINE_MAX_LAYERS)"
            )
            layers = limits.max_layers
        traffic = dict(workload.get("traffic") or {})
        weights_dir = str(model.get("weights_dir") or "") or None
        zipf = _expert_skew(traffic, config, weights_dir, notes)
        derived = engine_operating_point(workload.get("traffic"), config, limits)
        notes += derived.notes
        batch, context = derived.point.batch_size, derived.point.context_len
        hardware = str((workload.get("hardware") or {}).get("name") or "")
        if hardware and hardware != limits.device.split(":")[0]:
            notes.append(f"workload targets {hardware!r}; measured on {limits.device}")
        return EngineSpec(
            model_name=name,
            config=dict(config.raw),
            tier="full" if tier == "full" else "fast",
            layers=layers,
            total_layers=total,
            dtype=dtype,
            device=limits.device,
            seed=seed,
            weights_dir=weights_dir,
            batch_size=batch,
            context_len=context,
            prompt_len=max(1, min(limits.prompt_len, context)),
            check_steps=limits.check_steps,
            check_batch=max(1, min(limits.check_batch, batch)),
            expert_zipf_exponent=zipf,
            notes=tuple(notes),
        )


def _default_dtype(torch_dtype: str, device: str, notes: list[str]) -> str:
    """The config's ``torch_dtype`` where ``device`` computes it natively, else float32."""
    if torch_dtype in ENGINE_DTYPES and is_native(torch_dtype, device):
        notes.append(f"workload.model.dtype unset: the config's {torch_dtype} on {device}")
        return torch_dtype
    notes.append(
        f"workload.model.dtype unset: float32 on {device} "
        f"(the config's {torch_dtype} is not native there)"
    )
    return "float32"


def _parse(model: Mapping[str, Any], name: str) -> ModelConfig:
    try:
        return parse_config_json(str(model.get("config_json") or ""), name)
    except UnsupportedModelError as exc:
        raise SpecError(str(exc)) from exc


def check_buildable(config: ModelConfig) -> None:
    """Raise :class:`SpecError` unless kiln can build ``config`` (imports torch)."""
    from kiln.workloads.models.build import UnbuildableModelError
    from kiln.workloads.models.build import check_buildable as check

    try:
        check(config)
    except UnbuildableModelError as exc:
        raise SpecError(str(exc)) from exc


def _expert_skew(
    traffic: Mapping[str, Any], config: ModelConfig, weights_dir: str | None, notes: list[str]
) -> float:
    """The Zipf exponent an MoE engine imposes: ``traffic.expert_zipf_exponent``, else the one
    matching ``traffic.expert_load_skew``; SpecError if negative or not finite.
    """
    values = {}
    for name in ("expert_zipf_exponent", "expert_load_skew"):
        try:
            values[name] = float(traffic.get(name) or 0.0)
        except (TypeError, ValueError):
            raise SpecError(f"traffic.{name} {traffic.get(name)!r} is not a number") from None
        if not (math.isfinite(values[name]) and values[name] >= 0):
            raise SpecError(f"traffic.{name} must be finite and >= 0, got {values[name]}")
    moe = config.moe
    if moe is None:
        return 0.0
    zipf, source = values["expert_zipf_exponent"], "traffic.expert_zipf_exponent"
    if not zipf and values["expert_load_skew"] > 1.0:
        ratio = values["expert_load_skew"]
        zipf = exponent_for_hot_ratio(ratio, moe.num_experts, moe.top_k)
        source = (
            f"traffic.expert_load_skew {ratio:g} for {moe.num_experts} experts, top-{moe.top_k}"
        )
    if not zipf:
        notes.append("MoE expert load: the router's own (the traffic shape sets no skew)")
        return 0.0
    if weights_dir:
        notes.append(
            f"MoE expert load: the checkpoint router's own (skew s={zipf:.3g} from the traffic "
            "is imposed only on random weights)"
        )
        return 0.0
    ratio = hot_ratio(moe.num_experts, moe.top_k, zipf)
    notes.append(
        f"MoE routers biased so expert load follows Zipf s={zipf:.3g} over each layer's experts "
        f"(from {source}): hottest expert {ratio:.2f}x the uniform share"
    )
    return zipf


def engine_operating_point(
    traffic: Mapping[str, Any] | None, config: ModelConfig, limits: EngineLimits
) -> DerivedPoint:
    """The operating point of ``traffic`` (or None) with batch and context capped by ``limits``
    and the model's window; SpecError on a traffic field out of range.
    """
    try:
        return OperatingPoint.from_traffic(
            traffic,
            max_batch=limits.max_batch,
            max_context=min(limits.max_context, config.max_position_embeddings - 1),
            batch_limit="KILN_ENGINE_MAX_BATCH",
            context_limit="KILN_ENGINE_MAX_CONTEXT or the model's window",
        )
    except OperatingPointError as exc:
        raise SpecError(str(exc)) from None
