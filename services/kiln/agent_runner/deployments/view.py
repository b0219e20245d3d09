"""A deployment as the API shows it: the fold (:class:`DeploymentState`) as a
``kiln.v1.Deployment``, and each event as a ``HistoryEntry`` with one line for people (what
drifted and by how much, what was recompiled, what it bought)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from google.protobuf.json_format import ParseDict
from google.protobuf.struct_pb2 import Struct
from google.protobuf.timestamp_pb2 import Timestamp

from kiln.domain.compilation import Event
from kiln.domain.deployment import DeploymentState, Status
from kiln.v1 import common_pb2, deployments_pb2

STATUS = {
    Status.CREATING: deployments_pb2.DEPLOYMENT_STATUS_CREATING,
    Status.ACTIVE: deployments_pb2.DEPLOYMENT_STATUS_ACTIVE,
    Status.RECOMPILING: deployments_pb2.DEPLOYMENT_STATUS_RECOMPILING,
    Status.FAILED: deployments_pb2.DEPLOYMENT_STATUS_FAILED,
}


def _shape(data: Mapping[str, Any] | None) -> common_pb2.TrafficShape:
    return ParseDict(dict(data or {}), common_pb2.TrafficShape(), ignore_unknown_fields=True)


def _time(event: Event) -> Timestamp | None:
    if event.recorded_at is None:
        return None
    ts = Timestamp()
    ts.FromDatetime(event.recorded_at)
    return ts


def _isl(shape: Mapping[str, Any]) -> str:
    isl = shape.get("isl_tokens") or {}
    return f"ISL p50 {float(isl.get('p50', 0)):.0f}"


def summary(event: Event) -> str:
    """One line saying what the event recorded."""
    d = event.data
    t = event.type
    if t == "DeploymentCreated":
        return f"created {d['name']} for team {d['team']}"
    if t == "RecompilationStarted":
        if d["reason"] == "initial":
            return f"first compilation {d['compilation_id']} ({_isl(d.get('shape') or {})})"
        warm = len(d.get("warm_start_compilation_ids") or [])
        return (
            f"recompiling {d['compilation_id']} at window {d['window_index']}'s shape "
            f"({_isl(d.get('shape') or {})}), warm-started from {warm} compilation(s), "
            f"incumbent {d.get('incumbent_candidate_id') or '-'}"
        )
    if t == "TrafficWindowObserved":
        drift = d.get("drift") or {}
        mark = " DRIFTED" if d.get("drifted") else ""
        return (
            f"window {d['index']} [{d['start_s']:.0f}, {d['end_s']:.0f}) s: {d['requests']} "
            f"requests{' (sparse)' if d.get('sparse') else ''}, score "
            f"{float(drift.get('score', 0)):.2f} ({drift.get('dominant', '-')}){mark}"
        )
    if t == "DriftDetected":
        dim = d["dominant"]
        stat = float((d.get("dimensions") or {}).get(dim, 0.0))
        pd = d.get("predicted_drop")
        pred = f", predicted tokens/s drop {pd:.1%}" if pd is not None else ""
        return (
            f"drift at window {d['window_index']}: {dim} {stat:.3g} "
            f"({d['score']:.2f}x its threshold), {d['consecutive']} windows in a row{pred}"
        )
    if t == "CandidatePromoted":
        c = d.get("comparison") or {}
        if d["reason"] == "initial":
            return (
                f"promoted {d['candidate_id']} (first compilation, "
                f"{d.get('tokens_per_s', 0):.4g} tokens/s, {d.get('speedup', 0):.2f}x)"
            )
        return (
            f"promoted {d['candidate_id']} over {d.get('previous_candidate_id')}: "
            f"{c.get('challenger_median', 0):.4g} vs {c.get('incumbent_median', 0):.4g} tokens/s "
            f"({float(c.get('gain', 0)):+.1%}, noise {float(c.get('noise', 0)):.1%})"
        )
    if t == "PromotionDeclined":
        return f"declined {d.get('challenger_candidate_id') or '-'}: {d['reason']}"
    if t == "CandidateRolledBack":
        return f"rolled back {d['from_candidate_id']} -> {d['to_candidate_id']}"
    return t


def entry(event: Event) -> deployments_pb2.HistoryEntry:
    """The event as a history entry."""
    detail = Struct()
    detail.update(dict(event.data))
    out = deployments_pb2.HistoryEntry(
        position=event.position, type=event.type, summary=summary(event), detail=detail
    )
    ts = _time(event)
    if ts is not None:
        out.recorded_at.CopyFrom(ts)
    return out


def to_message(state: DeploymentState, *, history: bool = False) -> deployments_pb2.Deployment:
    """The deployment now (with every event summarized when ``history``)."""
    workload = state.workload
    m = deployments_pb2.Deployment(
        deployment_id=state.deployment_id,
        name=state.name,
        team=state.team,
        model=ParseDict(dict(workload.get("model") or {}), common_pb2.ModelSpec()),
        hardware=ParseDict(dict(workload.get("hardware") or {}), common_pb2.HardwareTarget()),
        policy=ParseDict(
            dict(state.policy), deployments_pb2.DeploymentPolicy(), ignore_unknown_fields=True
        ),
        status=STATUS[state.status],
        proven_shape=_shape(state.proven_shape),
        windows_observed=state.windows,
        recompilations=state.recompilations,
        reason=state.reason,
        compilation_ids=state.compilations,
    )
    m.model.config_json = ""  # the config is the compilations'; keep Get small
    if state.active is not None:
        m.active_candidate_id = state.active.candidate_id
        m.active_compilation_id = state.active.compilation_id
        m.active_tokens_per_s = state.active.tokens_per_s
    if state.recompiling is not None:
        r = state.recompiling
        m.current_recompilation.CopyFrom(
            deployments_pb2.Recompilation(
                compilation_id=str(r["compilation_id"]),
                reason=str(r["reason"]),
                window_index=int(r.get("window_index", -1)),
                shape=_shape(r.get("shape")),
                warm_start_compilation_ids=list(r.get("warm_start_compilation_ids") or []),
                incumbent_candidate_id=str(r.get("incumbent_candidate_id") or ""),
            )
        )
    if state.last_drift is not None:
        d = state.last_drift
        pd = d.get("predicted_drop")
        m.last_drift.CopyFrom(
            deployments_pb2.Drift(
                window_index=int(d["window_index"]),
                window_end_s=float(d["window_end_s"]),
                score=float(d["score"]),
                dominant=str(d["dominant"]),
                dimensions=dict(d.get("dimensions") or {}),
                normalized=dict(d.get("normalized") or {}),
                consecutive=int(d.get("consecutive", 0)),
                reason=str(d.get("reason", "")),
                predicted_drop=-1.0 if pd is None else float(pd),
            )
        )
    if state.last_verdict is not None:
        v = state.last_verdict
        m.last_verdict.CopyFrom(
            deployments_pb2.Verdict(
                compilation_id=str(v.get("compilation_id", "")),
                incumbent_candidate_id=str(v.get("incumbent_candidate_id", "")),
                challenger_candidate_id=str(v.get("challenger_candidate_id", "")),
                incumbent_median=float(v.get("incumbent_median", 0.0)),
                challenger_median=float(v.get("challenger_median", 0.0)),
                gain=float(v.get("gain", 0.0)),
                noise=float(v.get("noise", 0.0)),
                promoted=bool(v.get("promoted")),
                reason=str(v.get("reason", "")),
                incumbent_tokens_per_s=list(v.get("incumbent_tokens_per_s") or []),
                challenger_tokens_per_s=list(v.get("challenger_tokens_per_s") or []),
            )
        )
    if state.last_window is not None:
        w = state.last_window
        drift = w.get("drift") or {}
        m.last_window.CopyFrom(
            deployments_pb2.WindowSummary(
                index=int(w["index"]),
                start_s=float(w["start_s"]),
                end_s=float(w["end_s"]),
                requests=int(w["requests"]),
                sparse=bool(w.get("sparse")),
                score=float(drift.get("score", 0.0)),
                dominant=str(drift.get("dominant", "")),
                drifted=bool(w.get("drifted")),
                reason=str(w.get("reason", "")),
            )
        )
    first, last = state.events[0], state.events[-1]
    for field_name, event in (("created_at", first), ("updated_at", last)):
        ts = _time(event)
        if ts is not None:
            getattr(m, field_name).CopyFrom(ts)
    if history:
        m.history.extend(entry(e) for e in state.events)
    return m
