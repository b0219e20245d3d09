"""After a restart: find the open compilations and rebuild what their runners need.

Open compilations come from the compilations projection, corrected by a scan of the events
after its checkpoint; each state is folded from its stream and its experiments from one scan of
experiment events (which cannot miss one requested just before the stop). The resumed runner
re-publishes unfinished work, measures orphan claims, re-judges completed confirmations,
finishes a cut confirmation and keeps the original deadline.
"""

from __future__ import annotations

from collections.abc import Iterable

from kiln.agent_runner import records
from kiln.agent_runner.experiment import event_data
from kiln.agent_runner.ledger_access import LedgerPool
from kiln.agent_runner.state import CompilationState
from kiln.board import BoardPost
from kiln.common.logging import get_logger
from kiln.domain.candidate import Candidate
from kiln.domain.compilation import OPEN_STATUSES

log = get_logger("kiln.agent_runner.resume")


async def open_compilation_ids(ledger: LedgerPool) -> list[str]:
    """Ids of compilations submitted and not ended (every team); KilnError when the ledger fails."""
    ids: set[str] = set()
    checkpoints = []
    for status in OPEN_STATUSES:
        rows, checkpoint = await ledger.query_all("compilations", {"status": str(status)})
        ids.update(str(r["compilation_id"]) for r in rows)
        checkpoints.append(checkpoint)
    async for event in ledger.system.read_all(
        min(checkpoints),
        types=["CompilationSubmitted", "CompilationEnded"],
        stream_prefix=records.COMPILATION_PREFIX,
    ):
        cid = records.stream_suffix(event.stream_id, records.COMPILATION_PREFIX)
        if cid is None:
            continue
        if event.type == "CompilationSubmitted":
            ids.add(cid)
        else:
            ids.discard(cid)
    return sorted(ids)


async def load_open_states(ledger: LedgerPool, ids: list[str]) -> list[CompilationState]:
    """The states, with experiments, of those of ``ids`` not ended; KilnError when the ledger
    fails.
    """
    states: dict[str, CompilationState] = {}
    for cid in ids:
        events = await ledger.system.read_stream(records.compilation_stream(cid))
        try:
            state = CompilationState.from_events(events)
        except (ValueError, KeyError, TypeError) as exc:
            log.error("cannot resume a malformed compilation", compilation=cid, error=str(exc))
            continue
        if not state.ended:
            states[cid] = state
    if not states:
        return []
    after = min(s.submitted_position for s in states.values()) - 1
    async for event in ledger.system.read_all(
        after,
        types=["ExperimentRequested", "ExperimentCompleted"],
        stream_prefix=records.EXPERIMENT_PREFIX,
    ):
        owner = states.get(str(event_data(event).get("compilation_id", "")))
        if owner is not None:
            owner.apply_experiment(event)
    return list(states.values())


def orphan_claims(claims: Iterable[BoardPost], requested: set[str]) -> list[tuple[Candidate, str]]:
    """(candidate, claimant) of claims never requested, the recipe from the claim's body (skipped
    when missing or not hashing to the claimed id).
    """
    out = []
    for post in claims:
        if post.kind != "claim" or post.candidate_id in requested:
            continue
        try:
            candidate = Candidate.from_canonical(post.body["candidate"])
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
        if candidate.id == post.candidate_id:
            out.append((candidate, post.agent))
    return out
