"""Workloads: validating a submitted ``kiln.v1.Workload`` and computing its workload key.

The workload key identifies the same optimization problem across compilations: ``wk-`` + 16 hex
digits of the SHA-256 of the canonical JSON of the parsed model config and effective weight
dtype, every traffic field but ``source``, and the hardware name (lower case) and device count
(0 resolved to the catalogue's). Not the model's name, weights directory or seed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.protobuf.json_format import MessageToDict, ParseDict

from kiln.common.errors import InvalidArgument, NotFound, OutOfRange, quote
from kiln.cost_model.bounds import check_devices
from kiln.cost_model.hardware import get_hardware
from kiln.domain.operating_point import (
    OperatingPointError,
    OperatingPointRangeError,
    check_traffic,
)
from kiln.v1 import common_pb2
from kiln.workloads.config import (
    ConfigRangeError,
    ModelConfig,
    UnsupportedModelError,
    parse_config,
    read_config_json,
)
from kiln.workloads.config_bounds import MAX_NAME_CHARS

DTYPES = ("bfloat16", "float16", "float32")
"""Accepted ``workload.model.dtype`` values ("" = the config's ``torch_dtype``)."""

_DISTRIBUTIONS = ("isl_tokens", "osl_tokens")
MAX_PATH_CHARS = 4096
"""Longest ``weights_dir`` (Linux's PATH_MAX)."""


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
    try:
        raw = read_config_json(spec.config_json, "workload.model.config_json")
        name = spec.name or (raw.get("model_type") if isinstance(raw, dict) else None) or "model"
        config = parse_config(raw, str(name)[: MAX_NAME_CHARS + 1])
    except ConfigRangeError as exc:
        raise OutOfRange(f"workload.model: {exc}") from None
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
            f"workload.model.dtype {quote(spec.dtype)} is not one of {', '.join(DTYPES)}"
        )
    if spec.weights_dir and (
        len(spec.weights_dir) > MAX_PATH_CHARS
        or "\x00" in spec.weights_dir
        or not Path(spec.weights_dir).is_dir()
    ):
        raise NotFound(
            f"workload.model.weights_dir {quote(spec.weights_dir)} is not a directory here"
        )
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
    try:  # every number finite, >= 0 and within its stated limit
        check_traffic(MessageToDict(tr, preserving_proto_field_name=True))
    except OperatingPointRangeError as exc:
        raise OutOfRange(f"workload.{exc}") from None
    except OperatingPointError as exc:
        raise InvalidArgument(f"workload.{exc}") from None
    for name in _DISTRIBUTIONS:
        d = getattr(tr, name)
        if d.max and not d.p50 <= d.p90 <= d.p99 <= d.max:
            raise InvalidArgument(
                f"workload.traffic.{name} percentiles are out of order "
                f"(p50 {d.p50:g}, p90 {d.p90:g}, p99 {d.p99:g}, max {d.max:g})"
            )
    return tr


def validate_workload(workload: common_pb2.Workload | None) -> ValidWorkload:
    """Check a submitted workload and fill in its key.

    Raises:
        InvalidArgument: no workload or config; a config not JSON or unsupported; an unknown
            dtype; no traffic shape or a malformed one; no hardware name.
        OutOfRange: a config number, traffic number or device count beyond its stated limit
            (:mod:`kiln.workloads.config_bounds`, :mod:`kiln.domain.operating_point`,
            :mod:`kiln.cost_model.bounds`).
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
    devices = check_devices(workload.hardware.num_devices) or hw.max_devices_per_node
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
