"""The artifact of a compilation's winner, from its events in the ledger.

The winner is the last ``BestCandidateImproved``, or a given candidate's correct full-tier
experiment. The candidate comes from its ``ExperimentRequested``, figures and versions from its
``ExperimentCompleted``, and the model, weights and operating point from the workload as the
engine pool derives its engines (this environment's ``KILN_ENGINE_*``), the recorded batch and
context winning. The artifact is signed with the deployment's key (:mod:`kiln.export.signing`).

Who wrote those events matters: a forged ``BestCandidateImproved`` or ``ExperimentCompleted``
would make its code module the artifact that ``load_optimized`` runs. Every event that decides
the winner passes :func:`decides_the_winner` first.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kiln.common.errors import InvalidArgument, NotFound
from kiln.common.identity import SPIFFE_PREFIX
from kiln.domain import streams
from kiln.domain.compilation import EXPERIMENT_TYPES, Compilation
from kiln.domain.experiment import Completed, ExperimentRecord, Requested, fold_experiment
from kiln.domain.judging import CONFIRM_TIER, speedup
from kiln.export.artifact import (
    ArtifactError,
    Manifest,
    Measured,
    MeasuredAt,
    WeightsSource,
    check_out_dir,
    write_artifact,
)
from kiln.ledger.convert import recorded_to_domain
from kiln.runtime.spec import EngineLimits, EngineSpec, engine_operating_point

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from kiln.ledger.client import LedgerClient
    from kiln.v1 import ledger_pb2


class ExportError(ValueError):
    """The compilation cannot be exported; the message says why."""


@dataclass(frozen=True)
class Winner:
    """A confirmed full-tier experiment: its request, its completion and its speedup."""

    requested: Requested
    completed: Completed
    speedup: float


WINNER_EVENT_TYPES = frozenset(
    {"BestCandidateImproved", "ExperimentRequested", "ExperimentCompleted"}
)
"""The events an export's winner, its candidate and its figures come from."""

SERVICE_PRINCIPAL_PREFIX = SPIFFE_PREFIX + "service/"
"""How a service identity's principal starts."""


def decides_the_winner(event: ledger_pb2.RecordedEvent) -> bool:
    """Whether ``event`` may count towards the exported winner: every event that is not one of
    :data:`WINNER_EVENT_TYPES`, and those appended by a service identity
    (``spiffe://kiln/service/...``, docs/design/security.md). An event with no recorded principal
    (appended before identities existed, or with ``KILN_TLS=off``) is taken as it is."""
    if event.type not in WINNER_EVENT_TYPES:
        return True
    principal = event.metadata.principal
    return not principal or principal.startswith(SERVICE_PRINCIPAL_PREFIX)


def compilation_of(events: list[ledger_pb2.RecordedEvent]) -> Compilation:
    """A compilation folded from its stream's events (those :func:`decides_the_winner` keeps);
    ValueError or KeyError on a broken stream."""
    if not events:
        raise ValueError("a compilation stream starts with CompilationSubmitted")
    compilation = Compilation.submitted(recorded_to_domain(events[0]))
    for event in events[1:]:
        if decides_the_winner(event):
            compilation.apply(recorded_to_domain(event))
    return compilation


def manifest_for(
    compilation: Compilation, winner: Winner, limits: EngineLimits
) -> tuple[Manifest, dict[str, object]]:
    """The manifest and model config of ``winner``; ExportError unless it measured correct with
    tokens/s > 0 and its workload builds.
    """
    from kiln.runtime.spec import SpecError

    result = winner.completed.result
    if not winner.completed.ok or result.tokens_per_s <= 0 or result.median_ms <= 0:
        raise ExportError(
            f"experiment {winner.requested.experiment_id} did not measure correct ({result.status})"
        )
    workload = compilation.workload
    try:
        spec = EngineSpec.from_workload(workload, result.tier, limits)
        derived = engine_operating_point(workload.get("traffic"), spec.model_config(), limits)
    except SpecError as exc:
        raise ExportError(f"the compilation's workload cannot be built: {exc}") from None
    candidate = winner.requested.candidate
    weights = (
        WeightsSource(kind="safetensors", path=spec.weights_dir)
        if spec.weights_dir
        else WeightsSource(kind="seeded_random", seed=spec.seed)
    )
    manifest = Manifest(
        model_name=spec.model_name,
        candidate_id=candidate.id,
        lossy=candidate.lossy,
        operating_point=MeasuredAt.from_point(
            # What the engine measured at when it says so (it may have fitted the batch to the
            # device), else what this host's engine settings derive from the workload.
            derived.point.as_measured(result.batch_size, result.context_len),
            layers=spec.layers,
            total_layers=spec.total_layers,
            dtype=result.environment.get("dtype") or spec.dtype,
            device=result.environment.get("device") or spec.device.split(":")[0],
            expert_zipf_exponent=spec.expert_zipf_exponent,
        ),
        weights=weights,
        measured=Measured(
            tokens_per_s=result.tokens_per_s,
            median_ms=result.median_ms,
            p10_ms=result.p10_ms,
            p90_ms=result.p90_ms,
            max_abs_error=result.max_abs_error,
            tier=result.tier,
            hardware=str((workload.get("hardware") or {}).get("name", "")),
            engine_id=result.engine_id,
            compilation_id=compilation.compilation_id,
            experiment_id=winner.requested.experiment_id,
            speedup=winner.speedup,
        ),
        environment=dict(result.environment),
    )
    return manifest, dict(spec.config)


