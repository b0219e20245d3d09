"""Workloads: validating a submitted ``kiln.v1.Workload`` and computing its workload key.

The workload key identifies the same optimization problem across compilations: ``wk-`` + 16 hex
digits of the SHA-256 of the canonical JSON of the parsed model config and effective weight
dtype, every traffic field but ``source``, and the hardware name (lower case) and device count
(0 resolved to the catalogue's). Not the model's name, weights directory or seed.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.protobuf.json_format import MessageToDict, ParseDict

from kiln.common.errors import InvalidArgument, NotFound
from kiln.cost_model.hardware import get_hardware
from kiln.v1 import common_pb2
from kiln.workloads.config import ModelConfig, UnsupportedModelError, parse_config

DTYPES = ("bfloat16", "float16", "float32")
"""Accepted ``workload.model.dtype`` values ("" = the config's ``torch_dtype``)."""

_DISTRIBUTIONS = ("isl_tokens", "osl_tokens")
_RATES = ("arrival_rate_rps", "interarrival_cv", "mean_concurrency", "expert_load_skew")


@dataclass(frozen=True)
class ValidWorkload:
    """A workload that passed :func:`validate_workload`: ``message`` with its key (and a default
    name) filled in, the parsed ``config``, ``key``, ``hardware`` (lower case) and ``devices``.
    """

    message: common_pb2.Workload
    config: ModelConfig
    key: str
    hardware: str
    devices: int

    @property
    def model_name(self) -> str:
        return self.message.model.name

    def to_json(self) -> dict[str, Any]:
        """The workload message as JSON (``preserving_proto_field_name``), as events carry it."""
        return workload_to_json(self.message)


def workload_to_json(workload: common_pb2.Workload) -> dict[str, Any]:
    """A ``kiln.v1.Workload`` as the JSON object events and work items carry."""
    return MessageToDict(workload, preserving_proto_field_name=True)


def workload_from_json(obj: dict[str, Any]) -> common_pb2.Workload:
    """Inverse of :func:`workload_to_json` (unknown fields ignored)."""
    return ParseDict(obj, common_pb2.Workload(), ignore_unknown_fields=True)


def _check_model(spec: common_pb2.ModelSpec) -> tuple[dict[str, Any], ModelConfig, str]:
    if not spec.config_json.strip():
        raise InvalidArgument("workload.model.config_json is empty: send the config.json text")
    try:
        raw = json.loads(spec.config_json)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"workload.model.config_json is not valid JSON ({exc})") from None
    name = spec.name or (raw.get("model_type") if isinstance(raw, dict) else None) or "model"
    try:
        config = parse_config(raw, str(name))
    except UnsupportedModelError as exc:
        raise InvalidArgument(f"workload.model: {exc}") from None
    except (TypeError, ValueError, KeyError) as exc:
        raise InvalidArgument(f"workload.model: malformed config.json ({exc!r})") from None
    from kiln.workloads.models.build import UnbuildableModelError, check_buildable

    try:  # refuse now what no engine can build, rather than failing the baseline later
        check_buildable(config)
    except UnbuildableModelError as exc:
        raise InvalidArgument(f"workload.model: {exc}") from None
    if spec.dtype and spec.dtype not in DTYPES:
        raise InvalidArgument(
            f"workload.model.dtype {spec.dtype!r} is not one of {', '.join(DTYPES)}"
        )
    if spec.weights_dir and not Path(spec.weights_dir).is_dir():
        raise NotFound(f"workload.model.weights_dir {spec.weights_dir!r} is not a directory here")
    dtype = spec.dtype or config.torch_dtype
    return raw, config, dtype


def _check_traffic(workload: common_pb2.Workload) -> common_pb2.TrafficShape:
    if not workload.HasField("traffic"):
        raise InvalidArgument("workload.traffic is missing: send a traffic shape read from a trace")
    tr = workload.traffic
    if tr.batch_size < 1:
        raise InvalidArgument("workload.traffic.batch_size must be >= 1 (the decode batch)")
    if tr.context_len < 1:
        raise InvalidArgument("workload.traffic.context_len must be >= 1 (tokens)")
    for name in _DISTRIBUTIONS:
        d = getattr(tr, name)
        values = (d.p50, d.p90, d.p99, d.mean, d.max)
        if not all(math.isfinite(v) and v >= 0 for v in values):
            raise InvalidArgument(
                f"workload.traffic.{name} must hold finite non-negative token counts"
            )
        if d.max and not d.p50 <= d.p90 <= d.p99 <= d.max:
            raise InvalidArgument(
                f"workload.traffic.{name} percentiles are out of order "
                f"(p50 {d.p50:g}, p90 {d.p90:g}, p99 {d.p99:g}, max {d.max:g})"
            )
    for name in _RATES:
        value = getattr(tr, name)
        if not (math.isfinite(value) and value >= 0):
            raise InvalidArgument(f"workload.traffic.{name} must be finite and >= 0, got {value}")
    if not (math.isfinite(tr.prefix_hit_rate) and 0.0 <= tr.prefix_hit_rate <= 1.0):
        raise InvalidArgument(
            f"workload.traffic.prefix_hit_rate must be within 0..1, got {tr.prefix_hit_rate}"
        )
    return tr


