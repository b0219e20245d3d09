"""The authorization policy: one table of who may call which RPC, which service may append which
events to which streams, and whether teams read each other's records (docs/design/security.md,
"Authorization").

:data:`DEFAULT_RPC` and :data:`DEFAULT_APPEND` are the defaults; ``KILN_CROSS_TEAM_READS`` sets
``cross_team_reads``; a TOML file (``KILN_POLICY_FILE``, :class:`PolicyFile`) may override each::

    cross_team_reads = true                       # teams read every team's records (audit)
    [rpc]                                         # merged over DEFAULT_RPC, method by method
    "kiln.v1.Deployments/Create": ("team",),
    "kiln.v1.Deployments/ObserveTraffic": ("team",),
    "kiln.v1.Deployments/Rollback": ("team", "operator"),
    "kiln.v1.Deployments/Get": ANY,
    "kiln.v1.Deployments/List": ANY,
    "kiln.v1.Deployments/Watch": ANY,
    "kiln.v1.EnginePool/RunExperiment" = ["service", "operator", "team"]
    [[append]]                                    # when given, replaces DEFAULT_APPEND whole
    service = "engine-pool"
    category = "experiment"
    types = ["ExperimentCompleted"]

With TLS off there is no principal and nothing is checked. A refusal is PERMISSION_DENIED
naming the principal, the method or event, and the rule.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kiln.common.errors import InvalidArgument, PermissionDenied
from kiln.common.identity import PRINCIPAL_KINDS, CallIdentity, PrincipalKind
from kiln.common.settings import KilnSettings

ANY: tuple[PrincipalKind, ...] = PRINCIPAL_KINDS

DEFAULT_RPC: dict[str, tuple[PrincipalKind, ...]] = {
    "kiln.v1.Ledger/Append": ("service",),
    "kiln.v1.Ledger/ReadStream": ANY,
    "kiln.v1.Ledger/ReadAll": ANY,
    "kiln.v1.Ledger/Query": ANY,
    "kiln.v1.Ledger/Replay": ("operator",),
    "kiln.v1.Compiler/Submit": ("team",),
    "kiln.v1.Compiler/Cancel": ("team", "operator"),
    "kiln.v1.Compiler/Get": ANY,
    "kiln.v1.Compiler/Watch": ANY,
    "kiln.v1.Compiler/List": ANY,
    "kiln.v1.Deployments/Create": ("team",),
    "kiln.v1.Deployments/ObserveTraffic": ("team",),
    "kiln.v1.Deployments/Rollback": ("team", "operator"),
    "kiln.v1.Deployments/Get": ANY,
    "kiln.v1.Deployments/List": ANY,
    "kiln.v1.Deployments/Watch": ANY,
    "kiln.v1.EnginePool/RunExperiment": ("service", "operator"),
    "kiln.v1.EnginePool/ListEngines": ANY,
    "kiln.v1.CostModel/Plan": ANY,
    "kiln.v1.CostModel/Explain": ANY,
}
"""RPC (``package.Service/Method``) -> the principal kinds that may call it. A method not in
the table is refused to every principal. Reads by a team are scoped further
(:meth:`Policy.read_scope`)."""


class AppendRule(BaseModel):
    """``service`` may append events of ``types`` to ``category`` streams; with ``statuses``,
    only ``ExperimentCompleted`` events whose status is one of them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    service: str = Field(min_length=1)
    category: str = Field(min_length=1)
    types: tuple[str, ...] = Field(min_length=1)
    statuses: tuple[str, ...] | None = None

    @field_validator("types")
    @classmethod
    def _known_types(cls, types: tuple[str, ...]) -> tuple[str, ...]:
        from kiln.events.registry import event_categories

        known = event_categories()
        unknown = [t for t in types if t not in known]
        if unknown:
            raise ValueError(f"unknown event types {unknown}; known: {sorted(known)}")
        return types

    def allows(self, service: str, category: str, event_type: str, status: str | None) -> bool:
        """Whether this rule lets ``service`` append ``event_type`` (of ``status``)."""
        if (self.service, self.category) != (service, category) or event_type not in self.types:
            return False
        return self.statuses is None or status in self.statuses


_RUNNER_COMPILATION = (
    "CompilationSubmitted",
    "CompilationPlanned",
    "BaselineMeasured",
    "BaselineCompared",
    "BestCandidateImproved",
    "TierAgreement",
    "MeasurementReused",
    "IncumbentCompared",
    "CompilationCancelRequested",
    "CompilationEnded",
)

_RUNNER_DEPLOYMENT = (
    "DeploymentCreated",
    "RecompilationStarted",
    "TrafficWindowObserved",
    "DriftDetected",
    "CandidatePromoted",
    "PromotionDeclined",
    "CandidateRolledBack",
)

DEFAULT_APPEND: tuple[AppendRule, ...] = (
    # The runner records compilations (kiln.agent_runner.records: service, compilation, judge)
    # and requests experiments (dispatcher) ...
    AppendRule(service="agent-runner", category="compilation", types=_RUNNER_COMPILATION),
    AppendRule(service="agent-runner", category="experiment", types=("ExperimentRequested",)),
    # ... and closes those no engine answered (records.experiment_unanswered): never a result.
    AppendRule(
        service="agent-runner",
        category="experiment",
        types=("ExperimentCompleted",),
        statuses=("timed_out", "cancelled"),
    ),
    # The runner records deployments (kiln.agent_runner.deployments: controller and servicer).
    AppendRule(service="agent-runner", category="deployment", types=_RUNNER_DEPLOYMENT),
    # Measurements come from the engine pool only (engine_pool.delivery).
    AppendRule(service="engine-pool", category="experiment", types=("ExperimentCompleted",)),
    # ... and so do the cost model's microbenchmarks (engine_pool.microbench_service).
    AppendRule(service="engine-pool", category="microbench", types=("MicrobenchmarkMeasured",)),
)
"""Who appends what today; the ledger and the cost model append nothing."""