async def _experiment(client: LedgerClient, experiment_id: str) -> tuple[Requested, Completed]:
    events = [
        recorded_to_domain(e)
        for e in await client.read_stream(streams.experiment_stream(experiment_id))
        if decides_the_winner(e)
    ]
    req = next((Requested.from_event(e) for e in events if e.type == "ExperimentRequested"), None)
    done = next((Completed.from_event(e) for e in events if e.type == "ExperimentCompleted"), None)
    if req is None or done is None:
        raise ExportError(f"experiment {experiment_id} has not completed")
    return req, done


async def find_winner(
    client: LedgerClient, compilation: Compilation, candidate_id: str | None
) -> Winner:
    """The best (``candidate_id`` None) or ``candidate_id``'s fastest correct full-tier
    experiment; ExportError when there is none.
    """
    cid = compilation.compilation_id
    if candidate_id is None:
        if compilation.best is None:
            raise ExportError(
                f"compilation {cid} has no confirmed best candidate yet "
                "(none beat the reference on the full tier)"
            )
        req, done = await _experiment(client, compilation.best.experiment_id)
        return Winner(req, done, compilation.best.speedup)
    experiments: dict[str, ExperimentRecord] = {}
    async for recorded in client.read_all(
        compilation.submitted_position - 1,
        types=EXPERIMENT_TYPES,
        stream_prefix=streams.EXPERIMENT_PREFIX,
    ):
        if not decides_the_winner(recorded):
            continue
        event = recorded_to_domain(recorded)
        if event.data.get("compilation_id") == cid:
            fold_experiment(experiments, event)
    found = [r for r in experiments.values() if r.requested.candidate.id == candidate_id]
    best: Winner | None = None
    for record in found:
        result = record.completed
        if record.requested.tier != CONFIRM_TIER or result is None or not result.ok:
            continue
        if best is None or result.result.tokens_per_s > best.completed.result.tokens_per_s:
            # over the reference measured last before it on the full tier, as the judge has it
            gain = speedup(experiments.values(), compilation.baseline, result)
            best = Winner(record.requested, result, gain or 0.0)
    if best is None:
        where = "measured" if found else "requested"
        raise ExportError(
            f"candidate {candidate_id} was not {where} correct on the full tier in compilation "
            f"{cid}"
        )
    return best


async def export_compilation(
    client: LedgerClient,
    compilation_id: str,
    out_dir: str | Path,
    *,
    key: Ed25519PrivateKey,
    candidate_id: str | None = None,
    limits: EngineLimits | None = None,
) -> tuple[Path, Manifest]:
    """Write the artifact of a compilation's winner into ``out_dir``, signed with ``key`` (the
    deployment's: :func:`kiln.export.signing.deployment_key`).

    Raises:
        ExportError: unknown compilation, no winner, or ``out_dir`` not empty.
        InvalidArgument: a malformed compilation id.
    """
    try:
        out = check_out_dir(out_dir)
    except ArtifactError as exc:
        raise ExportError(str(exc)) from None
    try:
        streams.check_id(compilation_id, "compilation_id")
    except streams.InvalidId as exc:
        raise InvalidArgument(str(exc)) from None
    try:
        events = await client.read_stream(streams.compilation_stream(compilation_id))
    except NotFound:
        raise ExportError(f"no compilation {compilation_id!r}") from None
    compilation = compilation_of(events)
    winner = await find_winner(client, compilation, candidate_id)
    manifest, config = manifest_for(compilation, winner, limits or EngineLimits())
    from kiln.export.signing import sign_artifact

    try:
        write_artifact(out, manifest, winner.requested.candidate, config)
        sign_artifact(out, key)
    except ArtifactError as exc:
        raise ExportError(str(exc)) from None
    return out, manifest
