"""Resolving a Submit's warm start and incumbent from the ledger, once, at submission; the result
is recorded on ``CompilationSubmitted`` (``seeds``, ``incumbent``) so a restart or a replay needs
nothing else (docs/design/warm_start.md).

Sources are read as the runner (a service), then filtered to what the caller may read: its own
team's compilations unless cross-team reads are on (``scope`` None). A compilation the caller
may not read answers NOT_FOUND exactly as an unknown one does. ``nearby`` seeds come from the
caller's own team only, whatever the read scope: the best candidate of each of its compilations
of the same model config and dtype on the same hardware (most recent first, at most
:data:`MAX_NEARBY`).

Seeds, in order, without repeats and never the reference: the winner (last
``BestCandidateImproved``) of each named compilation, the nearby winners, then the named
compilations' other correct search-tier measurements by their speedup over their own baseline
(at most :data:`MAX_MEASURED_PER_SOURCE` each, marked ``lost_on_full_tier`` when their
compilation confirmed them on the full tier and they did not become its best);
:data:`MAX_SEEDS` in all. A seed's
``tokens_per_s`` and ``speedup`` are the source's numbers at the source's operating point.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from kiln.agent_runner import records
from kiln.agent_runner.experiment import domain_event, event_data
from kiln.agent_runner.ledger_access import LedgerPool
from kiln.common.errors import InvalidArgument, NotFound, quote
from kiln.domain.candidate import REFERENCE_CANDIDATE
from kiln.domain.compilation import EXPERIMENT_TYPES
from kiln.domain.experiment import ExperimentRecord, fold_experiment
from kiln.domain.judging import SEARCH_TIER
from kiln.events.warm import Incumbent, Seed, WarmStartRequest
from kiln.v1 import compiler_pb2, ledger_pb2

MAX_SOURCES = 16
"""Compilation ids one warm start may name."""
MAX_NEARBY = 8
MAX_MEASURED_PER_SOURCE = 24
MAX_SEEDS = 64
BEST = "BestCandidateImproved"
_CANDIDATE_ID = re.compile(r"^[0-9a-f]{24}$")


def check_candidate_id(value: str, field: str = "incumbent_candidate_id") -> str:
    """``value`` if it can be a candidate id (24 lower-case hex digits); InvalidArgument else."""
    if not _CANDIDATE_ID.match(value):
        raise InvalidArgument(
            f"{field} {quote(value, 80)} is not a candidate id (24 lower-case hex digits of the "
            "SHA-256 of the candidate's content)"
        )
    return value


def _visible(event: ledger_pb2.RecordedEvent, scope: str | None) -> bool:
    return scope is None or event.metadata.team == scope


async def _stream(ledger: LedgerPool, stream: str) -> list[ledger_pb2.RecordedEvent]:
    try:
        return await ledger.system.read_stream(stream)
    except NotFound:
        return []


async def _compilation(
    ledger: LedgerPool, cid: str, scope: str | None
) -> list[ledger_pb2.RecordedEvent]:
    """The stream of a compilation the caller may read; NotFound (as unknown) otherwise."""
    records.check_compilation_id(cid)
    events = await _stream(ledger, records.compilation_stream(cid))
    if not events or not _visible(events[0], scope):
        raise NotFound(f"no compilation {cid!r} (warm_start.compilation_ids)")
    return events


async def _experiment(ledger: LedgerPool, experiment_id: str) -> ExperimentRecord | None:
    records_: dict[str, ExperimentRecord] = {}
    for event in await _stream(ledger, records.experiment_stream(experiment_id)):
        fold_experiment(records_, domain_event(event))
    return records_.get(experiment_id)


def _last(events: list[ledger_pb2.RecordedEvent], event_type: str) -> dict[str, Any] | None:
    found = [event_data(e) for e in events if e.type == event_type]
    return found[-1] if found else None


async def _winner(
    ledger: LedgerPool, cid: str, events: list[ledger_pb2.RecordedEvent], source: str
) -> Seed | None:
    """The compilation's last ``BestCandidateImproved`` as a seed, or None."""
    best = _last(events, BEST)
    if best is None:
        return None
    rec = await _experiment(ledger, str(best["experiment_id"]))
    if rec is None or rec.requested.candidate.is_reference:
        return None
    return Seed(
        candidate_id=rec.requested.candidate.id,
        candidate=rec.requested.candidate.canonical(),
        source=source,  # type: ignore[arg-type]
        compilation_id=cid,
        experiment_id=rec.requested.experiment_id,
        workload_key=str(best.get("workload_key", "")),
        tier="full",
        tokens_per_s=float(best.get("tokens_per_s", 0.0)),
        speedup=float(best.get("speedup", 0.0)),
    )


async def _measured(
    ledger: LedgerPool, cid: str, events: list[ledger_pb2.RecordedEvent]
) -> list[Seed]:
    """The compilation's correct search-tier measurements (not the reference), fastest first."""
    base = _last(events, "BaselineMeasured")
    base_tps = float(base["tokens_per_s"]) if base else 0.0
    exps: dict[str, ExperimentRecord] = {}
    async for event in ledger.system.read_all(events[0].position - 1, types=EXPERIMENT_TYPES):
        if event_data(event).get("compilation_id") == cid:
            fold_experiment(exps, domain_event(event))
    good = [
        r
        for r in exps.values()
        if r.completed is not None
        and r.completed.ok
        and r.requested.tier == SEARCH_TIER
        and not r.requested.baseline
        and not r.requested.candidate.is_reference
        and r.completed.result.tokens_per_s > 0
    ]
    good.sort(key=lambda r: -r.completed.result.tokens_per_s if r.completed else 0.0)
    best = {str(event_data(e).get("candidate_id")) for e in events if e.type == BEST}
    lost = {
        r.requested.candidate.id
        for r in exps.values()
        if r.requested.tier != SEARCH_TIER and not r.requested.baseline and r.completed
    } - best
    workload_key = str(event_data(events[0]).get("workload_key", ""))
    return [
        Seed(
            candidate_id=r.requested.candidate.id,
            candidate=r.requested.candidate.canonical(),
            source="measured",
            compilation_id=cid,
            experiment_id=r.requested.experiment_id,
            workload_key=workload_key,
            tier="fast",
            tokens_per_s=r.completed.result.tokens_per_s,
            speedup=r.completed.result.tokens_per_s / base_tps if base_tps > 0 else 0.0,
            lost_on_full_tier=r.requested.candidate.id in lost,
        )
        for r in good[:MAX_MEASURED_PER_SOURCE]
        if r.completed is not None
    ]


