"""Infrastructure trouble is told apart from answers: the ledger maps an unreachable database to
UNAVAILABLE (a real refused connection, not a constructed one, where it can), the agent runner
waits out outages and nothing else, and the engine pool takes a work item's fields from the
ledger, refusing a body that disagrees."""

from __future__ import annotations

import asyncio
from typing import Any

import nats.errors
import psycopg
import pytest
from sqlalchemy import exc as sa_exc
from sqlalchemy import text

from kiln.agent_runner.outage import is_outage, ride_out
from kiln.common.errors import (
    Aborted,
    DeadlineExceeded,
    InvalidArgument,
    PermissionDenied,
    Unavailable,
)
from kiln.domain.candidate import Candidate
from kiln.embedded.process import free_port
from kiln.engine_pool.provenance import Forged, ledger_work
from kiln.ledger.db import create_engine
from kiln.ledger.unavailable import database_unavailable, unavailable_on_database_errors

from .engine_testing import work


# ------------------------------------------------------------------------------ the ledger
async def test_a_refused_connection_is_unavailable() -> None:
    engine = create_engine(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/kiln")
    try:
        with pytest.raises(sa_exc.OperationalError) as info:
            async with engine.connect() as conn:
                await conn.execute(text("SELECT 1"))
    finally:
        await engine.dispose()
    mapped = database_unavailable(info.value)
    assert isinstance(mapped, Unavailable)
    assert mapped.message.startswith("the ledger's database is unavailable (")
    assert mapped.message.endswith("); retry later") and "\n" not in mapped.message


def test_shutdown_and_lost_connections_are_unavailable() -> None:
    shutting_down = psycopg.errors.AdminShutdown("terminating connection due to administrator")
    wrapped = sa_exc.OperationalError("SELECT 1", {}, shutting_down)
    assert isinstance(database_unavailable(wrapped), Unavailable)
    assert isinstance(database_unavailable(psycopg.OperationalError("server closed")), Unavailable)
    invalidated = sa_exc.DBAPIError("SELECT 1", {}, Exception("gone"), connection_invalidated=True)
    assert isinstance(database_unavailable(invalidated), Unavailable)
    assert isinstance(database_unavailable(ConnectionResetError("reset by peer")), Unavailable)


def test_answers_of_the_database_are_not_unavailable() -> None:
    unique = sa_exc.IntegrityError("INSERT", {}, psycopg.errors.UniqueViolation("duplicate key"))
    assert database_unavailable(unique) is None
    syntax = sa_exc.ProgrammingError("SELEC", {}, psycopg.errors.SyntaxError("syntax error"))
    assert database_unavailable(syntax) is None
    assert database_unavailable(ValueError("a bug")) is None


async def test_the_servicer_maps_unary_and_streaming_methods() -> None:
    @unavailable_on_database_errors
    class Servicer:
        async def Unary(self) -> None:
            raise psycopg.OperationalError("connection refused")

        async def Stream(self) -> Any:
            yield 1
            raise psycopg.OperationalError("connection reset")

        async def Bug(self) -> None:
            raise KeyError("x")

    with pytest.raises(Unavailable, match="connection refused"):
        await Servicer().Unary()
    got = []
    with pytest.raises(Unavailable, match="connection reset"):
        async for item in Servicer().Stream():
            got.append(item)
    assert got == [1]
    with pytest.raises(KeyError):
        await Servicer().Bug()


# ---------------------------------------------------------------- the agent runner waits
@pytest.mark.parametrize(
    "exc",
    [
        Unavailable("ledger down"),
        DeadlineExceeded("no answer"),
        nats.errors.TimeoutError(),
        nats.errors.NoRespondersError(),
        ConnectionRefusedError(),
    ],
)
def test_outages(exc: Exception) -> None:
    assert is_outage(exc)


@pytest.mark.parametrize(
    "exc",
    [
        Aborted("conflict"),
        InvalidArgument("bad"),
        PermissionDenied("no"),
        nats.errors.ConnectionClosedError(),  # closed by us: shutting down
        ValueError("a bug"),
    ],
)
def test_answers(exc: Exception) -> None:
    assert not is_outage(exc)


async def test_ride_out_waits_for_an_answer_and_passes_refusals_on() -> None:
    calls: list[int] = []

    async def flaky() -> str:
        calls.append(1)
        if len(calls) < 4:
            raise Unavailable("the ledger's database is unavailable")
        return "ok"

    assert await asyncio.wait_for(ride_out(flaky, what="test"), 30) == "ok"
    assert len(calls) == 4

    async def refused() -> str:
        calls.append(1)
        raise Aborted("wrong expected version")

    calls.clear()
    with pytest.raises(Aborted):
        await ride_out(refused, what="test")
    assert len(calls) == 1


# ------------------------------------------------------------ the ledger's candidate
def _requested(w: Any, **changes: Any) -> dict[str, Any]:
    payload = {
        "compilation_id": w.compilation_id,
        "candidate_id": Candidate.from_canonical(w.candidate).id,
        "candidate": w.candidate,
        "tier": w.tier,
        "agent": "test",
        "profile": w.profile,
        "baseline": w.baseline,
    }
    payload.update(changes)
    return payload


def test_work_that_matches_the_ledger_is_taken_from_it() -> None:
    w = work(Candidate.make({"attention": "sdpa"}), team="search")
    old_event = _requested(w)
    del old_event["profile"], old_event["baseline"]  # written before those fields existed
    assert ledger_work(w, old_event, "search") == w
    assert ledger_work(w, _requested(w), "") == w  # the ledger did not record a team


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"candidate": Candidate.make({"attention": "naive"}).canonical()}, "candidate"),
        ({"tier": "full"}, "tier"),
        ({"compilation_id": "another"}, "compilation_id"),
        ({"profile": True}, "profile"),
        ({"baseline": "hf_eager"}, "baseline"),
    ],
)
def test_a_body_that_disagrees_with_the_ledger_is_forged(
    change: dict[str, Any], field: str
) -> None:
    w = work(Candidate.make({"attention": "sdpa"}))
    with pytest.raises(Forged) as info:
        ledger_work(w, _requested(w, **change), "search")
    assert info.value.message == (
        f"work message for experiment {w.experiment_id} differs from the ledger's "
        f"ExperimentRequested in {field}"
    )


def test_a_body_for_another_team_is_forged() -> None:
    w = work(Candidate(), team="mallory")
    with pytest.raises(Forged, match=r"in team$"):
        ledger_work(w, _requested(w), "search")
