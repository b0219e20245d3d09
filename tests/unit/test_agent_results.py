"""The result feed agents read results from (the runner's fold of the ledger, not the board):
what it keeps, its initial fill on a resumed compilation, the lab feeding it, and the board no
longer carrying results. Pure: no services."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from kiln.agent_runner.agents.view import BoardView
from kiln.agent_runner.budget import ExperimentBudget
from kiln.agent_runner.lab import CompilationLab
from kiln.agent_runner.results import ResultFeed, SearchResult
from kiln.agent_runner.state import Baseline, CompilationState, ExperimentRecord
from kiln.board import Board
from kiln.common import nats as kn
from kiln.common.errors import InvalidArgument
from kiln.domain.baselines import compare_agent
from kiln.domain.candidate import REFERENCE_CANDIDATE, Candidate
from kiln.ledger.model import NewEvent

from .agent_records import add as _add
from .agent_records import done as _done
from .agent_records import new_state as _state

REF = REFERENCE_CANDIDATE
A = Candidate.make({"attention": "sdpa"})
B = Candidate.make({"mlp": "fused_gate_up"})
C = Candidate.make({"qkv_proj": "fused"})


def test_the_feed_keeps_one_result_per_experiment_and_tells_its_listeners_at_once() -> None:
    feed, heard = ResultFeed("c1"), []
    stop = feed.listen(heard.append)
    req, completed = _done(A, "coordinate", 150.0)
    assert feed.take(req, completed, 1.5)
    assert not feed.take(req, completed, 1.5)  # idempotent by experiment id
    [entry] = heard
    assert (entry.experiment_id, entry.candidate, entry.agent, entry.ok) == (
        req.experiment_id,
        A,
        "coordinate",
        True,
    )
    assert entry.tokens_per_s == 150.0 and entry.body["speedup"] == 1.5
    assert entry.body["candidate"] == A.canonical() and entry.body["status"] == "ok"
    bad_req, bad = _done(B, "random", 0.0, status="crashed")
    stop()
    assert feed.take(bad_req, bad, None)
    assert len(heard) == 1  # stopped listening
    assert [r.ok for r in feed] == [True, False]
    assert [b["candidate"] for b in feed.bodies()] == [A.canonical(), B.canonical()]


def test_confirmations_and_baseline_comparisons_are_not_search_results() -> None:
    feed = ResultFeed("c1")
    assert not feed.take(*_done(A, "confirm", 90.0, tier="full"), 1.2)
    assert not feed.take(*_done(REF, compare_agent("hf_eager"), 50.0, tier="full"), None)
    assert not feed.take(*_done(REF, compare_agent("hf_eager"), 50.0), None)
    assert len(feed) == 0


def test_a_restarted_runners_agents_see_the_results_completed_before_the_restart() -> None:
    state = _state()
    base_req, _ = _add(state, REF, "baseline", 100.0, op_ms={"mlp": 1.5})
    state.baseline = Baseline(base_req.experiment_id, REF.id, 100.0, 10.0)
    _add(state, A, "coordinate", 150.0)
    _add(state, B, "random", 0.0, status="incorrect")
    _add(state, A, "confirm", 80.0, tier="full")  # a confirmation: not a search result
    pending, _ = _done(C, "optuna", 1.0)
    state.experiments[pending.experiment_id] = ExperimentRecord(pending)  # still in flight
    feed = ResultFeed("c1")
    assert feed.fill(state) == 3
    assert [(r.candidate, r.agent) for r in feed] == [
        (REF, "baseline"),
        (A, "coordinate"),
        (B, "random"),
    ]
    assert [b["speedup"] for b in feed.bodies()] == [1.0, 1.5, None]
    assert next(iter(feed)).op_ms == {"mlp": 1.5}
    assert feed.fill(state) == 0  # filling again changes nothing

    view = BoardView(cast(Board, None), "c1", feed)  # what an agent of the new runner sees
    assert set(view.results) == {REF.id, A.id, B.id} <= view.claimed
    assert [s.candidate for s in view.ranked()] == [A, REF]
    assert view.in_flight == set()
    req, completed = _done(C, "optuna", 120.0)
    feed.take(req, completed, 1.2)  # judged after the restart: the view hears of it at once
    assert view.results[C.id].tokens_per_s == 120.0


def test_nothing_is_filled_before_the_baseline_is_recorded() -> None:
    state = _state()
    _add(state, REF, "baseline", 100.0)  # completed, BaselineMeasured lost in the stop
    assert ResultFeed("c1").fill(state) == 0  # the runner judges it again, which feeds it


def _lab(state: CompilationState) -> CompilationLab:
    async def append(event: NewEvent) -> None:
        assert isinstance(event.data, dict)
        state.apply_data(event.type, event.data, state.version + 1)

    return CompilationLab(
        state,
        cast(Any, None),
        ExperimentBudget(limit=0),
        dispatcher=cast(Any, None),
        board=cast(Board, None),
        space=cast(Any, None),
        append=append,
        stop=asyncio.Event(),
    )


async def test_the_lab_feeds_every_search_tier_judgement_and_only_those() -> None:
    state = _state()
    lab = _lab(state)
    assert len(lab.results) == 0
    base = _done(REF, "baseline", 100.0)
    outcome = await lab.judge(*base)
    assert state.baseline is not None and outcome.speedup == 1.0
    await lab.judge(*base)  # judged again (a restart): still one result
    await lab.judge(*_done(A, "coordinate", 200.0))
    await lab.judge(*_done(REF, "confirm", 50.0, tier="full"))
    assert [(r.candidate, r.body["speedup"]) for r in lab.results] == [(REF, 1.0), (A, 2.0)]


def test_a_resumed_compilations_lab_starts_with_the_results_of_its_state() -> None:
    state = _state()
    base_req, _ = _add(state, REF, "baseline", 100.0, op_ms={"mlp": 1.5})
    state.baseline = Baseline(base_req.experiment_id, REF.id, 100.0, 10.0)
    _add(state, A, "coordinate", 150.0)
    assert [r.candidate for r in _lab(state).results] == [REF, A]


def test_the_board_carries_no_results() -> None:
    assert kn.BOARD_KINDS == ("idea", "claim")
    assert not hasattr(Board, "post_result")
    with pytest.raises(InvalidArgument):
        kn.board_subject("kiln", "c1", "result", "x")
    with pytest.raises(InvalidArgument):
        kn.board_filter("kiln", "c1", "result")
    with pytest.raises(InvalidArgument):
        kn.parse_board_subject("kiln", "kiln.board.c1.result.x")


def test_search_results_are_plain_data() -> None:
    r = SearchResult(A, 1.0, True, "a", experiment_id="e1", body={"x": 1})
    # bodies and profiles do not compare
    assert r == SearchResult(A, 1.0, True, "a", experiment_id="e1")
