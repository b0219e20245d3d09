"""What an estimate knows beyond the catalogue: the device's microbenchmark table (tier 2) and
the calibrations of this model's decode step and prefill on this hardware against measured passes
(tier 3).

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
    ``graphs``: decode kernels are CUDA-graph replays (launch cost ``launch(graph=True)``);
    ``prefill_calibration``: the prefill pass's factor from the engines' timed prefills (None:
    none timed)."""

    table: MicrobenchTable | None = None
    calibration: Calibration | None = None
    graphs: bool = True
    prefill_calibration: Calibration | None = None


NO_EVIDENCE = Evidence()