class PolicyFile(BaseModel):
    """The schema of ``KILN_POLICY_FILE`` (TOML); every key optional (see the module docs)."""

    model_config = ConfigDict(extra="forbid")

    cross_team_reads: bool | None = None
    rpc: dict[str, tuple[PrincipalKind, ...]] = Field(default_factory=dict)
    append: tuple[AppendRule, ...] | None = None

    @field_validator("rpc")
    @classmethod
    def _known_methods(
        cls, rpc: dict[str, tuple[PrincipalKind, ...]]
    ) -> dict[str, tuple[PrincipalKind, ...]]:
        bad = [m for m in rpc if m.count("/") != 1 or m.startswith("/")]
        if bad:
            raise ValueError(f"RPC names must read 'package.Service/Method', got {bad}")
        return rpc


class PolicyError(ValueError):
    """A policy file that cannot be read or does not validate; one line naming the file."""


class Policy(BaseModel):
    """The policy in force (see the module docs)."""

    model_config = ConfigDict(frozen=True)

    cross_team_reads: bool = False
    rpc: dict[str, tuple[PrincipalKind, ...]] = Field(default_factory=lambda: dict(DEFAULT_RPC))
    append: tuple[AppendRule, ...] = DEFAULT_APPEND

    def check_call(self, method: str, call: CallIdentity) -> None:
        """Raise PermissionDenied unless ``call``'s principal may call ``method``
        (``/package.Service/Method``)."""
        principal = call.principal
        if principal is None:
            return
        name = method.lstrip("/")
        kinds = self.rpc.get(name)
        if kinds is None:
            raise PermissionDenied(f"{principal} may not call {name}: the policy has no rule")
        if principal.kind not in kinds:
            raise PermissionDenied(
                f"{principal} may not call {name}: the policy allows only "
                f"{', '.join(kinds) or 'no'} principals (rule rpc[{name!r}])"
            )

    def check_append(
        self, call: CallIdentity, stream_id: str, events: Sequence[tuple[str, bytes | str]]
    ) -> None:
        """Raise PermissionDenied unless ``call``'s principal may append each (type, payload) of
        ``events`` to ``stream_id`` (an unregistered type is left to the store, which refuses
        it); InvalidArgument when an ``ExperimentCompleted`` payload is not a JSON object."""
        principal = call.principal
        if principal is None:
            return
        if principal.kind != "service":
            raise PermissionDenied(
                f"{principal} may not append to {stream_id[:140]!r}: only service principals "
                "append to the ledger (teams act through the Compiler API)"
            )
        from kiln.events.registry import registered_types

        known = registered_types()
        category = stream_id.partition("-")[0]
        for event_type, data in events:
            if event_type not in known:
                continue  # the store refuses it (INVALID_ARGUMENT, naming the known types)
            status = _status(event_type, data) if event_type == "ExperimentCompleted" else None
            if not any(r.allows(principal.name, category, event_type, status) for r in self.append):
                what = f"{event_type} (status {status!r})" if status else event_type
                raise PermissionDenied(
                    f"{principal} may not append {what[:140]} to {category!r} streams: no append "
                    f"rule of the policy lets service {principal.name!r} do so"
                )

    def read_scope(self, call: CallIdentity) -> str | None:
        """The one team whose records ``call`` may read, or None for every team's (services,
        operators, no principal, or cross-team reads on)."""
        principal = call.principal
        if principal is None or principal.kind != "team" or self.cross_team_reads:
            return None
        return principal.name


def _status(event_type: str, data: bytes | str) -> str | None:
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise InvalidArgument(f"{event_type} payload is not valid JSON") from None
    if not isinstance(obj, dict):
        raise InvalidArgument(f"{event_type} payload must be a JSON object")
    status = obj.get("status")
    return status if isinstance(status, str) else None


def load_policy(path: Path | None, cross_team_reads: bool = False) -> Policy:
    """The defaults with ``cross_team_reads``, then the file at ``path`` (if any) over them.

    Raises:
        PolicyError: the file is unreadable, not TOML, or breaks :class:`PolicyFile`.
    """
    policy = Policy(cross_team_reads=cross_team_reads)
    if path is None:
        return policy
    try:
        raw: dict[str, Any] = tomllib.loads(path.read_text())
        given = PolicyFile.model_validate(raw)
    except OSError as exc:
        raise PolicyError(f"policy file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"policy file {path}: not TOML: {exc}") from None
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in exc.errors()
        )
        raise PolicyError(f"policy file {path}: {problems}") from None
    update: dict[str, Any] = {"rpc": {**policy.rpc, **given.rpc}}
    if given.cross_team_reads is not None:
        update["cross_team_reads"] = given.cross_team_reads
    if given.append is not None:
        update["append"] = given.append
    return policy.model_copy(update=update)


_CACHE: dict[tuple[str, int, bool], Policy] = {}


def policy_for(settings: KilnSettings) -> Policy:
    """:func:`load_policy` for ``settings``, read again when the file changes (by mtime)."""
    path = settings.policy_file
    try:
        stamp = path.stat().st_mtime_ns if path else 0
    except OSError:
        stamp = -1  # load_policy reports it
    key = (str(path or ""), stamp, settings.cross_team_reads)
    found = _CACHE.get(key)
    if found is None:
        found = _CACHE[key] = load_policy(path, settings.cross_team_reads)
    return found
