"""Decoder models made of named, swappable ops (see :mod:`kiln.ops`).

``build_model(config, ...)`` gives a :class:`DecoderModel`; its :class:`OpBinding` chooses the
op implementations and can be swapped with ``DecoderModel.rebind`` (hot reload).
"""

from kiln.workloads.models.binding import OpBinding
from kiln.workloads.models.build import UnbuildableModelError, build_model
from kiln.workloads.models.decoder import DecoderModel
from kiln.workloads.models.expert_load import ExpertLoadReport
from kiln.workloads.models.kv_cache import StaticKVCache
from kiln.workloads.models.routing import measure_expert_load

__all__ = [
    "DecoderModel",
    "ExpertLoadReport",
    "OpBinding",
    "StaticKVCache",
    "UnbuildableModelError",
    "build_model",
    "measure_expert_load",
]
