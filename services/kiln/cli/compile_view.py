"""What ``kiln compile`` shows: live progress while it runs, a summary table at the end."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.json_format import MessageToDict
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from kiln.baselines.table import BandwidthLimit, Comparison
from kiln.cli.compile_notes import baseline_rows, summary_warnings
from kiln.cli.compile_notes import tier_text as _tier
from kiln.cli.compile_notes import tps as _tps
from kiln.domain.move_effects import Measured, MoveEffect, move_effects
from kiln.v1 import common_pb2, compiler_pb2
from kiln.workloads.config import ModelConfig

STATUS_NAMES = {
    compiler_pb2.COMPILATION_STATUS_PENDING: "pending",
    compiler_pb2.COMPILATION_STATUS_RUNNING: "running",
    compiler_pb2.COMPILATION_STATUS_SUCCEEDED: "succeeded",
    compiler_pb2.COMPILATION_STATUS_CANCELLED: "cancelled",
    compiler_pb2.COMPILATION_STATUS_FAILED: "failed",
}
ENDED = {
    compiler_pb2.COMPILATION_STATUS_SUCCEEDED,
    compiler_pb2.COMPILATION_STATUS_CANCELLED,
    compiler_pb2.COMPILATION_STATUS_FAILED,
}


def describe_candidate(candidate: Any) -> str:
    """A candidate (proto message or canonical dict) as short text, e.g. ``attention=sdpa``."""
    from kiln.domain.candidate import Candidate

    if candidate is None:
        return ""
    try:
        if isinstance(candidate, dict):
            return Candidate.from_canonical(candidate).describe()
        return Candidate.from_proto(candidate).describe()
    except (KeyError, TypeError, ValueError):
        return "?"


def tier_agreement_text(detail: dict[str, Any]) -> str:
    """A ``TierAgreement`` payload as one line (its ``n`` may arrive as a float from a
    Struct)."""
    from kiln.domain.judging import agreement_text

    rho = detail.get("rho")
    return agreement_text(int(detail.get("n", 0) or 0), None if rho is None else float(rho))


@dataclass
class CompileView:
    """State of one watched compilation, updated event by event."""

    compilation_id: str
    budget_s: float
    started: float = field(default_factory=time.monotonic)
    snapshot: compiler_pb2.Compilation | None = None
    agents: dict[str, str] = field(default_factory=dict)
    recent: list[str] = field(default_factory=list)
    proposals: dict[str, tuple[str, str]] = field(default_factory=dict)
    """candidate id -> (agent, description), so a result names what it measured."""
    recipes: dict[str, Any] = field(default_factory=dict)
    """candidate id -> its canonical form, as requested."""
    measured: list[Measured] = field(default_factory=list)
    """Every correct result, for :meth:`move_effects`."""
    latest: str = ""
    """The line of the last event folded in ("" when it had none)."""

    def update(self, event: compiler_pb2.CompilationEvent) -> None:
        """Fold one Watch event into the view."""
        if event.HasField("snapshot"):
            self.snapshot = event.snapshot
        detail = MessageToDict(event.detail) if event.HasField("detail") else {}
        line = self._line(event.type, detail)
        self.latest = line
        if line:
            self.recent = [*self.recent[-5:], line]

    def _line(self, kind: str, d: dict[str, Any]) -> str:
        agent = str(d.get("agent", ""))
        candidate_id = str(d.get("candidate_id", ""))
        if kind == "ExperimentRequested":
            what = describe_candidate(d.get("candidate"))
            if d.get("tier") == "full":
                what += " (full tier)"
            self.proposals[candidate_id] = (agent or "agent", what)
            self.recipes.setdefault(candidate_id, d.get("candidate"))
            if agent:
                self.agents[agent] = f"measuring {what}"
            return f"{agent or 'agent'} → {what}"
        if kind == "ExperimentCompleted":
            who, what = self.proposals.get(candidate_id, ("", candidate_id[:8]))
            status = d.get("status", "?")
            tps = float(d.get("tokens_per_s", 0.0) or 0.0)
            outcome = _tps(tps) if status == "ok" else str(d.get("error", ""))[:60]
            self._measured(candidate_id, d, tps)
            # The result before the candidate: a narrow terminal cuts the end of the line.
            if who in self.agents:
                self.agents[who] = f"{status} {outcome} ← {what}".strip()
            return f"{who or 'result'}: {status} {outcome} ← {what}".strip()
        if kind == "MeasurementReused":  # an earlier compilation's result, no engine ran
            what = describe_candidate(d.get("candidate"))
            result = d.get("result") or {}
            tps = float(result.get("tokens_per_s", 0.0) or 0.0)
            self.recipes.setdefault(candidate_id, d.get("candidate"))
            self._measured(candidate_id, {**result, "tier": d.get("tier", "fast")}, tps)
            outcome = _tps(tps) if result.get("status") == "ok" else str(result.get("status", "?"))
            return f"{agent or 'agent'}: reused {outcome} ← {what}"
        if kind == "BaselineMeasured":
            return f"baseline {_tps(float(d.get('tokens_per_s', 0.0)))}"
        if kind == "BaselineCompared":
            state = d.get("skipped_reason") or d.get("status", "?")
            return (
                f"compared {d.get('name', '?')}: {_tps(float(d.get('tokens_per_s', 0.0)))} {state}"
            )
        if kind == "BestCandidateImproved":
            return (
                f"new best {_tps(float(d.get('tokens_per_s', 0.0)))} "
                f"({float(d.get('speedup', 0.0)):.2f}x, {d.get('tier', '?')} tier)"
            )
        if kind == "TierAgreement":
            return tier_agreement_text(d)
        if kind == "CompilationSubmitted":
            return "submitted"
        if kind == "CompilationPlanned":
            return "plan chosen"
        if kind == "CompilationEnded":
            return f"ended: {d.get('status', '?')} {d.get('reason', '')}".strip()
        return kind

    def _measured(self, candidate_id: str, d: dict[str, Any], tps: float) -> None:
        from kiln.domain.candidate import Candidate

        if d.get("status") != "ok" or d.get("correct") is False or tps <= 0:
            return
        try:
            candidate = Candidate.from_canonical(self.recipes[candidate_id])
        except (KeyError, TypeError, ValueError, AttributeError):
            return  # requested before the watch began, or malformed
        self.measured.append(Measured(candidate, str(d.get("tier", "")), tps))

    def move_effects(self) -> list[MoveEffect]:
        """What each move of the confirmed best bought on the fast tier
        (:func:`kiln.domain.move_effects.move_effects`); empty without a best."""
        from kiln.domain.candidate import Candidate

        if self.snapshot is None or not self.snapshot.HasField("best"):
            return []
        best = Candidate.from_proto(self.snapshot.best.candidate)
        return move_effects(best, self.measured, "fast")

    @property
    def ended(self) -> bool:
        """True once the compilation reached a final status."""
        return self.snapshot is not None and self.snapshot.status in ENDED

    def __rich__(self) -> RenderableType:
        """Rendered afresh at every refresh, so the clock ticks between events."""
        return self.render()

    def render(self) -> RenderableType:
        """The live progress block."""
        snap = self.snapshot
        elapsed = time.monotonic() - self.started
        clock = f"{elapsed:,.0f}s of {self.budget_s:,.0f}s"
        if elapsed > self.budget_s:  # the search is over: settling, baselines
            clock = f"{elapsed:,.0f}s (search budget {self.budget_s:,.0f}s spent; finishing)"
        head = Text(f"compilation {self.compilation_id[:12]}  ·  {clock}", style="bold")
        parts: list[RenderableType] = [head]
        if snap is not None:
            parts.append(
                Text(
                    f"{STATUS_NAMES.get(snap.status, '?')}  ·  experiments {snap.experiments_done}"
                    f" (failures {snap.failures})  ·  {_progress_figures(snap)}"
                )
            )
            if snap.HasField("best"):
                parts.append(
                    Text(f"best: {describe_candidate(snap.best.candidate)}", style="green")
                )
        if self.agents:
            table = Table("agent", "now", box=None, show_header=False, pad_edge=False)
            table.columns[0].no_wrap = True  # a long "now" never squeezes the names away
            table.columns[0].min_width = max(map(len, self.agents))
            table.columns[1].no_wrap = True
            table.columns[1].overflow = "ellipsis"
            for name, doing in sorted(self.agents.items()):
                table.add_row(Text(name, style="cyan"), doing)
            parts.append(table)
        parts.extend(
            Text(line, style="dim", no_wrap=True, overflow="ellipsis") for line in self.recent
        )
        return Group(*parts)


def _progress_figures(snap: compiler_pb2.Compilation) -> str:
    """The live line's figures, each beside its own tier's reference: ``baseline 141.0 tok/s
    (fast)``, then ``best 56.0 tok/s (full, 1.33x its reference 42.1 tok/s)``."""
    text = f"baseline {_tps(snap.baseline.tokens_per_s)}" + (
        " (fast)" if snap.baseline.tier == common_pb2.TIER_FAST else ""
    )
    if not snap.HasField("best"):
        return text + "  ·  best -"
    best = snap.best
    tier = {common_pb2.TIER_FAST: "fast", common_pb2.TIER_FULL: "full"}.get(best.measurement.tier)
    ref = best.reference.tokens_per_s
    against = f" its reference {_tps(ref)}" if ref > 0 else ""
    inner = ", ".join(
        x for x in (tier, f"{best.speedup:.2f}x{against}" if best.speedup else "") if x
    )
    return f"{text}  ·  best {_tps(best.measurement.tokens_per_s)}" + (
        f" ({inner})" if inner else ""
    )


def usage_text(u: compiler_pb2.AgentUsage) -> str:
    """One agent's spending as one line, e.g. ``12 experiments (11 ok, 1 failed), device
    3.4 s, best 1,234.5 tok/s (fast tier)`` ("confirm" measures on the full tier, every other
    agent on the fast tier)."""
    from kiln.domain.judging import CONFIRM_AGENT, CONFIRM_TIER, SEARCH_TIER

    tier = CONFIRM_TIER if u.agent == CONFIRM_AGENT else SEARCH_TIER
    best = f", best {_tps(u.best_tokens_per_s)} ({tier} tier)" if u.best_tokens_per_s else ""
    spent = f"{u.experiments} experiments ({u.ok} ok, {u.failed} failed)"
    return f"{spent}, device {u.device_seconds:,.1f} s{best}"


def time_to_95(snap: compiler_pb2.Compilation) -> float | None:
    """Seconds from the submission until the best-so-far first reached 95 % of the final
    best's tokens/s (:func:`kiln.domain.curve.time_to_fraction`); None without a best."""
    from kiln.domain.curve import CurvePoint, time_to_fraction

    points = [
        CurvePoint(
            p.elapsed_s,
            p.experiments,
            p.device_s,
            p.tokens_per_s,
            p.speedup,
            p.candidate_id,
            p.experiment_id,
        )
        for p in snap.progress
    ]
    return time_to_fraction(points, 0.95)


