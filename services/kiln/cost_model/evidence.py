"""What an estimate knows beyond the catalogue: the device's microbenchmark table (tier 2) and
the calibration of this model's decode step on this hardware against measured passes (tier 3).

An empty :class:`Evidence` (:data:`NO_EVIDENCE`) gives the roofline tier alone. The cost model
service builds one per request from what it has read off the ledger
(:mod:`kiln.cost_model.knowledge`)."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.cost_model.calibration import Calibration
from kiln.cost_model.microbench_table import MicrobenchTable


@dataclass(frozen=True)
class Evidence:
    """``table``: the device kind's microbenchmarks (None: none measured); ``calibration``: the
    decode-step factor of this (model, hardware) with its residuals (None: no measured pass);
    ``graphs``: decode kernels are CUDA-graph replays (launch cost ``launch(graph=True)``)."""

    table: MicrobenchTable | None = None
    calibration: Calibration | None = None
    graphs: bool = True


NO_EVIDENCE = Evidence()
