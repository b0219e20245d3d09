"""The optuna agent: TPE over the space (in memory here), seeded, never proposing a taken
point, learning from every result on the board."""

from __future__ import annotations

import optuna
import pytest
from optuna.trial import TrialState

from kiln.agent_runner.agents.optuna_search import (
    OptunaAgent,
    resolve_storage,
    study_name,
    sync_url,
)
from kiln.agent_runner.space import CandidateSpace, Dimension
from kiln.domain.candidate import REFERENCE_CANDIDATE

from .agent_board import claim, result, view_of

SPACE = CandidateSpace(
    [
        Dimension("threads", (None, "1", "2", "4")),
        Dimension("op:attention", (None, "sdpa")),
        Dimension("op:mlp", (None, "fused_gate_up")),
        Dimension("fused_decode", (None, "on")),
        Dimension("fused_decode.block_n", (None, "32", "64")),  # any Dimension, generically
    ]
)
DISTINCT = list(dict.fromkeys(SPACE))  # parameters of a transform that is off change nothing


def _agent(seed: int = 5) -> OptunaAgent:
    return OptunaAgent("optuna", seed, storage="memory")


def _walk(seed: int, n: int) -> list[str]:
    agent, view, out = _agent(seed), view_of(), []
    for _ in range(n):
        p = agent.propose(view, SPACE)
        assert p is not None
        out.append(p.candidate.id)
        agent.tried.add(p.candidate.id)
        view.take(claim(p.candidate))
        view.feed.add(result(p.candidate, 100.0 + len(out)))
    return out


def test_seeded_and_never_repeats() -> None:
    a = _walk(5, 20)
    assert a == _walk(5, 20) and a != _walk(6, 20)
    assert len(set(a)) == 20 and REFERENCE_CANDIDATE.id not in a


def test_covers_the_whole_space_then_stops() -> None:
    agent, view, ids = _agent(), view_of(), set()
    while (p := agent.propose(view, SPACE)) is not None:
        assert p.candidate.id not in ids and not p.candidate.is_reference
        ids.add(p.candidate.id)
        agent.tried.add(p.candidate.id)
        view.take(claim(p.candidate))
    assert len(ids) == len(DISTINCT) == 4 * 2 * 2 * (1 + 3) - 1


def test_skips_claims_and_learns_other_agents_results() -> None:
    agent = _agent()
    others = DISTINCT[:10]
    view = view_of(
        result(REFERENCE_CANDIDATE, 100.0, agent="baseline"),
        *(result(c, 100.0 + i, agent="coordinate") for i, c in enumerate(others)),
        result(DISTINCT[10], 0.0, status="incorrect", agent="random"),
    )
    p = agent.propose(view, SPACE)
    assert p is not None and p.candidate.id not in view.claimed
    study = agent.study
    assert study is not None
    added = [t for t in study.trials if t.user_attrs.get("agent")]
    assert len(added) == 12  # baseline + 10 + the incorrect one
    assert sum(t.state == TrialState.COMPLETE for t in added) == 11
    assert sum(t.state == TrialState.FAIL for t in added) == 1
    assert study.best_value == pytest.approx(109.0)


def test_tells_its_own_trials_their_results() -> None:
    agent, view = _agent(), view_of()
    p = agent.propose(view, SPACE)
    assert p is not None
    agent.tried.add(p.candidate.id)
    view.take(claim(p.candidate))
    view.feed.add(result(p.candidate, 321.0))
    q = agent.propose(view, SPACE)
    assert q is not None and agent.study is not None
    mine = next(t for t in agent.study.trials if t.user_attrs.get("candidate_id") == p.candidate.id)
    assert mine.state == TrialState.COMPLETE and mine.value == 321.0
    agent.tried.add(q.candidate.id)
    view.take(claim(q.candidate, seq=3))
    view.feed.add(result(q.candidate, 0.0, status="crashed"))
    agent.propose(view, SPACE)
    theirs = next(
        t for t in agent.study.trials if t.user_attrs.get("candidate_id") == q.candidate.id
    )
    assert theirs.state == TrialState.FAIL


def test_storage_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KILN_OPTUNA_STORAGE", raising=False)
    monkeypatch.setenv("KILN_DATABASE_URL", "postgresql+asyncpg://u@db:5432/kiln")
    assert resolve_storage() is None  # the agent never opens the ledger's database
    monkeypatch.setenv("KILN_OPTUNA_STORAGE", "memory")
    assert resolve_storage() is None
    monkeypatch.setenv("KILN_OPTUNA_STORAGE", "sqlite:///x.db")
    assert resolve_storage() == "sqlite:///x.db"
    assert resolve_storage("postgresql://a@b/c") == "postgresql+psycopg://a@b/c"
    assert sync_url("postgresql+psycopg://a@b/c") == "postgresql+psycopg://a@b/c"
    assert study_name("abc", "optuna-2") == "kiln-abc-optuna-2"


def test_resumes_a_study_from_its_storage(tmp_path) -> None:  # type: ignore[no-untyped-def]
    url = f"sqlite:///{tmp_path / 'studies.db'}"
    first, view = OptunaAgent("optuna", 3, storage=url), view_of()
    p = first.propose(view, SPACE)
    assert p is not None
    first.tried.add(p.candidate.id)
    view.take(claim(p.candidate))
    # a restarted runner: a new agent object, the same study; the result arrives afterwards
    view.feed.add(result(p.candidate, 250.0))
    second = OptunaAgent("optuna", 3, storage=url)
    q = second.propose(view, SPACE)
    assert q is not None and q.candidate.id != p.candidate.id
    study = optuna.load_study(study_name="kiln-c1-optuna", storage=url)
    told = [t for t in study.trials if t.user_attrs.get("candidate_id") == p.candidate.id]
    assert [t.state for t in told] == [TrialState.COMPLETE] and told[0].value == 250.0


def test_a_restarted_agent_in_memory_rebuilds_its_study_from_the_results() -> None:
    """No storage: a new agent object (a restarted runner) models every result already on the
    board, its predecessor's included, and proposes none of the candidates already taken."""
    first, view = _agent(3), view_of()
    taken = []
    for i in range(3):
        p = first.propose(view, SPACE)
        assert p is not None
        first.tried.add(p.candidate.id)
        taken.append(p.candidate.id)
        view.take(claim(p.candidate, seq=2 * i + 1))
        view.feed.add(result(p.candidate, 100.0 + i))
    second = _agent(3)
    q = second.propose(view, SPACE)
    assert q is not None and q.candidate.id not in taken
    assert second.study is not None
    modelled = {t.user_attrs.get("candidate_id"): t.value for t in second.study.trials}
    assert [modelled.get(cid) for cid in taken] == [100.0, 101.0, 102.0]