def _model_of(workload: dict[str, Any]) -> tuple[Any, str]:
    model = workload.get("model") or {}
    try:
        config = json.loads(model.get("config_json") or "{}")
    except ValueError:
        config = None
    return config, str(model.get("dtype", ""))


async def _nearby(
    ledger: LedgerPool, team: str, workload: dict[str, Any], hardware: str, skip: set[str]
) -> list[Seed]:
    """The winners of the team's compilations of the same model and dtype on ``hardware``."""
    model = _model_of(workload)
    name = str((workload.get("model") or {}).get("name", ""))
    rows, _ = await ledger.query_all(
        "compilations", {"team": team, "hardware": hardware, "model_name": name}
    )
    rows = [r for r in rows if r.get("best_candidate_id") and r["compilation_id"] not in skip]
    rows.sort(key=lambda r: str(r.get("updated_at") or ""), reverse=True)
    seeds: list[Seed] = []
    for row in rows:
        if len(seeds) >= MAX_NEARBY:
            break
        cid = str(row["compilation_id"])
        events = await _stream(ledger, records.compilation_stream(cid))
        if not events or events[0].metadata.team != team:
            continue
        if _model_of(dict(event_data(events[0]).get("workload") or {})) != model:
            continue
        seed = await _winner(ledger, cid, events, "nearby")
        if seed is not None:
            seeds.append(seed)
    return seeds


async def resolve_warm_start(
    ledger: LedgerPool,
    request: compiler_pb2.WarmStart,
    *,
    team: str,
    scope: str | None,
    workload: dict[str, Any],
    hardware: str,
) -> tuple[WarmStartRequest | None, list[Seed]]:
    """The warm start as submitted and its seeds (see the module docs); (None, []) for none.

    Raises:
        InvalidArgument: a malformed compilation id, or more than :data:`MAX_SOURCES`.
        NotFound: a compilation that does not exist or that the caller may not read.
    """
    ids = list(dict.fromkeys(request.compilation_ids))
    if not ids and not request.nearby:
        return None, []
    if len(ids) > MAX_SOURCES:
        raise InvalidArgument(
            f"warm_start names {len(ids)} compilations; at most {MAX_SOURCES} may seed one"
        )
    for cid in ids:
        try:
            records.check_compilation_id(cid)
        except InvalidArgument as exc:
            raise InvalidArgument(f"warm_start.compilation_ids: {exc.message}") from None
    streams = [(cid, await _compilation(ledger, cid, scope)) for cid in ids]
    winners = [await _winner(ledger, cid, events, "winner") for cid, events in streams]
    nearby = await _nearby(ledger, team, workload, hardware, set(ids)) if request.nearby else []
    measured: list[Seed] = []
    for cid, events in streams:
        measured.extend(await _measured(ledger, cid, events))
    measured.sort(key=lambda s: -s.speedup)
    seeds = dedupe([s for s in winners if s is not None] + nearby + measured)
    return WarmStartRequest(compilation_ids=ids, nearby=request.nearby), seeds[:MAX_SEEDS]


def dedupe(seeds: Sequence[Seed]) -> list[Seed]:
    """``seeds`` without the reference and without a candidate's later repeats."""
    seen, out = {REFERENCE_CANDIDATE.id}, []
    for seed in seeds:
        if seed.candidate_id not in seen:
            seen.add(seed.candidate_id)
            out.append(seed)
    return out


async def resolve_incumbent(
    ledger: LedgerPool, candidate_id: str, *, scope: str | None
) -> Incumbent | None:
    """The incumbent's content from an experiment of the caller's readable compilations that
    measured it (a correct full-tier one preferred); None for "".

    Raises:
        InvalidArgument: not a candidate id. NotFound: no readable experiment measured it.
    """
    if not candidate_id:
        return None
    check_candidate_id(candidate_id)
    rows, _ = await ledger.query_all("experiments", {"candidate_id": candidate_id})
    rows.sort(key=lambda r: (r.get("tier") != "full", r.get("status") != "ok"))
    teams: dict[str, bool] = {}
    for row in rows:
        cid = str(row["compilation_id"])
        if cid not in teams:
            events = await _stream(ledger, records.compilation_stream(cid))
            teams[cid] = bool(events) and _visible(events[0], scope)
        if not teams[cid]:
            continue
        rec = await _experiment(ledger, str(row["experiment_id"]))
        if rec is None or rec.requested.candidate.id != candidate_id:
            continue
        return Incumbent(
            candidate_id=candidate_id,
            candidate=rec.requested.candidate.canonical(),
            compilation_id=cid,
            experiment_id=rec.requested.experiment_id,
        )
    raise NotFound(
        f"no candidate {candidate_id!r} in this team's history (incumbent_candidate_id): no "
        "experiment of its compilations measured it"
    )