def operating_point_text(m: common_pb2.Measurement, traffic: common_pb2.TrafficShape) -> str:
    """Where ``m`` was measured (batch, context), and what of the traffic shape the engine
    lowered; "" when the measurement does not record it (events before it was recorded)."""
    if not m.batch_size:
        return ""
    text = f"batch {m.batch_size}, context {m.context_len:,} tokens"
    lowered = []
    if traffic.batch_size and m.batch_size < traffic.batch_size:
        lowered.append(f"batch {traffic.batch_size}")
    if traffic.context_len and m.context_len < traffic.context_len:
        lowered.append(f"context {traffic.context_len:,}")
    if lowered:
        text += f" (the engine's limits lowered the traffic's {' and '.join(lowered)})"
    return text


def summary_table(snap: compiler_pb2.Compilation, moves: list[MoveEffect] | None = None) -> Table:
    """The end-of-compilation table: status (saying when no candidate was confirmed), baseline
    (beside a full-tier best, the full-tier reference measured next to it; the fast-tier one
    apart), best, speedup, how well the fast tier ranked candidates as the full tier did (the
    end of a succeeded compilation's reason), experiments, failures, time to 95 % of the final
    best, what each move of the best bought (``moves``, when given), each agent's spending,
    plan, and warnings (:func:`kiln.cli.compile_notes.summary_warnings`)."""
    table = Table(
        title=f"compilation {snap.compilation_id}", title_justify="left", show_header=False
    )
    table.add_column("", style="bold")
    table.add_column("")
    from kiln.domain.judging import AGREEMENT_PREFIX, NONE_CONFIRMED

    reason, cut, tiers = snap.reason.partition(f"; {AGREEMENT_PREFIX}")
    status = STATUS_NAMES.get(snap.status, "?")
    unconfirmed = ""
    if reason.startswith(NONE_CONFIRMED):
        unconfirmed, _, reason = reason.removeprefix(NONE_CONFIRMED).partition("; ")
        status += ", but no candidate was confirmed"
    table.add_row("status", status + (f" ({reason})" if reason else ""))
    for label, text in baseline_rows(snap):
        table.add_row(label, text)
    if snap.HasField("best"):
        m = snap.best.measurement
        table.add_row(
            "best",
            f"{_tps(m.tokens_per_s)}  (median {m.timing.median_ms:.2f} ms/step{_tier(m)})",
        )
        over = ""
        if m.tier == common_pb2.TIER_FULL:
            over = " over the reference measured next to it on the full tier"
            ref = snap.best.reference.tokens_per_s
            over += f" ({_tps(ref)})" if ref > 0 else ""
        table.add_row("speedup", f"{snap.best.speedup:.2f}x{over}")
        table.add_row("best candidate", describe_candidate(snap.best.candidate))
        for i, effect in enumerate(moves or []):
            table.add_row("what each move bought" if i == 0 else "", effect.text())
        point = operating_point_text(m, snap.workload.traffic)
        if point:
            table.add_row("measured at", point)
    elif snap.experiments_done == 0:
        table.add_row("best", "none: nothing was measured")
    elif unconfirmed:
        table.add_row("best", f"none: {unconfirmed}")
    else:
        table.add_row("best", "none confirmed on the full tier")
    if cut:
        table.add_row("fast vs full", tiers)
    table.add_row("experiments", str(snap.experiments_done))
    table.add_row("failures", str(snap.failures))
    to95 = time_to_95(snap)
    if to95 is not None:
        table.add_row("time to 95% of final best", f"{to95:,.0f} s")
    for u in snap.agent_usage:
        table.add_row(f"agent {u.agent}", usage_text(u))
    if snap.HasField("plan"):
        p = snap.plan
        table.add_row(
            "plan",
            f"tp={p.tp} ep={p.ep} dp={p.dp} pp={p.pp} dcp={p.dcp}  batch {p.batch_size}  "
            f"predicted TPOT {p.tpot_ms:.2f} ms, TTFT {p.ttft_ms:.1f} ms ({p.estimate_tier})"
            + (f"; {p.note}" if p.note else ""),
        )
    for warning in summary_warnings(snap):
        table.add_row(Text("warning", style="bold yellow"), warning)
    return table


