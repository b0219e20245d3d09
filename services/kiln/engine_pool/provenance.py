"""The ledger's experiment, not the message's: what a work item may ask for is what the runner
recorded in the experiment's ``ExperimentRequested``.

A work message is a pointer to that event plus what the ledger does not hold there (the
workload, the deadline). The pool measures the candidate, tier, compilation, profile and
baseline the ledger recorded, appends for the team that recorded it, and refuses a message
whose body says otherwise (:class:`Forged`): whoever could publish on a work subject could
otherwise have the engines run code the ledger never saw and record its result under a real
experiment (docs/design/security.md, "NATS").
"""

from __future__ import annotations

from typing import Any

from kiln.common.errors import PermissionDenied
from kiln.common.work import ExperimentWork

CHECKED = ("compilation_id", "tier", "candidate", "profile", "baseline")
"""Fields of the work body that must equal the ledger's ``ExperimentRequested``."""
DEFAULTS: dict[str, Any] = {"profile": False, "baseline": ""}
"""Values of fields that events written before them lack."""


class Forged(PermissionDenied):
    """A work message whose body disagrees with the ledger's record of its experiment."""


def ledger_work(work: ExperimentWork, requested: dict[str, Any], team: str) -> ExperimentWork:
    """``work`` with every field the ledger recorded taken from ``requested`` (the
    ``ExperimentRequested`` payload) and ``team`` (the team that appended it; "" = unknown).

    Raises:
        Forged: a field of :data:`CHECKED`, or the team, differs; the message names the
            fields (not their values: a forged body may be large or hostile).
    """
    recorded = {name: requested.get(name, DEFAULTS.get(name)) for name in CHECKED}
    differing = [name for name in CHECKED if getattr(work, name) != recorded[name]]
    if team and work.team != team:
        differing.append("team")
    if differing:
        raise Forged(
            f"work message for experiment {work.experiment_id} differs from the ledger's "
            f"ExperimentRequested in {', '.join(differing)}"
        )
    return work.model_copy(update={**recorded, **({"team": team} if team else {})})
