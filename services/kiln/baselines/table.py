"""The side-by-side table ``kiln compile`` prints at the end (no torch): the baselines, kiln's
reference and kiln's best, each with tokens/s, ms/step, speedup over kiln's reference, the
fraction of the bandwidth limit and the prefill median (ms, blank when not timed).

Bandwidth limit: ``batch x bandwidth / (weights_bytes + KV read)`` tokens/s at the catalogue's
achievable bandwidth, the KV read that of
:func:`kiln.cost_model.step_bytes.decode_step_bytes_for` (``batch x context x kv_bytes_per_token``
when every layer attends the whole context; sliding-window and sparse layers read only what they
attend); weights only (an upper bound, said so) when the context is unknown.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.cost_model.step_bytes import DecodeStepBytes, decode_step_bytes, decode_step_bytes_for
from kiln.domain.baselines import BASELINE_CANDIDATE_PREFIX, BASELINE_NAMES
from kiln.workloads.config import DTYPE_BYTES, ModelConfig


@dataclass(frozen=True)
class Row:
    """One line of the table: decode tokens/s (0 = none), ms per step, tier ("full", "fast", ""),
    a note (skip or failure reason, correctness flag, prefill check) and the prefill median, ms
    (0 = not timed).
    """

    label: str
    tokens_per_s: float
    median_ms: float
    tier: str = ""
    note: str = ""
    prefill_ms: float = 0.0


@dataclass
class Comparison:
    """The events a compilation's table is made of, folded as they arrive (Watch).

    Attributes:
        baselines: baseline name -> its ``BaselineCompared`` payload.
        reference_full: the reference's last correct full-tier ``ExperimentCompleted``.
        reference_fast: the ``BaselineMeasured`` payload.
        full_point: the first full-tier ``ExperimentCompleted`` of a baseline or the reference
            with ``context_len`` > 0 (operating point, dtype, layers held).
        reference_prefills: the reference's timed full-tier prefill medians (ms), in order.
        confirmed: candidate id -> (its last correct full-tier ``ExperimentCompleted``, the
            reference's last before it or None), as :func:`kiln.domain.judging.full_reference`.
    """

    reference_id: str
    baselines: dict[str, dict[str, Any]] = field(default_factory=dict)
    reference_full: dict[str, Any] | None = None
    reference_fast: dict[str, Any] | None = None
    full_point: dict[str, Any] | None = None
    reference_prefills: list[float] = field(default_factory=list)
    confirmed: dict[str, tuple[dict[str, Any], dict[str, Any] | None]] = field(default_factory=dict)

    def update(self, event_type: str, detail: dict[str, Any]) -> None:
        """Fold one event (type and payload; numbers may arrive as floats from a Struct)."""
        if event_type == "BaselineCompared" and detail.get("name"):
            self.baselines[str(detail["name"])] = detail
        elif event_type == "BaselineMeasured":
            self.reference_fast = detail
        elif event_type == "ExperimentCompleted" and detail.get("tier") == "full":
            candidate = str(detail.get("candidate_id", ""))
            ours = candidate == self.reference_id or candidate.startswith(BASELINE_CANDIDATE_PREFIX)
            if ours and self.full_point is None and _int(detail, "context_len") > 0:
                self.full_point = detail
            if detail.get("status") != "ok" or not detail.get("correct"):
                return
            if candidate == self.reference_id:
                self.reference_full = detail
                if _float(detail, "prefill_median_ms") > 0:
                    self.reference_prefills.append(_float(detail, "prefill_median_ms"))
            elif not candidate.startswith(BASELINE_CANDIDATE_PREFIX):
                self.confirmed[candidate] = (detail, self.reference_full)

    def reference(self) -> Row | None:
        """kiln's reference: on the full tier when measured there, else the fast tier's."""
        for tier, d in (("full", self.reference_full), ("fast", self.reference_fast)):
            if d is not None and float(d.get("tokens_per_s", 0) or 0) > 0:
                return Row(
                    "kiln reference",
                    float(d["tokens_per_s"]),
                    float(d.get("median_ms", 0) or 0),
                    tier,
                    prefill_ms=_float(d, "prefill_median_ms") if tier == "full" else 0.0,
                )
        return None

    def best(self, tokens_per_s: float, median_ms: float, tier: str, candidate_id: str) -> Row:
        """kiln's best, with its last full-tier prefill and :meth:`prefill_check` as the note."""
        if tier != "full" or candidate_id not in self.confirmed:
            return Row("kiln best", tokens_per_s, median_ms, tier)
        check = self.prefill_check(candidate_id)
        note = check.note() if check else ""
        return Row("kiln best", tokens_per_s, median_ms, tier, note, self.prefill_of(candidate_id))

    def prefill_of(self, candidate_id: str) -> float:
        """A candidate's last correct full-tier prefill median, ms (0 when none or not timed)."""
        detail, _ = self.confirmed.get(candidate_id, ({}, None))
        return _float(detail, "prefill_median_ms")

    def prefill_check(self, candidate_id: str) -> PrefillCheck | None:
        """A confirmed candidate's prefill against the adjacent reference's; None when not
        confirmed or either prefill was not timed.
        """
        detail, ref = self.confirmed.get(candidate_id, ({}, None))
        mine, theirs = _float(detail, "prefill_median_ms"), _float(ref or {}, "prefill_median_ms")
        if mine <= 0 or theirs <= 0:
            return None
        runs = self.reference_prefills
        spread = max(runs) - min(runs) if len(runs) > 1 else None
        return PrefillCheck(mine, theirs, spread, len(runs))

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
            prefill = _float(d, "prefill_median_ms") if tps else 0.0
            rows.append(Row(name, tps, ms, str(d.get("tier", "")), note, prefill))
        return rows

    def batch(self) -> int:
        """The baselines' decode batch, else the full tier's ``batch_size`` (1 when unknown)."""
        for d in self.baselines.values():
            if _int(d, "batch") > 0:
                return _int(d, "batch")
        return _int(self.full_point or {}, "batch_size") or 1

    def context(self) -> int:
        """The baselines' KV context per sequence, else the full tier's ``context_len`` (0 when
        unknown).
        """
        for d in self.baselines.values():
            if _int(d, "context") > 0:
                return _int(d, "context")
        return _int(self.full_point or {}, "context_len")

    def dtype(self) -> str:
        """The full-tier engine's dtype (its KV cache's), "" when no event said."""
        env = (self.full_point or {}).get("environment") or {}
        return str(env.get("dtype", "")) if isinstance(env, dict) else ""

    def layers(self) -> int:
        """Decoder layers the full-tier engine holds when an op profile said (0: all)."""
        shape = (self.full_point or {}).get("op_profile_shape") or {}
        return _int(shape, "layers") if isinstance(shape, dict) else 0

    def weights_bytes(self) -> int:
        """The full-tier engine's weights, bytes (0 when unknown)."""
        for d in [*self.baselines.values(), self.reference_full or {}, self.full_point or {}]:
            if _int(d, "weights_bytes") > 0:
                return _int(d, "weights_bytes")
        return 0

    def limit(
        self,
        hardware: str,
        config: ModelConfig | None,
        dtype: str = "",
        expert_zipf_exponent: float = 0.0,
    ) -> BandwidthLimit | None:
        """The bandwidth limit of the baselines' operating point on ``hardware``.

        Weights plus the KV a step reads at :meth:`context` and :meth:`batch`
        (:func:`~kiln.cost_model.step_bytes.decode_step_bytes_for` of ``config``: sliding and
        sparse layers only what they attend); weights only, saying why, when either is unknown;
        MoE experts a step is expected not to read (by ``expert_zipf_exponent``) are left out.
        None when the weights bytes or hardware are unknown.
        """
        context, dtype = self.context(), self.dtype() or dtype
        why = ""
        if context <= 0:
            why = "context unknown"
        elif config is None:
            why = "model config unknown"
        elif dtype not in DTYPE_BYTES:
            why = f"KV dtype {dtype or 'unknown'}"
        weights, note = self.weights_bytes(), ""
        if config is not None and weights > 0:
            weights, note = _weights_read(
                config, weights, self.batch(), self.layers(), dtype, expert_zipf_exponent
            )
        if why or config is None:
            return bandwidth_limit(
                hardware, weights, self.batch(), weights_only_reason=why, moe_note=note
            )
        step = decode_step_bytes_for(config, weights, self.batch(), context, dtype, self.layers())
        return bandwidth_limit(
            hardware,
            weights,
            self.batch(),
            context=context,
            kv_bytes_per_token=step.kv_bytes_per_token,
            kv_bytes=step.kv,
            kv_span=step.kv_span,
            moe_note=note,
        )


def _weights_read(
    config: ModelConfig, held: int, batch: int, layers: int, dtype: str, zipf: float
) -> tuple[int, str]:
    """(weight bytes a step reads, what was left out) of an engine holding ``held`` bytes."""
    from kiln.cost_model.step_bytes import expected_experts_read, weights_read_bytes
    from kiln.workloads.traffic.experts import zipf_shares

    size = DTYPE_BYTES.get(dtype or config.torch_dtype, 2)
    m = config.moe
    shares = zipf_shares(m.num_experts, m.top_k, zipf) if m is not None and zipf > 0 else None
    read = weights_read_bytes(config, held, size, batch, layers=layers, shares=shares)
    notes = [] if config.tie_word_embeddings else ["the embedding table's unread rows left out"]
    if m is not None:
        experts = expected_experts_read(m.num_experts, m.top_k, batch, shares)
        skew = f"Zipf {zipf:g}" if zipf > 0 else "uniform"
        notes.append(
            f"MoE: {experts:,.1f} of {m.num_experts} experts a layer read at batch {batch:,} "
            f"(expected, {skew} routing)"
        )
    return max(1, round(read)), "; ".join(notes)


@dataclass(frozen=True)
class PrefillCheck:
    """A confirmed candidate's prefill against the adjacent full-tier reference's: a note, never
    a rejection. Times in ms; ``spread_ms`` is max - min over the reference's ``runs`` prefills
    (None with fewer than two).
    """

    candidate_ms: float
    reference_ms: float
    spread_ms: float | None
    runs: int

    @property
    def slower(self) -> bool:
        """Slower than the reference by more than its spread (never when that is unknown)."""
        return self.spread_ms is not None and self.candidate_ms - self.reference_ms > self.spread_ms

    def _verdict(self) -> tuple[str, str]:
        """(short, long) words on the difference."""
        if self.candidate_ms <= self.reference_ms:
            return "", ""
        if self.spread_ms is None:
            return " (noise unknown)", ": not flagged, the reference's spread is unknown (1 run)"
        spread = f"the reference's spread ({self.spread_ms:,.2f} ms over {self.runs} runs)"
        if self.slower:
            return "", f": SLOWER, beyond {spread}"
        return " (within noise)", f": within {spread}"

    def note(self) -> str:
        """Short, for the row, e.g. ``PREFILL SLOWER +6%``, ``prefill +1% (within noise)``."""
        change = f"{self.candidate_ms / self.reference_ms - 1:+.0%}"
        short, _ = self._verdict()
        return f"PREFILL SLOWER {change}" if self.slower else f"prefill {change}{short}"

    def describe(self) -> str:
        """One line with both medians, the difference and the reference's spread."""
        change = self.candidate_ms / self.reference_ms - 1
        _, long = self._verdict()
        return (
            f"kiln best prefill {self.candidate_ms:,.2f} ms vs {self.reference_ms:,.2f} ms for "
            f"the reference measured next to it ({change:+.0%}){long}"
        )


def _int(d: dict[str, Any], key: str) -> int:
    """``d[key]`` as an int (0 when absent, None or not a number)."""
    try:
        return int(float(d.get(key) or 0))
    except (TypeError, ValueError):
        return 0


def _float(d: dict[str, Any], key: str) -> float:
    """``d[key]`` as a float (0.0 when absent, None or not a number)."""
    try:
        return float(d.get(key) or 0)
    except (TypeError, ValueError):
        return 0.0


@dataclass(frozen=True)
class BandwidthLimit:
    """Decode tokens/s if a step only read its bytes once at the target's bandwidth.

    Attributes:
        tokens_per_s: ``batch x bandwidth / (weights + KV)``.
        bandwidth_bytes_per_s: the bandwidth used, bytes/s; source: where it comes from.
        step: the bytes a step reads.
        weights_only_reason: why the KV cache is not counted ("" when it is).
        moe_note: held weights a step does not read, left out ("" when none).
    """

    tokens_per_s: float
    bandwidth_bytes_per_s: float
    source: str
    step: DecodeStepBytes
    weights_only_reason: str = ""
    moe_note: str = ""

    @property
    def counts_kv(self) -> bool:
        """The KV cache read at a known context is part of the bytes."""
        return self.step.context > 0 and self.step.kv_bytes_per_token > 0

    def describe(self) -> str:
        """The formula with its figures, e.g. ``1,575 tok/s = batch x 4.26 TB/s / (weights ... +
        KV ...)``.
        """
        s = self.step
        tb_s = self.bandwidth_bytes_per_s / 1e12
        head = f"{self.tokens_per_s:,.0f} tok/s = batch x {tb_s:.2f} TB/s"
        if self.counts_kv:
            span = f"; attention read: {s.kv_span}" if s.kv_span else ""
            bytes_ = (
                f"(weights {_size(s.weights)} + KV {_size(s.kv)} at batch {s.batch:,}, "
                f"context {s.context:,}{span})"
            )
        else:
            why = self.weights_only_reason or "context unknown"
            bytes_ = f"weights {_size(s.weights)} at batch {s.batch:,}, weights only ({why})"
        moe = f"; {self.moe_note}" if self.moe_note else ""
        return f"{head} / {bytes_}{moe} ({self.source})"

    def fraction(self, tokens_per_s: float) -> float | None:
        """``tokens_per_s`` over the limit (None when either is not positive)."""
        if tokens_per_s <= 0 or self.tokens_per_s <= 0:
            return None
        return tokens_per_s / self.tokens_per_s


def _size(nbytes: float) -> str:
    """Bytes as GB with two decimals, or MB below 0.1 GB (``0.23 GB``, ``4.2 MB``)."""
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


def bandwidth_limit(
    hardware: str,
    weights_bytes: int,
    batch: int,
    *,
    context: int = 0,
    kv_bytes_per_token: float = 0,
    kv_bytes: float | None = None,
    kv_span: str = "",
    weights_only_reason: str = "",
    moe_note: str = "",
) -> BandwidthLimit | None:
    """The bandwidth limit on ``hardware`` (catalogue name) of a step reading ``weights_bytes``
    plus its KV: ``kv_bytes`` when given (the step's read, bytes; ``kv_span`` says how sliding or
    sparse layers cut it), else ``batch x context x kv_bytes_per_token``; weights only when
    ``context`` or ``kv_bytes_per_token`` is 0. None when the hardware is unknown or
    ``weights_bytes`` or ``batch`` is 0.
    """
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
    if context <= 0 or kv_bytes_per_token <= 0:
        context, kv_bytes_per_token, kv_bytes, kv_span = 0, 0, None, ""
    step = decode_step_bytes(
        weights_bytes, batch, context, kv_bytes_per_token, kv_bytes=kv_bytes, kv_span=kv_span
    )
    reason = "" if context else (weights_only_reason or "context unknown")
    return BandwidthLimit(step.limit_tokens_per_s(bw), bw, source, step, reason, moe_note)


def table_rows(
    comparison: Comparison,
    best_tokens_per_s: float,
    best_median_ms: float,
    best_tier: str,
    best_id: str = "",
) -> list[Row]:
    """Baselines, then kiln's reference, then kiln's best when there is one (``best_id`` for its
    prefill).
    """
    rows = comparison.baseline_rows()
    ref = comparison.reference()
    if ref is not None:
        rows.append(ref)
    if best_tokens_per_s > 0:
        rows.append(comparison.best(best_tokens_per_s, best_median_ms, best_tier, best_id))
    return rows


def speedup(row: Row, reference: Row | None) -> float | None:
    """``row`` tokens/s over the reference's, or None when either is missing."""
    if reference is None or reference.tokens_per_s <= 0 or row.tokens_per_s <= 0:
        return None
    return row.tokens_per_s / reference.tokens_per_s
