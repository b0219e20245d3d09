"""The optuna agent's study in a real PostgreSQL (database ``test`` on 127.0.0.1:5432, or
``KILN_TEST_OPTUNA_URL``): created in its own schema, and resumed by a new agent object (a
restarted runner) with its trials and the pending trial's result."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import optuna
import pytest
import sqlalchemy
from optuna.trial import TrialState

from kiln.agent_runner.agents.optuna_search import OptunaAgent, study_name
from kiln.agent_runner.space import CandidateSpace, Dimension
from kiln.domain.candidate import REFERENCE_CANDIDATE

from ..unit.agent_board import claim, result, view_of

pytestmark = pytest.mark.integration

URL = os.environ.get("KILN_TEST_OPTUNA_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
SPACE = CandidateSpace(
    [
        Dimension("threads", (None, "1", "2")),
        Dimension("op:attention", (None, "sdpa")),
        Dimension("op:mlp", (None, "fused_gate_up")),
    ]
)


@pytest.fixture
def schema() -> Iterator[str]:
    engine = sqlalchemy.create_engine(URL)
    try:
        with engine.connect() as conn:
            conn.execute(sqlalchemy.text("SELECT 1"))
    except sqlalchemy.exc.OperationalError as exc:
        pytest.skip(f"no PostgreSQL at {URL}: {exc}")
    name = f"optuna_t{uuid.uuid4().hex[:10]}"
    try:
        yield name
    finally:
        with engine.begin() as conn:
            conn.execute(sqlalchemy.text(f'DROP SCHEMA IF EXISTS "{name}" CASCADE'))
        engine.dispose()


def _tables(schema: str) -> set[str]:
    engine = sqlalchemy.create_engine(URL)
    try:
        return set(sqlalchemy.inspect(engine).get_table_names(schema=schema))
    finally:
        engine.dispose()


def test_study_lives_in_postgres_and_resumes(schema: str) -> None:
    cid = f"c{uuid.uuid4().hex[:8]}"
    first = OptunaAgent("optuna", 11, storage=URL, schema=schema)
    view = view_of(result(REFERENCE_CANDIDATE, 100.0, agent="baseline"), compilation_id=cid)
    p = first.propose(view, SPACE)
    assert p is not None
    first.tried.add(p.candidate.id)
    view.take(claim(p.candidate, seq=2))
    # optuna's tables, its alembic_version included, are in the agent's schema
    assert {"studies", "trials", "alembic_version"} <= _tables(schema)

    # the runner restarts: a new agent, the same study (load_if_exists); the pending trial's
    # result shows on the board afterwards and is told to the trial asked before the restart
    view.feed.add(result(p.candidate, 180.0))
    second = OptunaAgent("optuna", 11, storage=URL, schema=schema)
    q = second.propose(view, SPACE)
    assert q is not None and q.candidate.id not in {p.candidate.id, REFERENCE_CANDIDATE.id}

    storage = optuna.storages.RDBStorage(
        URL, engine_kwargs={"connect_args": {"options": f"-csearch_path={schema}"}}
    )
    study = optuna.load_study(study_name=study_name(cid, "optuna"), storage=storage)
    by_candidate = {t.user_attrs.get("candidate_id"): t for t in study.trials}
    asked = by_candidate[p.candidate.id]
    assert asked.state == TrialState.COMPLETE and asked.value == 180.0
    assert by_candidate[REFERENCE_CANDIDATE.id].value == 100.0  # the baseline, learnt once
    assert (
        sum(t.user_attrs.get("candidate_id") == REFERENCE_CANDIDATE.id for t in study.trials) == 1
    )
    assert by_candidate[q.candidate.id].state == TrialState.RUNNING  # asked by the new agent