def model_config(snap: compiler_pb2.Compilation) -> ModelConfig | None:
    """The compilation's model architecture from its submitted ``config_json`` (None when the
    snapshot does not carry it or it cannot be parsed)."""
    from kiln.workloads.config import parse_config

    text = snap.workload.model.config_json
    if not text:
        return None
    try:
        return parse_config(json.loads(text), snap.workload.model.name or "model")
    except (ValueError, KeyError, TypeError):
        return None


def comparison_limit(
    comparison: Comparison, snap: compiler_pb2.Compilation
) -> BandwidthLimit | None:
    """The bandwidth limit of the baselines' operating point on the compilation's hardware:
    weights plus the KV cache at the measured batch and context, KV per token from the
    submitted model config in the engine's dtype (:meth:`Comparison.limit`; for an MoE model
    the experts the routing reads under the traffic's expert-load skew); weights only, and
    saying so, when the context or config is unknown. None without weights bytes or a
    catalogue entry."""
    traffic = snap.workload.traffic
    return comparison.limit(
        snap.workload.hardware.name,
        model_config(snap),
        snap.workload.model.dtype,
        expert_zipf_exponent=traffic.expert_zipf_exponent,
    )


def prefill_text(ms: float) -> str:
    """A prefill median for the table: ``61.40``, ``1,234.5`` (ms), ``-`` when not timed."""
    if ms <= 0:
        return "-"
    return f"{ms:,.1f}" if ms >= 100 else f"{ms:.2f}"