def validate_workload(workload: common_pb2.Workload | None) -> ValidWorkload:
    """Check a submitted workload and fill in its key.

    Raises:
        InvalidArgument: no workload or config; a config not JSON or unsupported; an unknown
            dtype; no traffic shape or one out of range; no hardware name.
        NotFound: an unknown hardware name or a ``weights_dir`` that does not exist.
    """
    if workload is None or workload.ByteSize() == 0:
        raise InvalidArgument("workload is missing: send model, traffic and hardware")
    if not workload.HasField("model"):
        raise InvalidArgument("workload.model is missing: send the model's config.json text")
    raw, config, dtype = _check_model(workload.model)
    traffic = _check_traffic(workload)
    if not workload.hardware.name.strip():
        raise InvalidArgument("workload.hardware.name is empty: name a catalogue entry, e.g. cpu")
    hw = get_hardware(workload.hardware.name)
    devices = workload.hardware.num_devices or hw.max_devices_per_node
    key = workload_key(raw, dtype, traffic, hw.name, devices)
    message = common_pb2.Workload()
    message.CopyFrom(workload)
    message.model.name = config.name
    message.workload_key = key
    return ValidWorkload(message, config, key, hw.name, devices)


def workload_key(
    config: dict[str, Any],
    dtype: str,
    traffic: common_pb2.TrafficShape,
    hardware: str,
    devices: int,
) -> str:
    """``wk-`` + 16 hex digits of the SHA-256 of the canonical workload (see the module docs)."""
    shape = MessageToDict(traffic, preserving_proto_field_name=True)
    shape.pop("source", None)
    body = {
        "model": {"config": config, "dtype": dtype},
        "traffic": shape,
        "hardware": {"name": hardware.strip().lower(), "devices": int(devices)},
    }
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "wk-" + hashlib.sha256(text.encode()).hexdigest()[:16]


def build_workload(
    config_path: str | Path,
    trace_path: str | Path,
    hardware: str,
    *,
    num_devices: int = 0,
    dtype: str = "",
    seed: int = 0,
    weights_dir: str = "",
    max_batch: int | None = None,
) -> common_pb2.Workload:
    """A workload from local files (what ``kiln compile`` sends): a ``config.json`` and a trace
    (Azure CSV or Mooncake JSONL) whose shape and operating point are computed here.

    ``num_devices`` 0 and ``dtype`` "" take the defaults, ``weights_dir`` "" random weights,
    ``max_batch`` clamps the operating batch.

    Raises:
        NotFound: a file that does not exist.
        InvalidArgument: a config that is not JSON or a trace that cannot be read.
    """
    from kiln.workloads.traffic import TraceError, TrafficShape, read_trace

    cfg, trace_file = Path(config_path), Path(trace_path)
    for what, path in (("model config", cfg), ("trace", trace_file)):
        if not path.is_file():
            raise NotFound(f"{what} {str(path)!r} does not exist")
    try:
        text = cfg.read_text()
        json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidArgument(f"model config {str(cfg)!r} is not a JSON file ({exc})") from None
    try:
        trace = read_trace(trace_file)
        kwargs: dict[str, Any] = {} if max_batch is None else {"max_batch": max_batch}
        shape = TrafficShape.from_trace(trace, **kwargs)
    except (TraceError, ValueError, OSError) as exc:
        raise InvalidArgument(f"trace {str(trace_file)!r}: {exc}") from None
    name = cfg.parent.name if cfg.name == "config.json" else cfg.stem
    return common_pb2.Workload(
        model=common_pb2.ModelSpec(
            name=name, config_json=text, weights_dir=weights_dir, dtype=dtype, seed=seed
        ),
        traffic=shape.to_proto(),
        hardware=common_pb2.HardwareTarget(name=hardware, num_devices=num_devices),
    )
