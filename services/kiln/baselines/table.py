"""The side-by-side table ``kiln compile`` prints at the end: the baselines, kiln's reference,
kiln's best, each with tokens/s, ms/step, speedup over kiln's reference and the fraction of
the memory-bandwidth limit (no torch).

The bandwidth limit of a decode step is reading every weight once: ``batch x bandwidth /
weights_bytes`` tokens/s (e.g. an H200's measured 4.26 TB/s copy bandwidth and Llama-3.2-1B's
2.47 GB of bf16 weights: about 1,720 tokens/s at batch 1). The bandwidth is the hardware
catalogue's achievable figure for the target
(:attr:`kiln.cost_model.hardware.Hardware.achievable_bandwidth_bytes_per_s`, with its source);
the KV cache read is left out, so the limit is an upper bound that is tightest at small batch
and context.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.baselines.names import BASELINE_NAMES


@dataclass(frozen=True)
class Row:
    """One line of the table.

    Attributes:
        label: what was measured. tokens_per_s: decode tokens/s (0 = none). median_ms: ms per
        decode step. tier: engine tier ("full", "fast", "" unknown). note: skipped or failure
        reason, correctness flag.
    """

    label: str
    tokens_per_s: float
    median_ms: float
    tier: str = ""
    note: str = ""


@dataclass
class Comparison:
    """The events a compilation's table is made of, folded as they arrive (Watch).

    Attributes:
        baselines: baseline name -> its ``BaselineCompared`` payload.
        reference_full: the last correct full-tier ``ExperimentCompleted`` of kiln's reference
            candidate (the same tier and engine as the baselines).
        reference_fast: the ``BaselineMeasured`` payload (fast tier).
        reference_id: the reference candidate's id.
    """

    reference_id: str
    baselines: dict[str, dict[str, Any]] = field(default_factory=dict)
    reference_full: dict[str, Any] | None = None
    reference_fast: dict[str, Any] | None = None

    def update(self, event_type: str, detail: dict[str, Any]) -> None:
        """Fold one event (type and payload)."""
        if event_type == "BaselineCompared" and detail.get("name"):
            self.baselines[str(detail["name"])] = detail
        elif event_type == "BaselineMeasured":
            self.reference_fast = detail
        elif (
            event_type == "ExperimentCompleted"
            and detail.get("candidate_id") == self.reference_id
            and detail.get("tier") == "full"
            and detail.get("status") == "ok"
            and detail.get("correct")
        ):
            self.reference_full = detail

    def reference(self) -> Row | None:
        """kiln's reference: on the full tier when measured there, else the fast tier's."""
        for tier, d in (("full", self.reference_full), ("fast", self.reference_fast)):
            if d is not None and float(d.get("tokens_per_s", 0) or 0) > 0:
                return Row(
                    "kiln reference",
                    float(d["tokens_per_s"]),
                    float(d.get("median_ms", 0) or 0),
                    tier,
                )
        return None

    def baseline_rows(self) -> list[Row]:
        """One row per baseline, in :data:`BASELINE_NAMES` order."""
        rows = []
        known = {n: i for i, n in enumerate(BASELINE_NAMES)}
        order = sorted(self.baselines, key=lambda n: (known.get(n, len(known)), n))
        for name in order:
            d = self.baselines[name]
            note = ""
            if d.get("skipped_reason"):
                note = f"skipped: {d['skipped_reason']}"
            elif d.get("status") != "ok":
                note = f"{d.get('status', '?')}: {str(d.get('error', ''))[:80]}"
            elif not d.get("correct"):
                note = f"INCORRECT (max abs error {float(d.get('max_abs_error', 0) or 0):.3g})"
            else:
                note = f"correct (max abs error {float(d.get('max_abs_error', 0) or 0):.3g})"
            tps = float(d.get("tokens_per_s", 0) or 0) if d.get("status") == "ok" else 0.0
            ms = float(d.get("median_ms", 0) or 0) if tps else 0.0
            rows.append(Row(name, tps, ms, str(d.get("tier", "")), note))
        return rows

    def batch(self) -> int:
        """The decode batch of the baselines' operating point (1 when unknown)."""
        for d in self.baselines.values():
            if int(d.get("batch", 0) or 0) > 0:
                return int(d["batch"])
        return 1

    def weights_bytes(self) -> int:
        """The full-tier engine's weights, bytes (0 when unknown)."""
        for d in [*self.baselines.values(), self.reference_full or {}]:
            if int(d.get("weights_bytes", 0) or 0) > 0:
                return int(d["weights_bytes"])
        return 0


@dataclass(frozen=True)
class BandwidthLimit:
    """Decode tokens/s if a step only read the weights once at the target's bandwidth.

    Attributes:
        tokens_per_s: ``batch x bandwidth / weights_bytes``.
        bandwidth_bytes_per_s: the bandwidth used, bytes/s. source: where it comes from.
    """

    tokens_per_s: float
    bandwidth_bytes_per_s: float
    source: str

    def describe(self) -> str:
        """E.g. ``1,725 tok/s (h200 4.26 TB/s: measured ...)``."""
        return (
            f"{self.tokens_per_s:,.0f} tok/s = batch x {self.bandwidth_bytes_per_s / 1e12:.2f} "
            f"TB/s / weights bytes ({self.source})"
        )


def bandwidth_limit(hardware: str, weights_bytes: int, batch: int) -> BandwidthLimit | None:
    """The bandwidth limit on ``hardware`` (a catalogue name), or None when the hardware is
    unknown or ``weights_bytes`` is 0."""
    from kiln.common.errors import NotFound
    from kiln.cost_model.hardware import get_hardware

    if weights_bytes <= 0 or batch <= 0:
        return None
    try:
        hw = get_hardware(hardware)
    except NotFound:
        return None
    bw = hw.achievable_bandwidth_bytes_per_s
    why = hw.sources.get("achievable_bandwidth_fraction") or hw.sources.get(
        "memory_bandwidth_bytes_per_s", ""
    )
    source = f"{hw.name} achievable bandwidth; {why}" if why else f"{hw.name} catalogue"
    return BandwidthLimit(batch * bw / weights_bytes, bw, source)


def table_rows(
    comparison: Comparison, best_tokens_per_s: float, best_median_ms: float, best_tier: str
) -> list[Row]:
    """Baselines, then kiln's reference, then kiln's best (when there is one)."""
    rows = comparison.baseline_rows()
    ref = comparison.reference()
    if ref is not None:
        rows.append(ref)
    if best_tokens_per_s > 0:
        rows.append(Row("kiln best", best_tokens_per_s, best_median_ms, best_tier))
    return rows


def speedup(row: Row, reference: Row | None) -> float | None:
    """``row`` tokens/s over the reference's, or None when either is missing."""
    if reference is None or reference.tokens_per_s <= 0 or row.tokens_per_s <= 0:
        return None
    return row.tokens_per_s / reference.tokens_per_s
