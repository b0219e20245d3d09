"""Helpers for the strategy tests: a BoardView filled by hand (no NATS), claim posts and the
result feed's entries."""

from __future__ import annotations

import itertools
from typing import Any, cast

from kiln.agent_runner.agents.view import BoardView
from kiln.agent_runner.results import ResultFeed, SearchResult, result_body
from kiln.board import Board, BoardPost
from kiln.domain.candidate import Candidate

_experiments = itertools.count(1)


def view_of(*items: BoardPost | SearchResult, compilation_id: str = "c1") -> BoardView:
    """A view of a fresh result feed, with ``items`` folded in order: claims as board posts,
    results through the feed."""
    view = BoardView(cast(Board, None), compilation_id, ResultFeed(compilation_id))
    for item in items:
        if isinstance(item, SearchResult):
            view.feed.add(item)
        else:
            view.take(item)
    return view


def result(
    c: Candidate,
    tps: float,
    *,
    status: str = "ok",
    agent: str = "x",
    op_ms: dict[str, float] | None = None,
    shape: dict[str, int] | None = None,
    speedup: float | None = None,
) -> SearchResult:
    """A search result for ``c`` at ``tps`` tokens/s (with a per-op profile if given), of a
    new experiment."""
    summary: dict[str, Any] = {"status": status, "correct": status == "ok", "tokens_per_s": tps}
    if op_ms is not None:
        summary["op_ms"] = op_ms
        summary["op_profile_shape"] = shape or {}
    return SearchResult(
        experiment_id=f"exp-{next(_experiments)}",
        candidate=c,
        tokens_per_s=tps,
        ok=status == "ok",
        agent=agent,
        op_ms=dict(op_ms or {}),
        op_profile_shape=dict(shape or {}),
        body=result_body(c, summary, speedup),
    )


def claim(c: Candidate, agent: str = "x", seq: int = 1) -> BoardPost:
    """A claim post for ``c``."""
    return BoardPost(kind="claim", compilation_id="c1", candidate_id=c.id, agent=agent, seq=seq)
