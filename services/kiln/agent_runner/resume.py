"""After a restart: find the open compilations and rebuild what their runners need.

Open compilations are those the ledger's compilations projection shows as pending or running
(any team), corrected by a scan of ``CompilationSubmitted``/``CompilationEnded`` events after the
projection's checkpoint (the projection may lag the ledger by a moment). Each one's state is
folded from its stream; its experiments come from one scan of ``ExperimentRequested`` /
``ExperimentCompleted`` events from the earliest open compilation's submission on, which, unlike
the experiments projection, cannot miss an experiment requested just before the stop.

The rebuilt runner (:class:`kiln.agent_runner.compilation.CompilationRunner` with
``resumed=True``) re-publishes work for experiments requested but not completed (same
``Nats-Msg-Id``: harmless), measures candidates claimed on the board but never requested,
judges the confirmations completed before the stop again (a ``BestCandidateImproved`` lost in
the stop is recorded; one recorded is not repeated), finishes a confirmation cut by the stop
(its full-tier experiments in flight, then its candidate if only the reference was requested),
starts the confirmation that is due (:func:`kiln.agent_runner.judge.confirmation_due`, from
these experiments), starts its agents (the board's claims keep them off what was taken; the
search results completed before the stop are in their result feed from the start,
:mod:`kiln.agent_runner.results`), and keeps the original wall-clock deadline (it may be spent
already: then it ends at once).
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
    """Ids of compilations that were submitted and have not ended (every team).

    Raises:
        KilnError: the ledger failed (e.g. Unavailable).
    """
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
    """The states of the compilations ``ids`` that have not ended, with their experiments.

    Raises:
        KilnError: the ledger failed.
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
    """(candidate, claimant) of claim posts whose candidate was never requested (a stop between
    the claim and the request); the recipe comes from the claim's body (claims without one, or
    whose recipe does not hash to the claimed id, are skipped)."""
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