def prefill_legend(comparison: Comparison) -> str:
    """What the table's "prefill ms" column measured: the median of the engine's timed
    prefills of ``batch x context`` prompt tokens on the full-tier engine (the decode operating
    point's context, :meth:`Comparison.context`; "-" where not timed)."""
    batch, context = comparison.batch(), comparison.context()
    at = f"{batch:,} x {context:,}" if context > 0 else "batch x context (not recorded)"
    return (
        f"prefill ms: median of timed prefills of {at} prompt tokens (batch x the decode "
        'context) on the full-tier engine; "-": not timed'
    )


def comparison_table(comparison: Comparison, snap: compiler_pb2.Compilation) -> Table | None:
    """The baselines measured in the same run (:mod:`kiln.baselines`), kiln's reference and
    kiln's best, side by side: tokens/s, ms/step, speedup over kiln's reference, the fraction
    of the bandwidth limit (:func:`comparison_limit`, described in the caption; the limit is
    the full tier's, so a fast-tier row, fewer layers, gets none) and the prefill median
    (:func:`prefill_legend`; kiln best's note flags a prefill regression, detailed in the
    caption: :meth:`Comparison.prefill_check`). Figures and labels' words never wrap; headers
    and notes do. None when the compilation compared no baseline."""
    from kiln.baselines.table import speedup, table_rows

    if not comparison.baselines:
        return None
    best_tps = best_ms = 0.0
    best_tier = ""
    if snap.HasField("best"):
        m = snap.best.measurement
        best_tps, best_ms = m.tokens_per_s, m.timing.median_ms
        best_tier = {common_pb2.TIER_FAST: "fast", common_pb2.TIER_FULL: "full"}.get(m.tier, "")
    best_id = snap.best.candidate.candidate_id if snap.HasField("best") else ""
    rows = table_rows(comparison, best_tps, best_ms, best_tier, best_id)
    reference = comparison.reference()
    limit = comparison_limit(comparison, snap)
    caption = (
        f"bandwidth limit {limit.describe()}"
        if limit
        else "bandwidth limit unknown (no weights bytes or hardware entry)"
    )
    lines = [caption, prefill_legend(comparison)]
    check = comparison.prefill_check(best_id) if best_tier == "full" else None
    if check is not None:
        lines.append(check.describe())
    table = Table(
        title="baselines measured in the same run",
        title_justify="left",
        caption="\n".join(lines),
        caption_justify="left",
    )
    table.add_column("", min_width=max(len(w) for row in rows for w in row.label.split()))
    for header in ("tok/s", "step\nms", "vs kiln\nref", "of bw\nlimit", "prefill\nms", "tier"):
        table.add_column(header, no_wrap=True)  # figures never wrap
    table.add_column("")
    for row in rows:
        gain = speedup(row, reference)
        frac = limit.fraction(row.tokens_per_s) if limit and row.tier != "fast" else None
        table.add_row(
            row.label,
            f"{row.tokens_per_s:,.1f}" if row.tokens_per_s else "-",
            f"{row.median_ms:.2f}" if row.median_ms else "-",
            f"{gain:.2f}x" if gain is not None else "-",
            f"{frac:.0%}" if frac is not None else "-",
            prefill_text(row.prefill_ms),
            row.tier,
            row.note,
        )
    return table
