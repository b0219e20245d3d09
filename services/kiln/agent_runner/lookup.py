"""Reading one compilation back from the ledger (Get, Cancel, Watch)."""

from __future__ import annotations

from kiln.agent_runner import records
from kiln.agent_runner.compilation import CompilationRunner
from kiln.agent_runner.ledger_access import LedgerPool
from kiln.agent_runner.snapshot import EXPERIMENT_TYPES, Snapshot
from kiln.common.errors import NotFound
from kiln.v1 import compiler_pb2, ledger_pb2


async def compilation_events(
    ledger: LedgerPool, compilation_id: str
) -> list[ledger_pb2.RecordedEvent]:
    """The events of ``compilation-<id>``.

    Raises:
        InvalidArgument: a malformed compilation id.
        NotFound: no such compilation.
    """
    records.check_compilation_id(compilation_id)
    try:
        return await ledger.system.read_stream(records.compilation_stream(compilation_id))
    except NotFound:
        raise NotFound(f"no compilation {compilation_id!r}") from None


async def compilation_snapshot(
    ledger: LedgerPool, compilation_id: str, runner: CompilationRunner | None = None
) -> compiler_pb2.Compilation:
    """The compilation now: its stream folded; the per-agent usage from its experiments'
    events (the ledger's global log after its submission); the best candidate's recipe and
    measurement, and its full-tier reference's measurement, from their experiments' streams;
    the counters from the live runner when it runs in this process, else from the compilations
    projection (which may lag by a moment).

    Raises:
        InvalidArgument, NotFound: as :func:`compilation_events`.
    """
    snap = Snapshot(compilation_id)
    events = await compilation_events(ledger, compilation_id)
    for event in events:
        snap.apply(event)
    async for event in ledger.system.read_all(events[0].position - 1, types=EXPERIMENT_TYPES):
        if snap.belongs(event):  # per-agent usage (kiln.agent_runner.usage)
            snap.count_usage(event)
    best = snap.message.best if snap.message.HasField("best") else None
    wanted = {best.experiment_id, best.reference_experiment_id} if best else set()
    if snap.message.HasField("baseline"):
        wanted.add(snap.baseline_experiment_id)
    for eid in sorted(e for e in wanted if e):
        try:
            for event in await ledger.system.read_stream(records.experiment_stream(eid)):
                snap.learn(event)
        except NotFound:
            continue
    m = snap.message
    if runner is not None and not runner.finished.is_set():
        live = runner.state.compilation  # the same fold as the projection, without its lag
        m.experiments_done, m.failures = live.experiments_done, live.failures
    else:
        rows = await ledger.system.query("compilations", {"compilation_id": compilation_id})
        if rows:
            m.experiments_done = int(rows[0].get("experiments_done") or 0)
            m.failures = int(rows[0].get("failures") or 0)
    return m
